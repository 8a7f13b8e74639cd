"""The drafter recipe on a tiny target: position weights, and a few training steps lower the
loss and export a drafter that loads and whose evaluation (through the engine) decodes what
transformers' greedy ``generate`` does."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree.train.drafter import DrafterShape, DrafterTrainConfig, position_weights, train_drafter
from ddtree.train.eval import greedy_acceptance


def test_position_weights_decay_and_sum_to_one():
    w = position_weights(8, gamma=4.0)
    assert w.shape == (7,)
    assert torch.all(w[1:] < w[:-1])
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))
    torch.testing.assert_close(w[1] / w[0], torch.tensor(float(torch.exp(torch.tensor(-0.25)))))


@pytest.mark.slow
def test_drafter_trains_exports_and_decodes_losslessly(tiny_target, tmp_path):
    cfg = DrafterTrainConfig(
        steps=8, seqs_per_step=4, anchors_per_step=2, lr=1e-2, warmup_steps=1,
        n_sequences=8, prompt_len=12, new_tokens=20, gen_batch=8, max_files=30,
        save_every=4, log_every=4, eval_prompts=2, eval_budget=8, eval_new_tokens=12,
    )  # fmt: skip
    shape = DrafterShape(
        num_hidden_layers=1,
        intermediate_size=64,
        head_dim=16,
        block_size=4,
        target_layer_ids=(0, 1),
    )
    result = train_drafter(cfg, tiny_target, tmp_path, shape=shape, show_progress=False)
    assert result.losses[-1] < result.losses[0]
    assert 1.0 <= result.mean_tau <= shape.block_size
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [0, 1]

    from ddtree.models.adapters.dflash import DFlashDrafter
    from ddtree.models.adapters.mla_moe import MlaMoeTarget

    target = MlaMoeTarget.from_pretrained(tiny_target)
    drafter = DFlashDrafter.from_pretrained(tmp_path, target)
    prompts = torch.randint(2, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    tree = greedy_acceptance(target, drafter, prompts, budget=6, max_new_tokens=15)
    reference = transformers_greedy(tiny_target, prompts, 15, target.info.eos_token_ids)
    assert tree.outputs == reference
    assert all(1 <= t <= shape.block_size for per in tree.taus for t in per)


def transformers_greedy(path, prompts: torch.Tensor, max_new_tokens: int, eos) -> list[list[int]]:
    """transformers' own greedy ``generate`` on the exported target directory, cut after EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = model.generate(
            prompt[None],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos) or None,
            pad_token_id=0,
        )[0, prompt.numel() :].tolist()
        stops = [i for i, t in enumerate(ids) if t in eos]
        out.append(ids[: stops[0] + 1] if stops else ids)
    return out
