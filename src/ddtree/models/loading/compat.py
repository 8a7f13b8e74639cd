"""A drafter's config.json checked against its target before anything loads, and the error an
unusable config.json raises: the leaf that the registry (``ddtree.models``) and the DFlash
implementation share (an implementation never imports the registry)."""

from __future__ import annotations

from ddtree.models.base import ModelInfo

DRAFTER_ARCHITECTURES = ("DFlashDraftModel",)


class UnsupportedModelError(ValueError):
    """A config.json whose architecture no implementation here can run."""


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
