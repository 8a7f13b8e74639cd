"""Targets and drafters behind two small protocols (see ``ddtree.models.base``).

Entry points: :func:`load_target` (our MLA+MoE model for DeepSeek-V3 / Kimi-K2 configs, the
transformers wrapper for any other causal LM, ``impl`` forces either) and :func:`load_drafter`
(a z-lab-format DFlash drafter, checked against its target before loading).

Heavy modules (transformers, the implementations) are imported inside the functions, so that
``import ddtree.models`` stays cheap.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddtree.models.base import ModelInfo

# config.json model_type / architectures served by our MLA+MoE implementation.
MLA_MOE_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
MLA_MOE_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
TARGET_IMPLS = ("auto", "mla_moe", "hf")
DRAFTER_ARCHITECTURES = ("DFlashDraftModel",)


class UnsupportedModelError(ValueError):
    """A config.json whose architecture no implementation here can run."""


def choose_target_impl(config: dict, source: str, impl: str = "auto") -> str:
    """``"mla_moe"`` or ``"hf"`` for a target ``config.json`` dict (``source`` names the file).

    ``auto``: our MLA+MoE for DeepSeek-V3 / Kimi-K2 configs (``model_type`` or
    ``architectures``), the transformers wrapper for any other causal LM transformers knows.
    """
    if impl not in TARGET_IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {TARGET_IMPLS}")
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    is_mla_moe = model_type in MLA_MOE_MODEL_TYPES or any(
        a in MLA_MOE_ARCHITECTURES for a in architectures
    )
    if impl == "mla_moe" or (impl == "auto" and is_mla_moe):
        if not is_mla_moe:
            raise UnsupportedModelError(
                f"{source}: impl='mla_moe' needs model_type in {MLA_MOE_MODEL_TYPES} or "
                f"architectures in {MLA_MOE_ARCHITECTURES}; got model_type={model_type!r}, "
                f"architectures={architectures}"
            )
        return "mla_moe"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        hint = " (the MLA+MoE implementation serves it: use impl='mla_moe')" if is_mla_moe else ""
        raise UnsupportedModelError(
            f"{source}: model_type={model_type!r} (architectures={architectures}) is not a "
            f"causal LM that transformers knows{hint}; supported: DeepSeek-V3 / Kimi-K2 "
            f"configs (impl='mla_moe') and transformers causal LMs such as qwen3, llama"
        )
    return "hf"


def load_target(
    path: str | Path,
    impl: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp: int = 1,
    ep: int = 1,
    **kwargs,
):
    """Load a target checkpoint directory (config.json + safetensors) as a ``Target``.

    ``tp`` > 1 splits our MLA+MoE target over that many processes (``ep``: routed experts in
    that many groups), see ``ddtree.models.parallel.load_parallel_target``. ``kwargs`` go to
    the implementation's loader (e.g. ``attn_impl`` for ``mla_moe``, ``attn_implementation``
    for ``hf``).
    """
    from ddtree.models.checkpoint import read_config

    path = Path(path)
    config = read_config(path)
    chosen = choose_target_impl(config, str(path / "config.json"), impl)
    if tp != 1 or ep != 1:
        if chosen != "mla_moe":
            raise UnsupportedModelError(
                f"{path / 'config.json'}: tp={tp}, ep={ep} split our MLA+MoE target only "
                f"(DeepSeek-V3 / Kimi-K2 configs); model_type={config.get('model_type')!r} "
                f"runs on one process (tp=1)"
            )
        from ddtree.models.parallel import load_parallel_target

        return load_parallel_target(path, tp, ep, dtype=dtype, device=device, **kwargs)
    if chosen == "mla_moe":
        from ddtree.models.mla_moe import MlaMoeTarget

        return MlaMoeTarget.from_pretrained(path, dtype=dtype, device=device, **kwargs)
    from ddtree.models.hf import HFTarget

    return HFTarget.from_pretrained(path, dtype=dtype, device=device, **kwargs)


def drafter_target_layer_ids(config: dict) -> list[int]:
    """``target_layer_ids`` of a DFlash ``config.json`` (``dflash_config`` first, then the top
    level, else the reference default spread over ``num_target_layers``)."""
    dflash = config.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    if ids is not None:
        return [int(i) for i in ids]
    n_target, n_draft = config.get("num_target_layers"), config.get("num_hidden_layers")
    if n_target is None or n_draft is None:
        return []
    if n_draft == 1:
        return [n_target // 2]
    # evenly from layer 1 to layer n_target - 3, as the DFlash reference picks them
    first, last = 1, n_target - 3
    return [round(first + i * (last - first) / (n_draft - 1)) for i in range(n_draft)]


def check_drafter_compat(config: dict, target: ModelInfo, source: str) -> list[int]:
    """Check a DFlash drafter ``config.json`` (``source``) against its target; returns the
    target layer ids. Errors name the file, the field and the target."""
    who = f"target {target.name!r} ({target.architecture})"
    architectures = config.get("architectures") or []
    if not any(a in DRAFTER_ARCHITECTURES for a in architectures):
        raise UnsupportedModelError(
            f"{source}: field architectures={architectures}, expected one of "
            f"{DRAFTER_ARCHITECTURES} (a z-lab-format DFlash drafter)"
        )
    for field, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        got = config.get(field)
        if got is not None and int(got) != want:
            raise ValueError(f"{source}: field {field}={got} but {who} has {field}={want}")
    ids = drafter_target_layer_ids(config)
    if not ids:
        raise ValueError(
            f"{source}: no dflash_config.target_layer_ids and no num_target_layers to derive them"
        )
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(
            f"{source}: dflash_config.target_layer_ids {ids} include {bad}, outside "
            f"0..{target.num_layers - 1} for {who} with {target.num_layers} layers"
        )
    mask_id = (config.get("dflash_config") or {}).get("mask_token_id", config.get("mask_token_id"))
    if mask_id is not None and not 0 <= int(mask_id) < target.vocab_size:
        raise ValueError(
            f"{source}: dflash_config.mask_token_id={mask_id} outside the vocabulary of {who} "
            f"(vocab_size={target.vocab_size})"
        )
    return ids


def load_drafter(
    path: str | Path,
    target,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
):
    """Load a DFlash drafter directory for ``target`` (it shares the target's embedding and
    LM head). ``dtype``/``device`` None: the target's."""
    from ddtree.models.checkpoint import read_config

    path = Path(path)
    check_drafter_compat(read_config(path), target.info, str(path / "config.json"))
    from ddtree.models.dflash import DFlashDrafter

    return DFlashDrafter.from_pretrained(path, target, dtype=dtype, device=device)


__all__ = [
    "UnsupportedModelError",
    "check_drafter_compat",
    "choose_target_impl",
    "drafter_target_layer_ids",
    "load_drafter",
    "load_target",
]
