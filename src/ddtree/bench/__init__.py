"""Measurement harnesses that emit measurement records (``ddtree.records``)."""
