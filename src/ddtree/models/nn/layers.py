"""Layers and checks every model here shares: the MLA+MoE target, the Qwen3 / Llama decoder and
the DFlash drafter build from these, so a norm, a rotary table or a routed-expert dispatch is
written once.

- :class:`RMSNorm` (float32 accumulation, as transformers), :class:`GatedMLP` (SiLU-gated).
- Rotary embeddings: :class:`RopeSpec` read from a Hugging Face config (``rope_parameters`` of
  transformers 5 or the legacy ``rope_theta`` + ``rope_scaling``), inverse frequencies by rope
  type from one registry (``default``, ``linear``, ``llama3``, ``yarn``), :func:`rope_tables`
  (cos/sin of given positions) and :class:`RopeTables` (the rotation: rotate-half or
  interleaved pairs); :class:`Rotary` holds a model's inverse frequencies. The DFlash drafter
  computes its tables from the same spec (``DFlashConfig.rope``).
- :class:`Experts`: routed experts as fused 3D parameters with an eager sorted-token loop and a
  fixed-shape dispatch for compiled graphs; :func:`fuse_experts` stacks the per-expert tensors
  of published checkpoints into that layout.
- Checks: :func:`check_finite` (NaN/inf logits stop the run), :func:`check_capture_layers`,
  :func:`check_positions`, :func:`check_commit`: every adapter's (our targets', the transformers
  wrapper's, the drafter's), written once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.errors import NonFiniteLogitsError
from ddtree.models.loading.checkpoint import CheckpointError


class ConfigError(ValueError):
    """A config.json field a model here does not support (names the file and field)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, parameter names as transformers' (``gate_proj``...)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --- rotary embeddings ------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of ``dim`` dims: base ``theta``, a rope type and its parameters."""

    dim: int
    theta: float
    kind: str = "default"
    params: dict = field(default_factory=dict)

    @classmethod
    def from_hf(cls, cfg: dict, dim: int, source: str = "config.json") -> RopeSpec:
        """From ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = params.pop("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{source}: missing field rope_theta (or rope_parameters.rope_theta)")
        kind = params.pop("rope_type", params.pop("type", "default")) or "default"
        if kind not in ROPE_TYPES:
            raise ConfigError(
                f"{source}: field rope_type={kind!r}, expected one of {', '.join(ROPE_TYPES)}"
            )
        for name in ROPE_TYPES[kind].needs:
            if params.get(name) is None:
                raise ConfigError(f"{source}: {kind} rope field {name} is missing")
        params.pop("partial_rotary_factor", None)  # the caller passes the rotated dims
        return cls(dim=dim, theta=float(theta), kind=kind, params=params)

    def inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        """[dim // 2] float32 inverse frequencies of this rope type (on ``device``)."""
        dims = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device)
        base = 1.0 / self.theta ** (dims / self.dim)
        return ROPE_TYPES[self.kind].inv_freq(base, self)

    @property
    def attention_factor(self) -> float:
        """What cos/sin are multiplied by (1 except YaRN's magnitude correction)."""
        return ROPE_TYPES[self.kind].attention_factor(self)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction (the formula of transformers' ``yarn_get_mscale``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _linear_inv_freq(base: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    return base / float(spec.params["factor"])


def _llama3_inv_freq(base: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend
    between ``original / low_freq_factor`` and ``original / high_freq_factor``."""
    p = spec.params
    factor, low, high = (
        float(p["factor"]),
        float(p["low_freq_factor"]),
        float(p["high_freq_factor"]),
    )
    original = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > original / low, base / factor, base)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(base: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """YaRN: interpolated (``/ factor``) and extrapolated frequencies blended by a linear ramp
    between the dims that rotate ``beta_fast`` and ``beta_slow`` times over the original
    context."""
    p, dim = spec.params, spec.dim
    factor = float(p["factor"])
    beta_fast = p.get("beta_fast") or 32  # YaRN paper defaults
    beta_slow = p.get("beta_slow") or 1
    original = p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    dims = torch.arange(dim // 2, dtype=torch.float32, device=base.device)
    ramp = torch.clamp((dims - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (base / factor) * (1 - extrapolation) + base * extrapolation


def _yarn_attention_factor(spec: RopeSpec) -> float:
    p = spec.params
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = float(p["factor"])
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


@dataclass(frozen=True)
class RopeType:
    needs: tuple[str, ...]
    inv_freq: Callable[[torch.Tensor, RopeSpec], torch.Tensor]
    attention_factor: Callable[[RopeSpec], float] = lambda spec: 1.0


ROPE_TYPES: dict[str, RopeType] = {
    "default": RopeType((), lambda base, spec: base),
    "linear": RopeType(("factor",), _linear_inv_freq),
    "llama3": RopeType(
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        _llama3_inv_freq,
    ),
    "yarn": RopeType(
        ("factor", "original_max_position_embeddings"), _yarn_inv_freq, _yarn_attention_factor
    ),
}


@dataclass
class RopeTables:
    """cos/sin of one forward's positions; ``apply`` rotates ``[..., M, dim]`` tensors:
    rotate-half pairs (i, i + dim/2), or with ``interleave`` pairs (2i, 2i+1), written
    de-interleaved (as transformers' DeepSeek-V3).

    ``apply`` is x * [cos, cos] + [x2, x1] * [-sin, sin] with the two full-width tables made
    once per forward (``__post_init__``), so a layer's rotation is 4 kernels (5 with the
    de-interleave); elementwise it is exactly [x1 cos - x2 sin, x2 cos + x1 sin] (a - b and
    a + (-b) round alike)."""

    cos: torch.Tensor  # [M, dim/2]
    sin: torch.Tensor  # [M, dim/2]
    interleave: bool = False

    def __post_init__(self) -> None:
        self.cos_full = torch.cat([self.cos, self.cos], dim=-1)  # [M, dim]
        self.sin_signed = torch.cat([-self.sin, self.sin], dim=-1)  # [M, dim]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            x = torch.cat([x1, x2], dim=-1)
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return x * self.cos_full + torch.cat([x2, x1], dim=-1) * self.sin_signed


class Rotary(nn.Module):
    """The inverse frequencies of a :class:`RopeSpec`; ``tables`` gives a forward's cos/sin."""

    def __init__(self, spec: RopeSpec, interleave: bool = False) -> None:
        super().__init__()
        self.register_buffer("inv_freq", spec.inv_freq(), persistent=False)
        self.attention_factor = spec.attention_factor
        self.interleave = interleave
        self.spec = spec

    def reset_inv_freq(self) -> None:
        """Recompute the (non-persistent) buffer, e.g. after building on the meta device."""
        self.inv_freq = self.spec.inv_freq().to(self.inv_freq.device)

    def tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """position_ids [..., M] -> cos, sin [..., M, dim/2] in ``dtype``."""
        return rope_tables(
            self.inv_freq, position_ids, dtype, self.attention_factor, self.interleave
        )


def rope_tables(
    inv_freq: torch.Tensor,  # [dim/2] float32
    position_ids: torch.Tensor,  # [..., M] int64
    dtype: torch.dtype,
    attention_factor: float = 1.0,
    interleave: bool = False,
) -> RopeTables:
    """The cos/sin tables of every rotary embedding here: [..., M, dim/2] in ``dtype``."""
    freqs = position_ids[..., None].float() * inv_freq  # [..., M, dim/2]
    cos = (freqs.cos() * attention_factor).to(dtype)
    sin = (freqs.sin() * attention_factor).to(dtype)
    return RopeTables(cos, sin, interleave)


# --- routed experts ---------------------------------------------------------------------------


class Experts(nn.Module):
    """``n_experts`` routed SiLU-gated experts as fused 3D parameters (transformers' layout):
    ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]."""

    def __init__(self, n_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [M, H]; weights, ids [M, k] -> [M, H]. Eager: tokens sorted by expert, a loop over
        the touched experts (data-dependent shapes, each expert's weights read once, in place);
        inside a compiled graph: a fixed-shape dispatch (:meth:`forward_static`)."""
        if torch.compiler.is_compiling():
            return self.forward_static(x, weights, ids)
        k = ids.shape[1]
        flat_ids = ids.reshape(-1)  # [M*k]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // k  # [M*k] token index of each sorted slot
        slot_weight = weights.reshape(-1)[order].to(x.dtype)
        out = torch.zeros_like(x)
        begin = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[begin : begin + count]
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, y * slot_weight[begin : begin + count, None])
            begin += count
        return out

    def forward_static(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Fixed-shape token-to-expert dispatch (no host sync, no data-dependent shapes), chosen
        by the static width: fewer token-expert pairs than experts (e.g. M = 1) gathers the
        chosen experts' weights per pair ([M*k, 2I, H]), reading only those; otherwise every
        expert runs on every token and a [M, E] combine matrix (the routing weight, 0 where
        not chosen) sums them, as a verify of M >= E/k tokens touches nearly all experts."""
        m, k = ids.shape
        n_experts = self.gate_up_proj.shape[0]
        w = weights.to(x.dtype)  # [M, k]
        if m * k < n_experts:
            flat = ids.reshape(-1)  # [M*k]
            xs = x.repeat_interleave(k, 0)[:, :, None]  # [M*k, H, 1]
            gate, up = torch.bmm(self.gate_up_proj[flat], xs)[..., 0].chunk(2, dim=-1)
            y = torch.bmm(self.down_proj[flat], (F.silu(gate) * up)[:, :, None])[..., 0]
            return (y.view(m, k, -1) * w[..., None]).sum(1)
        combine = torch.zeros(m, n_experts, dtype=x.dtype, device=x.device)
        combine = combine.scatter_add(1, ids, w)  # [M, E]
        gate, up = torch.einsum("mh,eih->emi", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("emi,ehi->emh", F.silu(gate) * up, self.down_proj)  # [E, M, H]
        return torch.einsum("emh,me->mh", y, combine)


def fuse_experts(
    tensors: dict[str, torch.Tensor], prefix: str, n_experts: int, source: str
) -> dict[str, torch.Tensor]:
    """Stack the per-expert tensors of published checkpoints (``{prefix}{e}.gate_proj.weight``,
    ``up_proj``, ``down_proj``) into ``{prefix}gate_up_proj`` [E, 2I, H] and
    ``{prefix}down_proj`` [E, H, I], in place; a checkpoint already fused is left as it is."""
    if prefix + "0.gate_proj.weight" not in tensors:
        return tensors
    gate_up, down = [], []
    for e in range(n_experts):
        names = [f"{prefix}{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
        missing = [x for x in names if x not in tensors]
        if missing:
            raise CheckpointError(f"{source}: missing tensors {missing}")
        g, u, d = (tensors.pop(x) for x in names)
        gate_up.append(torch.cat([g, u], 0))
        down.append(d)
    tensors[prefix + "gate_up_proj"] = torch.stack(gate_up)
    tensors[prefix + "down_proj"] = torch.stack(down)
    return tensors


# --- checks -----------------------------------------------------------------------------------


def check_finite(logits: torch.Tensor, what: Callable[[], str]) -> None:
    """Raise :class:`NonFiniteLogitsError` (message ``what()``) when ``logits`` hold NaN/inf.
    NaN/inf propagate into the sum: one cheap reduction instead of an elementwise test (finite
    float32 logits cannot sum past float32's range at any real vocabulary size)."""
    if not torch.isfinite(logits.sum(dtype=torch.float32)):
        raise NonFiniteLogitsError(what())


def check_target_logits(name: str, logits: torch.Tensor, positions: torch.Tensor) -> None:
    """``check_finite`` for a target forward's logits, naming the model and the positions."""
    check_finite(
        logits,
        lambda: (
            f"{name}: NaN/inf in logits at positions {int(positions.min())}..{int(positions.max())}"
        ),
    )


def check_capture_layers(layer_ids, n_layers: int) -> tuple[int, ...]:
    """Hidden-state ids in HF ``hidden_states`` indexing (0: embeddings .. ``n_layers``)."""
    bad = [i for i in layer_ids if not 0 <= i <= n_layers]
    if bad:
        raise ValueError(
            f"capture layer ids {bad} outside 0..{n_layers} (HF hidden_states indexing)"
        )
    return tuple(layer_ids)


def check_positions(info, needed: int, what: str) -> None:
    """An adapter's forward refused when ``what`` needs more than the ``max_position`` of
    ``info`` (a ``ModelInfo``; 0: unbounded) positions."""
    limit = info.max_position
    if limit and needed > limit:
        raise ValueError(
            f"{info.name}: {what} needs {needed} positions > max_position_embeddings={limit}"
        )


def check_commit(accepted: torch.Tensor, pending: int) -> int:
    """``accepted`` [tau] int64 node ids of the last verify of ``pending`` nodes: root 0 first,
    every id < pending. Returns tau."""
    assert accepted.dim() == 1, accepted.shape  # [tau] int64
    if pending == 0:
        raise RuntimeError("commit() without a preceding verify()")
    tau = int(accepted.shape[0])
    if tau < 1 or int(accepted[0]) != 0 or int(accepted.max()) >= pending:
        raise ValueError(f"accepted {accepted.tolist()}: expected root 0 first, ids < {pending}")
    return tau
