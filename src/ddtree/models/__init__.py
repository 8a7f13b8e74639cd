"""Targets and drafters behind two small protocols (see ``ddtree.models.base``).

Entry points: :func:`load_target` (the implementation chosen by the checkpoint's architecture
from :data:`TARGET_IMPLS`, ``impl`` forces one) and :func:`load_drafter` (a z-lab-format DFlash
drafter, checked against its target before loading). :func:`target_engine_modes` says which
engine modes a checkpoint will run in, before anything is loaded or compiled.

The registry imports its implementations (the architectures each serves come from them), never
the reverse: the drafter checks they share live in ``ddtree.models.loading.compat``. The transformers
wrapper is imported only when it loads (transformers is slow to import).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.models.adapters.dflash import DFlashDrafter
from ddtree.models.loading.compat import (
    DRAFTER_ARCHITECTURES,
    UnsupportedModelError,
    check_drafter_compat,
    drafter_target_layer_ids,
)
from ddtree.models.nn import decoder, mla_moe

# the engine modes each implementation runs are declared once, on its class (``engine_modes``):
# the pre-load check reads them here, the engine reads them on the loaded model
DRAFTER_ENGINE_MODES = DFlashDrafter.engine_modes


@dataclass(frozen=True)
class TargetImpl:
    """One target implementation: the checkpoints it serves and what it can run."""

    name: str
    summary: str
    target_class: str  # "module:Class", imported when loading
    model_types: tuple[str, ...] = ()  # config.json model_type values chosen automatically
    architectures: tuple[str, ...] = ()  # ... or architectures entries
    parallel: bool = False  # splits over --tp processes

    @property
    def engine_modes(self) -> tuple[str, ...]:
        """What its class declares (importing it: the transformers wrapper imports
        transformers)."""
        return self.load().engine_modes

    def serves(self, config: dict) -> bool:
        architectures = config.get("architectures") or []
        return config.get("model_type") in self.model_types or any(
            a in self.architectures for a in architectures
        )

    def load(self):
        module, _, name = self.target_class.partition(":")
        return getattr(importlib.import_module(module), name)


TARGET_IMPLS: dict[str, TargetImpl] = {
    impl.name: impl
    for impl in (
        TargetImpl(
            "mla_moe",
            "our MLA+MoE model (DeepSeek-V3 / Kimi-K2 configs)",
            "ddtree.models.adapters.mla_moe:MlaMoeTarget",
            mla_moe.SUPPORTED_MODEL_TYPES,
            mla_moe.ARCHITECTURES,
            parallel=True,
        ),
        TargetImpl(
            "decoder",
            "our Qwen3 / Qwen3-MoE / Llama decoder",
            "ddtree.models.adapters.decoder:DecoderTarget",
            tuple(decoder.FAMILIES),
            tuple(decoder.ARCHITECTURES.values()),
        ),
        TargetImpl(
            "hf",
            "the transformers wrapper (any causal LM transformers knows; eager only)",
            "ddtree.models.adapters.hf:HFTarget",
        ),
    )
}
OUR_IMPLS = tuple(name for name, impl in TARGET_IMPLS.items() if impl.model_types)


def choose_target_impl(config: dict, source: str, impl: str = "auto") -> TargetImpl:
    """The implementation for a target ``config.json`` dict (``source`` names the file).

    ``auto``: ours when one serves the architecture, else the transformers wrapper for any
    causal LM transformers knows. Forcing one of ours on another architecture is an error
    naming what it serves.
    """
    if impl != "auto" and impl not in TARGET_IMPLS:
        raise ValueError(f"impl={impl!r}: expected auto or one of {', '.join(TARGET_IMPLS)}")
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if "dflash_config" in config or set(architectures) & set(DRAFTER_ARCHITECTURES):
        raise UnsupportedModelError(
            f"{source}: a DFlash drafter checkpoint (architectures={architectures}, "
            f"dflash_config); expected a target's: give it as the drafter (--drafter)"
        )
    ours = [TARGET_IMPLS[name] for name in OUR_IMPLS if TARGET_IMPLS[name].serves(config)]
    if impl == "auto" and ours:
        return ours[0]
    if impl != "auto" and TARGET_IMPLS[impl].model_types:
        chosen = TARGET_IMPLS[impl]
        if not chosen.serves(config):
            raise UnsupportedModelError(
                f"{source}: impl={impl!r} ({chosen.summary}) needs model_type in "
                f"{chosen.model_types} or architectures in {chosen.architectures}; got "
                f"model_type={model_type!r}, architectures={architectures}"
            )
        return chosen
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        hint = f" ({ours[0].summary} serves it: use impl={ours[0].name!r})" if ours else ""
        supported = "; ".join(f"{i.name}: {i.summary}" for i in TARGET_IMPLS.values())
        raise UnsupportedModelError(
            f"{source}: model_type={model_type!r} (architectures={architectures}) is not a "
            f"causal LM that transformers knows{hint}; supported: {supported}"
        )
    return TARGET_IMPLS["hf"]


def target_engine_modes(path: str | Path, impl: str = "auto", tp: int = 1) -> tuple[str, ...]:
    """The engine modes the target at ``path`` will run in, from its config.json alone (no
    weights read): its implementation's, eager only when split over processes."""
    from ddtree.models.loading.checkpoint import read_config

    path = Path(path)
    chosen = choose_target_impl(read_config(path), str(path / "config.json"), impl)
    if tp > 1:
        from ddtree.models.adapters.parallel import ParallelTarget

        return ParallelTarget.engine_modes
    return chosen.engine_modes


