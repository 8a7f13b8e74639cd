"""The bundled demo pair: within the size limit, loads with both target loaders (which
agree), and the drafter loads onto our target."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest
import torch

DEMO = Path(str(files("ddtree") / "assets" / "demo"))
SIZE_LIMIT_BYTES = 20 * 1000 * 1000

pytestmark = pytest.mark.skipif(
    not (DEMO / "drafter" / "model.safetensors").is_file(), reason="demo pair not bundled yet"
)


def test_demo_pair_fits_the_size_limit():
    total = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert total <= SIZE_LIMIT_BYTES, f"{total / 1e6:.1f} MB in {DEMO}"
    assert not list(DEMO.rglob("checkpoint")), "training checkpoints must not be shipped"


def test_demo_target_loads_in_both_implementations():
    from transformers import AutoModelForCausalLM

    from ddtree.models.adapters.mla_moe import MlaMoeTarget

    torch.set_num_threads(1)
    ours = MlaMoeTarget.from_pretrained(DEMO / "target")
    hf = AutoModelForCausalLM.from_pretrained(str(DEMO / "target"), dtype=torch.float32).eval()
    ids = torch.randint(2, ours.info.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(ours.prefill(ids).logits, ref, rtol=1e-4, atol=1e-4)
    config = json.loads((DEMO / "target" / "config.json").read_text())
    assert config["first_k_dense_replace"] == 1 and config["n_group"] == 1
    assert config["q_lora_rank"] and config["kv_lora_rank"] and config["n_shared_experts"] == 1


def test_demo_drafter_loads_on_the_target_and_tokenizer_round_trips():
    from ddtree.models.adapters.dflash import DFlashDrafter
    from ddtree.models.adapters.mla_moe import MlaMoeTarget
    from ddtree.train.tokenizer import MASK_TOKEN, load_tokenizer, special_id

    target = MlaMoeTarget.from_pretrained(DEMO / "target")
    drafter = DFlashDrafter.from_pretrained(DEMO / "drafter", target)
    tok = load_tokenizer(DEMO / "target")
    assert drafter.config.mask_token_id == special_id(tok, MASK_TOKEN)
    text = "def main(argv=None):\n    return 0\n"
    assert tok.decode(tok.encode(text).ids) == text
