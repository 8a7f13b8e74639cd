"""The ``Target`` adapter over our MLA+MoE model (:mod:`ddtree.models.nn.mla_moe`): its latent
KV cache, model info and checkpoint loading (batch of 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddtree.models.adapters.target import CachedTarget
from ddtree.models.base import ModelInfo
from ddtree.models.loading.quant import load_weights
from ddtree.models.nn.mla_moe import (
    LatentCache,
    MlaMoeConfig,
    MlaMoeModel,
    build_model,
    expected_shapes,
    fuse_per_expert,
)


class MlaMoeTarget(CachedTarget):
    """The ``Target`` protocol over :class:`MlaMoeModel` with a latent KV cache (batch of 1)."""

    plain_linears = ("kv_b_proj",)  # absorbed attention reads its weight as W_UK and W_UV

    def __init__(
        self,
        model: MlaMoeModel,
        name: str = "mla_moe",
        capacity: int = 256,
        check_finite: bool = True,
    ) -> None:
        c = model.config
        param = next(model.parameters())
        capacity = min(capacity, c.max_position_embeddings)
        cache = LatentCache(c, capacity, param.dtype, param.device)
        info = ModelInfo(
            name=name,
            architecture=c.architecture,
            implementation="mla_moe",
            n_params=sum(p.numel() for p in model.parameters()),
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            dtype=str(param.dtype).removeprefix("torch."),
            max_position=c.max_position_embeddings,
            eos_token_ids=c.eos_token_ids,
            quantization=c.quantization.description if c.quantization else "",
        )
        super().__init__(model, cache, info, check_finite=check_finite)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_impl: str = "absorbed",
        capacity: int = 4096,
        check_finite: bool = True,
    ) -> MlaMoeTarget:
        from ddtree.models.loading.checkpoint import match_state_dict, read_config

        path = Path(path)
        config = MlaMoeConfig.from_hf(read_config(path), source=str(path / "config.json"))
        tensors = fuse_per_expert(load_weights(path, config.quantization, dtype), config)
        match_state_dict(expected_shapes(config, attn_impl), tensors, str(path))
        model = build_model(config, attn_impl, tensors, dtype, device)
        return cls(model, name=path.name, capacity=capacity, check_finite=check_finite)
