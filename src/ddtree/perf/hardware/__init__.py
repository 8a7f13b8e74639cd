"""Room 1: units (SI quantities with dimensions) and the hardware catalog."""
