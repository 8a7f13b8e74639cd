"""Room 3: the per-step cost model (``step``) and the physics a point must obey (``physics``)."""
