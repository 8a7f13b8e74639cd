"""The ``Target`` adapter over our Qwen3 / Qwen3-MoE / Llama decoder
(:mod:`ddtree.models.nn.decoder`): its static KV cache, model info and checkpoint loading.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddtree.models.adapters.target import CachedTarget
from ddtree.models.nn.decoder import (
    DecoderConfig,
    DecoderModel,
    KVCache,
    build_model,
    expected_shapes,
    fuse_checkpoint_experts,
    model_info,
)


class DecoderTarget(CachedTarget):
    """The ``Target`` protocol over :class:`DecoderModel` with a static KV cache."""

    def __init__(
        self,
        model: DecoderModel,
        name: str = "decoder",
        capacity: int = 256,
        check_finite: bool = True,
    ) -> None:
        param = next(model.parameters())
        capacity = min(capacity, model.config.max_position_embeddings)
        cache = KVCache(model.config, capacity, param.dtype, param.device)
        info = model_info(model.config, model, name, param.dtype)
        super().__init__(model, cache, info, check_finite=check_finite)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        capacity: int = 4096,
        check_finite: bool = True,
    ) -> DecoderTarget:
        from ddtree.models.loading.checkpoint import (
            load_safetensors,
            match_state_dict,
            read_config,
            weight_files,
        )

        path = Path(path)
        source = str(path / "config.json")
        raw = read_config(path)
        weight_files(path)  # refuses pickles, names missing shards, before any parsing
        config = DecoderConfig.from_hf(raw, source=source)
        tensors = fuse_checkpoint_experts(load_safetensors(path), config, str(path))
        match_state_dict(expected_shapes(config), tensors, str(path))
        model = build_model(config, tensors, dtype, device)
        return cls(model, name=path.name, capacity=capacity, check_finite=check_finite)
