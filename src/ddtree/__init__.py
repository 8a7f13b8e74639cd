"""ddtree: lossless DDTree speculative decoding and a grounded decode-speed estimator.

Layers import downwards only: cli -> commands -> serve, bench, replay -> train -> engine ->
models -> tree; perf (the estimator) imports no torch. pyproject.toml's [tool.importlinter]
holds the contracts; tests/test_imports.py runs them.
"""

__version__ = "0.1.0"
