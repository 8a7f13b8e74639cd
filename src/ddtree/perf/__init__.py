"""The grounded estimator: hardware catalog, per-step cost model, calibration, projection."""
