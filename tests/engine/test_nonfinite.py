"""NaN/inf logits from the drafter stop a run with the target's error type
(``NonFiniteLogitsError``, which the CLI turns into its one-line error)."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine import DecodeConfig, generate
from ddtree.errors import NonFiniteLogitsError

from .helpers import random_dflash_drafter, tiny_mla_target


@pytest.mark.parametrize("policy", ["chain", "ddtree"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_drafter_logits_stop_the_run(policy, value):
    target = tiny_mla_target(seed=0)
    drafter = random_dflash_drafter(target, block=4, seed=1, mask_token_id=60)
    cfg = DecodeConfig(policy, block_size=4, budget=8, max_new_tokens=12)
    assert len(generate(target, drafter, [1, 2, 3], cfg).tokens) == 12  # finite: runs
    with torch.no_grad():
        drafter.model.layers[0].mlp.down_proj.weight[0, 0] = value
    with pytest.raises(NonFiniteLogitsError, match=r"^drafter dflash: NaN/inf logits"):
        generate(target, drafter, [1, 2, 3], cfg)


def test_nonfinite_target_logits_stop_the_run_with_the_same_error_type():
    target = tiny_mla_target(seed=0)
    with torch.no_grad():
        target.model.lm_head.weight[5, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="NaN/inf in logits at positions 0..2"):
        generate(target, None, [1, 2, 3], DecodeConfig("ar", max_new_tokens=4))
