"""ddtree: lossless DDTree speculative decoding and a grounded decode-speed estimator.

Layers import downwards only: cli -> engine, perf, bench -> models -> tree.
"""

__version__ = "0.1.0"
