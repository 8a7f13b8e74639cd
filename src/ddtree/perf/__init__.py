"""The grounded estimator: hardware catalog, per-step cost model, calibration, projection.

Rooms, in import order (a room imports only rooms above it; ``tests/perf/test_rooms.py``):

1. ``hardware``   units and the hardware catalog (GPUs, hosts, links)
2. ``shapes``     model shapes and the ``config.json`` readers
3. ``cost``       the per-step cost model and the physics a point must obey
4. ``inputs``     scenario files, measured acceptance, anchors from measurement records
5. ``projection`` calibration, uncertainty, the estimate of every case, budget tuning
6. ``validation`` scores on the published corpus; diagnosis of two engine runs
7. ``report``     terminal tables, JSON, the Markdown report and its plots

``data/`` holds the measured and sourced inputs (catalog, kernels, configs, the corpus).
"""
