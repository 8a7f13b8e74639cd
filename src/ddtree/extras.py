"""The optional extras of pyproject.toml and the packages each one brings.

The base install decodes, benchmarks and estimates; ``[serve]`` adds the HTTP server and its
load client, ``[report]`` the estimator's and tune's plots. A command that needs an extra
calls ``require_extra`` before any work, so a missing package is one line naming the extra,
not a traceback after the models have loaded::

    require_extra("serve", "ddtree serve")
"""

from __future__ import annotations

import importlib

from ddtree.errors import MissingExtraError

# extra -> the modules it installs (the import names of its packages in pyproject.toml)
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("starlette", "uvicorn", "prometheus_client", "httpx"),
    "report": ("matplotlib",),
}


def require_extra(extra: str, what: str) -> None:
    """Import the modules of ``extra``; one that is missing raises ``MissingExtraError``:
    ``{what} needs the [{extra}] extra (No module named 'x'): pip install 'ddtree[{extra}]'``."""
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise MissingExtraError(
                f"{what} needs the [{extra}] extra ({e}): pip install 'ddtree[{extra}]'"
            ) from None