def check_checkpoint(path: Path, config: dict) -> None:
    """What every loader needs of a checkpoint before reading its weights, whichever
    implementation loads it: ``layer_types`` agreeing with ``num_hidden_layers``, no integer
    weights without a ``quantization_config`` (tensor names and shapes each loader checks
    against the model its config builds)."""
    from ddtree.models.loading.checkpoint import check_float_weights, check_layer_types

    check_layer_types(config, str(path / "config.json"))
    check_float_weights(path, config)


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
    that many groups), see ``ddtree.models.adapters.parallel.load_parallel_target``. ``kwargs`` go to
    the implementation's loader (e.g. ``attn_impl`` for ``mla_moe``, ``attn_implementation``
    for ``hf``).
    """
    from ddtree.models.loading.checkpoint import read_config

    path = Path(path)
    config = read_config(path)
    chosen = choose_target_impl(config, str(path / "config.json"), impl)
    check_checkpoint(path, config)
    if tp != 1 or ep != 1:
        if not chosen.parallel:
            parallel = [i.name for i in TARGET_IMPLS.values() if i.parallel]
            raise UnsupportedModelError(
                f"{path / 'config.json'}: tp={tp}, ep={ep} split the {', '.join(parallel)} "
                f"target only (DeepSeek-V3 / Kimi-K2 configs); model_type="
                f"{config.get('model_type')!r} ({chosen.name}) runs on one process (tp=1)"
            )
        from ddtree.models.adapters.parallel import load_parallel_target

        return load_parallel_target(path, tp, ep, dtype=dtype, device=device, **kwargs)
    target = chosen.load().from_pretrained(path, dtype=dtype, device=device, **kwargs)
    from ddtree.models.adapters.target import CachedTarget
    from ddtree.models.nn.linear import prepare_linears

    if isinstance(target, CachedTarget):  # ours (the transformers wrapper stays as it is)
        prepare_linears(target)
    return target


def load_drafter(
    path: str | Path,
    target,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    draft_vocab: int | None = None,
):
    """Load a DFlash drafter directory for ``target`` (it shares the target's embedding and
    LM head). ``dtype``/``device`` None: the target's. ``draft_vocab`` K: propose over the K
    most frequent tokens of the folder's ``draft_vocab.json`` counts and the target's
    EOS tokens (``ddtree.models.adapters.draft_vocab``; None, or K >= V: the full vocabulary)."""
    from ddtree.models.adapters.draft_vocab import draft_vocab_ids, load_token_counts
    from ddtree.models.loading.checkpoint import read_config

    path = Path(path)
    config = read_config(path)
    check_drafter_compat(config, target.info, str(path / "config.json"))
    check_checkpoint(path, config)
    vocab = target.info.vocab_size
    ids = draft_vocab_ids(  # before the weights: a missing counts file fails fast
        draft_vocab, vocab, lambda: load_token_counts(path, vocab), target.info.eos_token_ids
    )
    from ddtree.models.adapters.dflash import DFlashDrafter

    drafter = DFlashDrafter.from_pretrained(path, target, dtype=dtype, device=device)
    if ids is not None:
        drafter.restrict_vocab(ids)
    return drafter


__all__ = [
    "UnsupportedModelError",
    "check_drafter_compat",
    "TARGET_IMPLS",
    "choose_target_impl",
    "drafter_target_layer_ids",
    "load_drafter",
    "load_target",
    "target_engine_modes",
]
