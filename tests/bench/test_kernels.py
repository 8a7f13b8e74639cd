"""The kernel counts the estimator uses (ddtree/perf/data/kernels.toml) are what the profiler
counts on the bundled pair today: regenerated, not typed in."""

import tomllib
from importlib.resources import files

import pytest

from ddtree.bench import kernels


@pytest.mark.slow
def test_the_data_file_is_what_the_profiler_counts(capsys):
    assert kernels.main([]) == 0
    fresh = tomllib.loads(capsys.readouterr().out)
    stored = tomllib.loads(files("ddtree.perf").joinpath("data/kernels.toml").read_text())
    # the accept walk is one op in the C++ backend and several in the Python fallback
    assert fresh["measured"]["tree_backend"] == stored["measured"]["tree_backend"]
    assert fresh["kernels"] == stored["kernels"]
    assert fresh["measured"]["verify_width"] == stored["measured"]["verify_width"] == 9


def test_views_are_not_kernels_and_a_matmul_is_one():
    import torch

    x = torch.randn(8, 16)
    w = torch.randn(16, 4)
    assert kernels.count_ops(lambda: x.t().reshape(16, 8).transpose(0, 1)) == 0
    assert kernels.count_ops(lambda: x @ w) == 1
    assert kernels.count_ops(lambda: torch.nn.functional.linear(x, w.t())) == 1
    assert kernels.count_ops(lambda: x.argmax(dim=-1)) == 1  # its as_strided child is a view
