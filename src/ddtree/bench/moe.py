"""`ddtree bench moe`: one routed-MoE layer forward against verify width M, BF16 and INT4.

This is this machine's analogue of the seed's Marlin MoE benchmark: at concurrency 1 a verify
forward over M tokens touches a subset of the routed experts, and at small M the layer is
bound by streaming those experts' weights. Per M the benchmark reports

- **experts touched**: distinct routed experts the router picks for the M tokens, measured,
  next to the uniform-routing expectation ``E (1 - (1 - k/E)^M)``;
- **bytes moved**: weights of the touched experts at their precision, plus the weights read
  every call (shared experts, router), plus the activations in and out (``2 M H`` elements);
  intermediate activations stay in cache and are not counted;
- **effective bytes/s** = bytes moved / median seconds per layer, and its fraction of a peak
  bandwidth (``ddtree bench bandwidth``, or a figure given by the user).

Precisions: ``bfloat16`` (fused expert weights in bfloat16, the layer of ``ddtree.models.nn.mla_moe``)
and ``int4`` (routed experts weight-only INT4, symmetric, one bfloat16 scale per group of 32
input columns, as Kimi K2-Thinking ships them; each touched expert is dequantised to bfloat16
inside the forward). Shared experts and the router keep their precision in both (BF16, FP32).

Routing: the router's rows are random with equal norms and tokens are Gaussian, so each expert
is equally likely; every timed call sees fresh tokens, so the experts it touches are (mostly)
not in the cache from the previous call. The total expert weights should be several times the
last-level cache for the figures to be memory figures.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ddtree.bench.timing import time_call
from ddtree.models.nn.layers import Experts
from ddtree.models.nn.mla_moe import SUPPORTED_MODEL_TYPES, MlaMoeConfig, MoE, Router

PRECISIONS = ("bfloat16", "int4")
INT4_GROUP_SIZE = 32
INT4_MIN, INT4_MAX = -8, 7  # signed 4-bit range; stored offset by 8 as an unsigned nibble
INT4_OFFSET = 8
SCALE_DTYPE = torch.bfloat16
ACTIVATION_DTYPE = torch.bfloat16
DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


# --- INT4 weight-only, grouped ------------------------------------------------------------


@dataclass
class PackedInt4:
    """A weight ``[..., K]`` as signed int4 with one scale per group of ``group_size`` columns.

    ``qweight[..., j]`` holds columns ``2j`` (low nibble) and ``2j+1`` (high nibble), each as
    ``q + 8`` in 0..15. Worked example, one row, K = 4: q = [-8, 7, 0, -1] is stored as bytes
    [(0 | 15 << 4), (8 | 7 << 4)] = [240, 120]; the weight is ``q * scales[group]``.
    """

    qweight: torch.Tensor  # [..., K/2] uint8
    scales: torch.Tensor  # [..., K/group_size] bfloat16
    group_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.qweight.shape[:-1], self.qweight.shape[-1] * 2)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


def pack_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> PackedInt4:
    """Quantise ``weight [..., K]`` symmetrically: per group, scale = max|w| / 7 (rounded to
    bfloat16 first, so the stored scale is the one used) and q = round(w / scale) in [-8, 7].
    The error per element is at most scale / 2."""
    k = weight.shape[-1]
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even number >= 2, got {group_size}")
    if k % group_size:
        raise ValueError(f"last dimension {k} is not a multiple of group_size={group_size}")
    w = weight.float().reshape(*weight.shape[:-1], k // group_size, group_size)  # [..., G, g]
    amax = w.abs().amax(dim=-1, keepdim=True)  # [..., G, 1]
    scales = (amax / INT4_MAX).to(SCALE_DTYPE)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # all-zero group
    q = torch.clamp(torch.round(w / scales.float()), INT4_MIN, INT4_MAX).to(torch.int16)
    u = (q + INT4_OFFSET).to(torch.uint8).reshape(*weight.shape[:-1], k)  # [..., K] 0..15
    packed = u[..., 0::2] | (u[..., 1::2] << 4)  # [..., K/2]
    return PackedInt4(packed.contiguous(), scales.squeeze(-1).contiguous(), group_size)


def dequant_int4(packed: PackedInt4, dtype: torch.dtype = ACTIVATION_DTYPE) -> torch.Tensor:
    """``[..., K]`` weight in ``dtype`` from its packed form (torch ops only): the nibbles are
    written straight into the output's even/odd columns, then offset and scaled in place
    (about 2x faster on a CPU than building the halves separately and stacking them)."""
    qw = packed.qweight  # [..., K/2] uint8
    lead, half = qw.shape[:-1], qw.shape[-1]
    out = torch.empty(*lead, half, 2, dtype=dtype, device=qw.device)  # [..., K/2, 2]
    out[..., 0] = qw & 0x0F
    out[..., 1] = qw >> 4
    grouped = out.view(*lead, -1, packed.group_size)  # [..., G, g]
    grouped.sub_(INT4_OFFSET).mul_(packed.scales.to(dtype).unsqueeze(-1))
    return out.view(*lead, 2 * half)


class Int4ExpertWeight(nn.Module):
    """A fused expert weight ``[E, N, K]`` kept packed; ``weight[e]`` is expert e dequantised.

    It offers what ``Experts.forward`` reads from its weights (``shape``, ``[expert]``), so the
    same dispatch loop runs both precisions and only the touched experts are dequantised."""

    def __init__(self, weight: torch.Tensor, group_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        packs = [pack_int4(weight[e], group_size) for e in range(weight.shape[0])]  # bounded RAM
        self.register_buffer("qweight", torch.stack([p.qweight for p in packs]))  # [E, N, K/2]
        self.register_buffer("scales", torch.stack([p.scales for p in packs]))  # [E, N, K/g]
        self.group_size = group_size
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        e, n, half = self.qweight.shape
        return torch.Size((e, n, 2 * half))

    def packed(self, expert: int) -> PackedInt4:
        return PackedInt4(self.qweight[expert], self.scales[expert], self.group_size)

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequant_int4(self.packed(expert), self.dtype)  # [N, K]

    def bytes_per_expert(self) -> int:
        return (self.qweight.nbytes + self.scales.nbytes) // self.qweight.shape[0]


class Int4Experts(Experts):
    """``Experts`` with INT4 grouped weights, dequantised per touched expert in the forward."""

    def __init__(self, experts: Experts, group_size: int = INT4_GROUP_SIZE) -> None:
        nn.Module.__init__(self)  # not Experts.__init__: no BF16 parameters to allocate
        dtype = experts.gate_up_proj.dtype
        self.gate_up_proj = Int4ExpertWeight(experts.gate_up_proj.detach(), group_size, dtype)
        self.down_proj = Int4ExpertWeight(experts.down_proj.detach(), group_size, dtype)


# --- the layer under test ------------------------------------------------------------------


@dataclass(frozen=True)
class MoeShape:
    """The routed-MoE sizes that set the cost of one layer."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    top_k: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    name: str = "custom"

    def __post_init__(self) -> None:
        for field_name in ("hidden_size", "moe_intermediate_size", "n_routed_experts", "top_k"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name}={getattr(self, field_name)}: expected >= 1")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts}: expected >= 0")
        if self.top_k > self.n_routed_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_routed_experts={self.n_routed_experts}")

    def to_config(self) -> MlaMoeConfig:
        """An ``MlaMoeConfig`` with these MoE sizes (attention fields are unused placeholders)."""
        return MlaMoeConfig(
            vocab_size=1,
            hidden_size=self.hidden_size,
            intermediate_size=self.moe_intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=1,
            n_shared_experts=self.n_shared_experts,
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            first_k_dense_replace=0,
            routed_scaling_factor=self.routed_scaling_factor,
            norm_topk_prob=self.norm_topk_prob,
            kv_lora_rank=2,
            q_lora_rank=None,
            qk_rope_head_dim=2,
            qk_nope_head_dim=2,
            v_head_dim=2,
            max_position_embeddings=1,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
        )

    @staticmethod
    def from_hf(cfg: dict, source: str = "config.json") -> MoeShape:
        """From a Hugging Face DeepseekV3 / Kimi-K2 ``config.json`` dict (its ``text_config``
        when it has one). Only MoE fields are read; a quantization_config is allowed."""
        cfg = cfg.get("text_config") or cfg
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: field model_type={model_type!r}, expected one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            return MoeShape(
                hidden_size=int(cfg["hidden_size"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                n_routed_experts=int(cfg["n_routed_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                n_shared_experts=int(cfg.get("n_shared_experts") or 0),
                n_group=int(cfg.get("n_group") or 1),
                topk_group=int(cfg.get("topk_group") or 1),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                name=str(cfg.get("_name_or_path") or model_type),
            )
        except KeyError as err:
            raise ValueError(f"{source}: missing field {err.args[0]}") from None
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


# Kimi K2's routing (384 experts, top-8, 1 shared, no groups, scaling 2.827) with hidden and
# expert widths cut 7x / 8x (7168 -> 1024, 2048 -> 256): 1.5 MiB per BF16 expert, 604 MB of
# routed experts (19x a 32 MiB L3), so one forward at every M runs in well under a second.
KIMI_SCALED = MoeShape(
    hidden_size=1024,
    moe_intermediate_size=256,
    n_routed_experts=384,
    top_k=8,
    n_shared_experts=1,
    routed_scaling_factor=2.827,
    name="Kimi-K2 routing, hidden/7, expert width/8",
)


def routed_expert_bytes(shape: MoeShape, precision: str, group_size: int = INT4_GROUP_SIZE) -> int:
    """Bytes of one routed expert's weights (gate+up ``[2I, H]``, down ``[H, I]``)."""
    h, i = shape.hidden_size, shape.moe_intermediate_size
    if precision == "bfloat16":
        return 3 * h * i * ACTIVATION_DTYPE.itemsize
    if precision == "int4":
        # half a byte per weight + one scale per group, along each matrix's input dimension
        quant = 3 * h * i // 2
        scales = (2 * i * (h // group_size) + h * (i // group_size)) * SCALE_DTYPE.itemsize
        return quant + scales
    raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")


def fixed_weight_bytes(shape: MoeShape) -> tuple[int, int]:
    """(shared-expert bytes at BF16, router bytes at FP32 incl. its correction bias): read by
    every forward whatever M is."""
    shared = 3 * shape.hidden_size * shape.moe_intermediate_size * shape.n_shared_experts
    router = shape.n_routed_experts * (shape.hidden_size + 1) * 4
    return shared * ACTIVATION_DTYPE.itemsize, router


def expected_experts_touched(n_experts: int, top_k: int, m: int) -> float:
    """Distinct experts hit by M tokens under uniform routing: E (1 - (1 - k/E)^M)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** m)


def build_layer(
    shape: MoeShape,
    device: str = "cpu",
    seed: int = 0,
    group_size: int = INT4_GROUP_SIZE,
    precision: str = "bfloat16",
) -> MoE:
    """A random ``MoE`` layer: BF16 experts and shared experts, an FP32 router whose rows all
    have norm 1 (every expert equally likely), zero correction bias. ``int4`` replaces the
    routed experts by their packed form (same seed, so the same routing and weights)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "int4" and (
        shape.hidden_size % group_size or shape.moe_intermediate_size % group_size
    ):
        raise ValueError(
            f"int4 needs hidden_size ({shape.hidden_size}) and moe_intermediate_size "
            f"({shape.moe_intermediate_size}) divisible by group_size={group_size}"
        )
    with torch.device("meta"), warnings.catch_warnings():
        # no shared experts: nn.Linear warns that initialising its empty weight is a no-op
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")
        layer = MoE(shape.to_config())
    layer = layer.to(ACTIVATION_DTYPE)
    layer.gate.float()
    layer = layer.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    h, i = shape.hidden_size, shape.moe_intermediate_size
    with torch.no_grad():
        for e in range(shape.n_routed_experts):  # per expert: no FP32 copy of the whole layer
            layer.experts.gate_up_proj[e].normal_(0.0, h**-0.5, generator=g)
            layer.experts.down_proj[e].normal_(0.0, i**-0.5, generator=g)
        for lin in (layer.shared_experts.gate_proj, layer.shared_experts.up_proj):
            lin.weight.normal_(0.0, h**-0.5, generator=g)
        layer.shared_experts.down_proj.weight.normal_(
            0.0, max(1, i * shape.n_shared_experts) ** -0.5, generator=g
        )
        router = layer.gate
        router.weight.normal_(0.0, 1.0, generator=g)
        router.weight /= router.weight.norm(dim=1, keepdim=True)
        router.e_score_correction_bias.zero_()
    if precision == "int4":
        layer.experts = Int4Experts(layer.experts, group_size)
    return layer.eval()


def layer_expert_bytes(layer: MoE) -> int:
    """Bytes of one routed expert as the layer stores it (measured from its tensors)."""
    ex = layer.experts
    if isinstance(ex, Int4Experts):
        return ex.gate_up_proj.bytes_per_expert() + ex.down_proj.bytes_per_expert()
    e = ex.gate_up_proj.shape[0]
    return (ex.gate_up_proj.nbytes + ex.down_proj.nbytes) // e


# --- the benchmark -------------------------------------------------------------------------


@dataclass
class MoeBenchPoint:
    m: int  # verify width: tokens through the layer in one forward
    s_per_layer: float  # median seconds of one forward
    p10_s: float
    p90_s: float
    experts_touched: float  # measured from the router, mean over the timed inputs
    experts_touched_uniform: float  # E (1 - (1 - k/E)^M)
    routed_weight_bytes: int  # touched experts x bytes per expert, mean over the inputs
    fixed_weight_bytes: int  # shared experts + router, every call
    activation_bytes: int  # input and output [M, H] at BF16
    bytes_moved: int  # the three above
    bytes_per_s: float  # bytes_moved / s_per_layer
    fraction_of_peak: float  # bytes_per_s / peak_bytes_per_s

    def as_dict(self) -> dict:
        return asdict(self)


def experts_touched(router: Router, x: torch.Tensor) -> int:
    """Distinct routed experts the router picks for tokens ``x [M, H]``."""
    _, ids = router(x)  # [M, k]
    return int(ids.unique().numel())


def bench_moe(
    layer: MoE,
    shape: MoeShape,
    ms: list[int],
    peak_bytes_per_s: float,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 1,
) -> Iterator[MoeBenchPoint]:
    """Time ``layer`` at each M. Each of the ``repeats`` timed calls gets its own Gaussian
    tokens (a pool of ``repeats`` inputs, cycled, so each is timed once); the bytes of a point
    are the mean over that pool."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    if peak_bytes_per_s <= 0:
        raise ValueError(f"peak_bytes_per_s must be > 0, got {peak_bytes_per_s}")
    device = layer.gate.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    per_expert = layer_expert_bytes(layer)
    shared_bytes, router_bytes = fixed_weight_bytes(shape)
    g = torch.Generator(device=device).manual_seed(seed)
    for m in ms:
        if m < 1:
            raise ValueError(f"verify width M must be >= 1, got {m}")
        pool = [
            torch.randn(m, shape.hidden_size, generator=g, device=device).to(ACTIVATION_DTYPE)
            for _ in range(repeats)
        ]  # repeats x [M, H] bf16
        with torch.inference_mode():
            touched = [experts_touched(layer.gate, x) for x in pool]
            inputs = itertools.cycle(pool)
            t = time_call(
                lambda inputs=inputs: layer(next(inputs)), repeats=repeats, warmup=warmup, sync=sync
            )
        mean_touched = sum(touched) / len(touched)
        routed = round(mean_touched * per_expert)
        activations = 2 * m * shape.hidden_size * ACTIVATION_DTYPE.itemsize
        moved = routed + shared_bytes + router_bytes + activations
        rate = moved / t.median_s
        yield MoeBenchPoint(
            m=m,
            s_per_layer=t.median_s,
            p10_s=t.p10_s,
            p90_s=t.p90_s,
            experts_touched=mean_touched,
            experts_touched_uniform=expected_experts_touched(
                shape.n_routed_experts, shape.top_k, m
            ),
            routed_weight_bytes=routed,
            fixed_weight_bytes=shared_bytes + router_bytes,
            activation_bytes=activations,
            bytes_moved=moved,
            bytes_per_s=rate,
            fraction_of_peak=rate / peak_bytes_per_s,
        )


def to_record(
    points: list[MoeBenchPoint], hardware, config: dict, peak_bytes_per_s: float, peak_source: str
):
    """The MoE benchmark's record builder: one ``bench_moe`` record per precision."""
    from ddtree.provenance import this_process
    from ddtree.records import make_record

    summary = {
        "peak_bytes_per_s": peak_bytes_per_s,
        "peak_source": peak_source,
        "max_fraction_of_peak": max(p.fraction_of_peak for p in points),
    }
    return make_record(
        "bench_moe",
        hardware,
        config,
        summary,
        [p.as_dict() for p in points],
        this_process("ddtree bench moe"),
    )


def moe_result(
    points: list[tuple[str, MoeBenchPoint]],
    configs: dict[str, dict],
    peak_bytes_per_s: float,
    peak_source: str,
):
    """The bench_moe result of ``(precision, point)`` pairs: one record per precision (its
    config from ``configs``), and the ``--json`` document of all of them."""
    from ddtree.bench.result import BenchResult
    from ddtree.provenance import this_hardware

    hw = this_hardware()
    by_precision: dict[str, list[MoeBenchPoint]] = {}
    for precision, point in points:
        by_precision.setdefault(precision, []).append(point)
    parts = []
    for precision, pts in by_precision.items():
        record = to_record(pts, hw, configs[precision], peak_bytes_per_s, peak_source)
        parts.append(BenchResult("bench_moe", record.config, record.summary, pts))
    results = [{**p.config, **p.summary, "points": p.rows} for p in parts]
    document = {"bench": "moe", "hardware": hw.label, "results": results}
    return BenchResult("bench_moe", {}, {}, [pt for _, pt in points], document, parts)


def total_weight_bytes(shape: MoeShape, precision: str, group_size: int = INT4_GROUP_SIZE) -> int:
    """All weights of one layer at ``precision`` (routed experts) + BF16 shared + FP32 router."""
    shared, router = fixed_weight_bytes(shape)
    return shape.n_routed_experts * routed_expert_bytes(shape, precision, group_size) + (
        shared + router
    )


def gib(n_bytes: float) -> float:
    """Bytes in GiB, for memory messages only (rates stay SI)."""
    return n_bytes / (1 << 30)
