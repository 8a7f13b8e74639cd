"""Per-step cost model: step time as a sum of named components, each with its own scaling rule.

One DDTree step at verify width ``M = N + 1`` and concurrency ``C`` (``T = M * C`` tokens
through the target), on a TP group of ``tp`` GPUs working in parallel (figures per GPU):

    device term = max(bytes / (HBM bw x mem_eff), FLOPs / (dense peak x compute_eff))
                  + launches x launch_s
    step_s      = sum of terms;  tokens_per_s = C x tau / step_s  (tau / step_s per request)

Memory-bound terms scale with 1 / HBM bandwidth, compute-bound ones with 1 / dense FLOP/s,
all-reduces with the interconnect (latency + bytes / link bandwidth), host terms (framework
overhead, tree build on the CPU) stay constant across GPUs. Weights are read once per step
for the whole batch; KV reads, FLOPs and host work grow with C.

Every input may be a float or a numpy array (Monte Carlo samples); outputs broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ddtree.perf.catalog import Hardware
from ddtree.perf.model import COMPUTE_PRECISION, PRECISION_BYTES, ModelShape

# Kernels per layer in one forward, for launch overhead (assumed: an eager PyTorch/SGLang
# MLA+MoE layer; a fused native engine launches fewer, which its lower launch_s stands for).
KERNELS = {
    "attention": 8,  # norm, q down/up, kv down, rope, attention, o proj, residual
    "routed_moe": 6,  # router, top-k, gate_up, activation, down, combine
    "shared_experts": 3,
    "dense_mlp": 3,
    "lm_head": 2,
    "drafter_layer": 10,
    "topk": 2,
    "accept": 3,
    "commit_per_layer": 1,
}


@dataclass(frozen=True)
class ParamSpec:
    """A free parameter of the cost model: its default, plausible range, and whether to fit it."""

    name: str
    default: float
    low: float
    high: float
    unit: str  # "" for a fraction, "s" for seconds
    fit: bool
    about: str


def engine_param(engine: str, what: str) -> str:
    return f"{engine}.{what}"


BASE_PARAMS: dict[str, ParamSpec] = {
    p.name: p
    for p in [
        ParamSpec(
            "moe_efficiency", 0.75, 0.55, 0.9, "", True,
            "fraction of peak HBM bandwidth the routed-expert GEMM reaches",
        ),
        ParamSpec(
            "weights_efficiency", 0.7, 0.3, 0.9, "", True,
            "fraction of peak HBM bandwidth for attention, shared, dense, LM head and drafter "
            "weights and KV reads",
        ),
        ParamSpec(
            "compute_efficiency", 0.5, 0.2, 0.8, "", False,
            "fraction of dense peak FLOP/s reached by compute-bound kernels",
        ),
        *(
            ParamSpec(
                f"allreduce_scale.{link}", 1.0, 0.5, 2.0, "", False,
                f"multiplier on the catalog all-reduce latency over {link} (assumed figures)",
            )
            for link in ("pcie", "nvlink", "fabric")
        ),
    ]
}  # fmt: skip


@dataclass(frozen=True)
class EngineProfile:
    """Host-side behaviour of an engine; every figure is an assumption until calibrated."""

    name: str
    step_overhead_s: float  # per step: Python dispatch, sampling glue, scheduler
    launch_s: float  # per kernel launch (eager dispatch; ~graph replay when native)
    tree_fixed_s: float  # per request per step: top-k copy to host + heap setup (or GPU kernel)
    tree_per_node_s: float  # per draft node
    accept_per_node_s: float = 0.0  # host walk over the verified tree, per draft node
    about: str = ""

    def specs(self) -> dict[str, ParamSpec]:
        n = self.name
        return {
            engine_param(n, "step_overhead"): ParamSpec(
                engine_param(n, "step_overhead"), self.step_overhead_s,
                self.step_overhead_s / 3, self.step_overhead_s * 3, "s", n == "python",
                f"{n} engine: host overhead per step",
            ),
            engine_param(n, "launch"): ParamSpec(
                engine_param(n, "launch"), self.launch_s, self.launch_s / 2,
                self.launch_s * 2, "s", False, f"{n} engine: time per kernel launch",
            ),
            engine_param(n, "tree_fixed"): ParamSpec(
                engine_param(n, "tree_fixed"), self.tree_fixed_s, self.tree_fixed_s / 2,
                self.tree_fixed_s * 2, "s", False, f"{n} engine: tree build, fixed part",
            ),
            engine_param(n, "tree_per_node"): ParamSpec(
                engine_param(n, "tree_per_node"), self.tree_per_node_s,
                self.tree_per_node_s / 2, self.tree_per_node_s * 2, "s", False,
                f"{n} engine: tree build per draft node",
            ),
            engine_param(n, "accept_per_node"): ParamSpec(
                engine_param(n, "accept_per_node"), self.accept_per_node_s,
                self.accept_per_node_s / 3, self.accept_per_node_s * 3, "s", False,
                f"{n} engine: acceptance walk over the verified tree, per draft node (host)",
            ),
        }  # fmt: skip


ENGINES: dict[str, EngineProfile] = {
    "python": EngineProfile(
        "python",
        step_overhead_s=5e-3,
        launch_s=5e-6,
        tree_fixed_s=100e-6,
        tree_per_node_s=3e-6,
        accept_per_node_s=0.2e-6,
        about="eager PyTorch/SGLang-style engine: Python dispatch per kernel, tree built on "
        "the CPU (heap ~90 µs at N=32, ~3 µs per node at N=1024: DESIGN.md facts)",
    ),
    "native": EngineProfile(
        "native",
        step_overhead_s=0.3e-3,
        launch_s=1.5e-6,
        tree_fixed_s=15e-6,
        tree_per_node_s=0.05e-6,
        accept_per_node_s=0.01e-6,
        about="native C++/CUDA engine: graph-replayed kernels, tree built on the GPU "
        "(assumed; no anchor)",
    ),
}


def default_params(engines: dict[str, EngineProfile] | None = None) -> dict[str, ParamSpec]:
    specs = dict(BASE_PARAMS)
    for eng in (engines or ENGINES).values():
        specs.update(eng.specs())
    return specs


@dataclass(frozen=True)
class Drafter:
    """A block drafter (DFlash style): its own layers, the target's LM head (shared)."""

    params: float  # non-embedding parameters
    layers: int
    precision: str = "bf16"
    kv_bytes_per_token: float = 0.0  # drafter KV cache over the context, all layers
    shares_target_lm_head: bool = True
    source: str = ""


@dataclass(frozen=True)
class Point:
    """One configuration to cost."""

    hardware: Hardware
    tp: int
    concurrency: int
    context_tokens: float
    block_size: int
    budget: int
    engine: str
    drafter: Drafter | None
    experts_curve: tuple[tuple[float, float], ...] | None = None  # (tokens, experts) measured

    @property
    def verify_width(self) -> int:
        return self.budget + 1


@dataclass
class Component:
    name: str
    seconds: np.ndarray | float
    hbm_bytes: float  # per GPU
    flops: float  # per GPU
    launches: float
    kind: str  # "memory" | "compute" | "link" | "host"
    rule: str  # how it scales to other hardware
    formula: str


@dataclass
class StepCost:
    point: Point
    components: list[Component]
    step_s: np.ndarray | float
    hbm_bytes: float  # bytes per GPU that must move from memory per step
    limit_step_s: float  # hbm_bytes / peak bandwidth

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)


EFFICIENCIES = ("moe_efficiency", "weights_efficiency", "compute_efficiency")
# Host-side engine parameters a measured device gets its own copy of, fitted to its stage
# timings (on a CPU a "kernel launch" is one eager op's dispatch, tens of µs, not a GPU launch).
HOST_PARAMS = ("launch", "step_overhead", "tree_fixed", "tree_per_node", "accept_per_node")
# The target-forward components (what the engine's ``verify`` stage and a prefill time).
TARGET_FORWARD = (
    "attention (weights + KV)",
    "routed MoE",
    "shared experts",
    "dense MLP layers",
    "LM head over M",
    "TP all-reduce",
)
# engine stage (``ddtree.engine.timing``) -> the components that stand for it
STAGE_COMPONENTS: dict[str, tuple[str, ...]] = {
    "draft": ("drafter forward",),
    "topk": ("top-k over (B-1) x V",),
    "build": ("tree build",),
    "verify": TARGET_FORWARD,
    "accept": ("accept", "accept walk"),
    "commit": ("KV commit",),
    "other": ("framework overhead",),
}


def param_for(params: dict, name: str, hw: Hardware):
    """``name@<hardware key>`` when the parameters have one (a device class of its own, such
    as this machine's CPU), else ``name``."""
    return params.get(f"{name}@{hw.key}", params[name])


def scoped_specs(
    specs: dict[str, ParamSpec], hardware_key: str, engines: tuple[str, ...] = ("python",)
) -> dict[str, ParamSpec]:
    """Parameters of their own for one hardware entry (e.g. ``this-machine``), so CPU
    measurements do not pull the GPU ones: the efficiencies, and the host costs of the
    engines that ran there (free, fitted to the records' stage timings; the prior is wide
    because a CPU eager op is not a GPU launch)."""
    out = dict(specs)
    for name in EFFICIENCIES:
        base = specs[name]
        out[f"{name}@{hardware_key}"] = replace(
            base, name=f"{name}@{hardware_key}", about=f"{base.about} (on {hardware_key})"
        )
    for eng in engines:
        for what in HOST_PARAMS:
            base = specs.get(engine_param(eng, what))
            if base is None:
                continue
            scoped = f"{base.name}@{hardware_key}"
            out[scoped] = replace(
                base, name=scoped, low=base.default / 100, high=base.default * 100, fit=True,
                about=f"{base.about} (on {hardware_key})",
            )  # fmt: skip
    return out


def engine_value(params: dict, engine: str, what: str, hw: Hardware):
    """An engine's host parameter, scoped to ``hw`` when the parameters have it."""
    return param_for(params, engine_param(engine, what), hw)


def link_class(hw: Hardware) -> str:
    """'pcie', 'nvlink' or 'fabric': which all-reduce latency scale applies."""
    text = hw.interconnect.lower()
    if "pcie" in text:
        return "pcie"
    if "nvlink" in text:
        return "nvlink"
    return "fabric"


def experts_touched(n_experts: int, top_k: int, tokens, curve=None):
    """Distinct experts per layer when ``tokens`` tokens each pick ``top_k`` of ``n_experts``.

    Uniform routing: E * (1 - (1 - k/E)^T). Example: Kimi (E=384, k=8), T=9 -> 66.3 experts;
    T=33 -> 192.3. A measured curve of (tokens, experts) replaces it (linear interpolation,
    clamped to [k, E]).
    """
    tokens = np.asarray(tokens, dtype=float)
    if curve:
        xs = np.array([c[0] for c in curve], dtype=float)
        ys = np.array([c[1] for c in curve], dtype=float)
        order = np.argsort(xs)
        out = np.interp(tokens, xs[order], ys[order])
    else:
        out = n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)
    return np.clip(out, np.minimum(top_k * tokens, top_k), n_experts)


def routed_moe_layer(model: ModelShape, tokens, tp: int, curve=None) -> tuple[float, float, str]:
    """(bytes, FLOPs, compute precision) of one routed-MoE layer per GPU (experts TP-sharded)."""
    touched = experts_touched(model.n_routed_experts, model.top_k, tokens, curve)
    bpp = model.bytes_per_param("routed_experts")
    nbytes = touched * model.expert_params * bpp / tp
    flops = 2.0 * np.asarray(tokens, float) * model.top_k * model.expert_params / tp
    return nbytes, flops, COMPUTE_PRECISION[model.precision["routed_experts"]]


def moe_layer_s(model: ModelShape, hw: Hardware, m, params: dict, tp: int = 1, curve=None):
    """Kernel time of one routed-MoE layer at M tokens (what ``bench moe`` measures)."""
    nbytes, flops, prec = routed_moe_layer(model, m, tp, curve)
    mem_s = nbytes / (hw.hbm_bytes_per_s * param_for(params, "moe_efficiency", hw))
    cmp_s = flops / (hw.peak_flops(prec) * param_for(params, "compute_efficiency", hw))
    return np.maximum(mem_s, cmp_s) if hw.overlaps_memory_and_compute else mem_s + cmp_s


def step_cost(model: ModelShape, pt: Point, params: dict, tau=None) -> StepCost:
    """Cost one step. ``params`` maps every name in ``default_params()`` to a value (or array).

    ``tau`` only enters the KV commit (bytes moved per accepted token); it may be None (0).
    """
    hw, tp, C = pt.hardware, pt.tp, pt.concurrency
    if tp < 1 or C < 1:
        raise ValueError(f"tp and concurrency must be >= 1, got tp={tp}, concurrency={C}")
    eng = pt.engine
    launch_s = engine_value(params, eng, "launch", hw)
    mem_bw, mem_eff, cmp_eff = (
        hw.hbm_bytes_per_s,
        param_for(params, "weights_efficiency", hw),
        param_for(params, "compute_efficiency", hw),
    )
    M = pt.verify_width
    T = M * C
    L, H, V = model.num_layers, model.hidden_size, model.vocab_size
    comps: list[Component] = []
    bw_rule = "1 / HBM bandwidth (memory-bound) or 1 / dense FLOP/s (compute-bound)"

    def device(name, nbytes, flops, prec, launches, eff, formula):
        mem_s = nbytes / (mem_bw * eff)
        cmp_s = flops / (hw.peak_flops(prec) * cmp_eff)
        work_s = np.maximum(mem_s, cmp_s) if hw.overlaps_memory_and_compute else mem_s + cmp_s
        secs = work_s + launches * launch_s
        kind = "compute" if np.all(np.asarray(cmp_s) > np.asarray(mem_s)) else "memory"
        comps.append(Component(name, secs, float(np.mean(nbytes)), float(np.mean(flops)),
                               launches, kind, bw_rule, formula))  # fmt: skip

    # attention: weights once, KV over the context per request (MLA latent is replicated
    # across TP ranks; GQA KV heads are split)
    kv_shard = 1 if model.attention == "mla" else min(tp, model.num_kv_heads)
    attn_w = L * model.attention_params_per_layer * model.bytes_per_param("attention") / tp
    kv = C * L * pt.context_tokens * model.kv_bytes_per_token_layer() / kv_shard
    # every query scores the context and the M new keys (the tree mask is dense [M, S + M])
    attn_f = 2.0 * T * L * model.attention_params_per_layer / tp + (
        T * L * (pt.context_tokens + M) * model.attention_flops_per_query_key() / tp
    )
    device(
        "attention (weights + KV)",
        attn_w + kv,
        attn_f,
        COMPUTE_PRECISION[model.precision["attention"]],
        L * KERNELS["attention"],
        mem_eff,
        "L x attn params x bytes/param / TP + C x L x context x KV bytes/token "
        "(FLOPs 2 x M x C x L x attn params + M x C x L x (context + M) x FLOPs/query-key)",
    )
    Lm = model.num_moe_layers
    if Lm:
        nbytes, flops, prec = routed_moe_layer(model, T, tp, pt.experts_curve)
        device(
            "routed MoE",
            Lm * nbytes,
            Lm * flops,
            prec,
            Lm * KERNELS["routed_moe"],
            param_for(params, "moe_efficiency", hw),
            "L_moe x E(1-(1-k/E)^(M*C)) x expert params x bytes/param / TP"
            + (" [measured experts curve]" if pt.experts_curve else ""),
        )
        if model.n_shared_experts:
            sp = model.n_shared_experts * model.expert_params
            device(
                "shared experts",
                Lm * sp * model.bytes_per_param("shared_experts") / tp,
                2.0 * T * Lm * sp / tp,
                COMPUTE_PRECISION[model.precision["shared_experts"]],
                Lm * KERNELS["shared_experts"],
                mem_eff,
                "L_moe x shared x expert params x bytes/param / TP",
            )
    Ld = model.num_dense_layers
    if Ld:
        device(
            "dense MLP layers",
            Ld * model.dense_mlp_params * model.bytes_per_param("dense_mlp") / tp,
            2.0 * T * Ld * model.dense_mlp_params / tp,
            COMPUTE_PRECISION[model.precision["dense_mlp"]],
            Ld * KERNELS["dense_mlp"],
            mem_eff,
            "L_dense x 3 x hidden x intermediate x bytes/param / TP",
        )
    device(
        "LM head over M",
        model.lm_head_params * model.bytes_per_param("lm_head") / tp,
        2.0 * T * model.lm_head_params / tp,
        COMPUTE_PRECISION[model.precision["lm_head"]],
        KERNELS["lm_head"],
        mem_eff,
        "vocab x hidden x bytes/param / TP (FLOPs 2 x M x C x vocab x hidden / TP)",
    )
    # tensor-parallel all-reduces: two per layer (after attention, after the MLP)
    if tp > 1:
        ar_bytes = T * H * 2.0  # bf16 activations
        n_ar = 2 * L
        link = hw.link_bytes_per_s or 1e30
        per = hw.allreduce_latency_s * params[f"allreduce_scale.{link_class(hw)}"] + 2.0 * (
            tp - 1
        ) / tp * (ar_bytes / link)
        comps.append(
            Component(
                "TP all-reduce",
                n_ar * per,
                0.0,
                0.0,
                0.0,
                "link",
                f"interconnect ({hw.interconnect or 'unknown'}): latency + bytes / link bandwidth",
                "2 x L x (latency + 2(TP-1)/TP x M x C x hidden x 2 B / link bw)",
            )
        )
    # drafter forward over the block
    B = pt.block_size
    d = pt.drafter
    if d is not None:
        dbytes = d.params * PRECISION_BYTES[d.precision] / tp + C * pt.context_tokens * (
            d.kv_bytes_per_token / tp
        )
        dflops = 2.0 * C * B * d.params / tp
        launches = d.layers * KERNELS["drafter_layer"]
        if d.shares_target_lm_head:
            dbytes = dbytes + model.lm_head_params * model.bytes_per_param("lm_head") / tp
            dflops = dflops + 2.0 * C * (B - 1) * model.lm_head_params / tp
            launches += KERNELS["lm_head"]
        device(
            "drafter forward",
            dbytes,
            dflops,
            COMPUTE_PRECISION[d.precision],
            launches,
            mem_eff,
            "drafter params x bytes/param / TP + target LM head over B-1 slots",
        )
    # top-k over the (B-1) x V drafter logits (float32), on the GPU
    device(
        "top-k over (B-1) x V",
        C * (B - 1) * V * 4.0,
        0.0,
        "bf16",
        KERNELS["topk"],
        mem_eff,
        "C x (B-1) x vocab x 4 B / HBM bw",
    )
    comps.append(
        Component(
            "tree build",
            C
            * (
                engine_value(params, eng, "tree_fixed", hw)
                + pt.budget * engine_value(params, eng, "tree_per_node", hw)
            ),
            0.0,
            0.0,
            0.0,
            "host",
            f"{eng} engine: constant across GPUs (CPU heap or one GPU kernel)",
            "C x (fixed + N x per node)",
        )
    )
    tau_v = 0.0 if tau is None else tau
    device(
        "accept",
        C * T * 4.0,
        0.0,
        "bf16",
        KERNELS["accept"],
        mem_eff,
        "argmax / compare over the tree, a few kernels",
    )
    comps.append(
        Component(
            "accept walk",
            C * pt.budget * engine_value(params, eng, "accept_per_node", hw),
            0.0,
            0.0,
            0.0,
            "host",
            f"{eng} engine: constant across GPUs (the accepted path is walked on the host)",
            "C x N x per node",
        )
    )
    device(
        "KV commit",
        C * np.asarray(tau_v) * L * model.kv_bytes_per_token_layer() * 2.0 / kv_shard,
        0.0,
        "bf16",
        L * KERNELS["commit_per_layer"],
        mem_eff,
        "C x tau x L x KV bytes/token x 2 (read + write), one kernel per layer",
    )
    comps.append(
        Component(
            "framework overhead",
            engine_value(params, eng, "step_overhead", hw) + 0.0 * np.asarray(tau_v),
            0.0,
            0.0,
            0.0,
            "host",
            "constant across GPUs unless the scenario says otherwise",
            f"{eng} engine step overhead",
        )
    )
    step_s = sum(c.seconds for c in comps)
    hbm = sum(c.hbm_bytes for c in comps)
    return StepCost(pt, comps, step_s, hbm, hbm / mem_bw)


def tokens_per_s(cost: StepCost, tau):
    """Aggregate decode tokens/s: C x tau / step_s."""
    return cost.point.concurrency * np.asarray(tau, dtype=float) / cost.step_s


def params_at(specs: dict[str, ParamSpec], overrides: dict | None = None) -> dict:
    out = {k: s.default for k, s in specs.items()}
    out.update(overrides or {})
    return out


@dataclass
class Amdahl:
    limit_step_s: float
    limit_tokens_per_s: float
    fraction_of_limit: float
    overhead_fraction: float  # host + launches + link latency over step
    statement: str
    extra: dict = field(default_factory=dict)


def amdahl(cost: StepCost, params: dict, tau: float) -> Amdahl:
    """Physical limit (bytes per GPU / peak HBM bw) and how much of the step is overhead."""
    step = float(np.median(np.asarray(cost.step_s)))
    launch_s = engine_value(params, cost.point.engine, "launch", cost.point.hardware)
    launches = sum(c.launches for c in cost.components)
    over = float(
        np.median(
            np.asarray(
                sum(c.seconds for c in cost.components if c.kind in ("host", "link"))
                + launches * launch_s
            )
        )
    )
    C = cost.point.concurrency
    limit_tps = C * tau / cost.limit_step_s
    frac = over / step
    if frac > 0.5:
        say = (
            f"overheads dominate: {frac:.0%} of the step is host, launch and link time that "
            "faster memory does not shrink; a faster GPU buys little, removing overhead buys most"
        )
    else:
        say = (
            f"bandwidth-bound: {1 - frac:.0%} of the step moves bytes or computes; "
            "faster memory helps in proportion"
        )
    return Amdahl(cost.limit_step_s, limit_tps, (C * tau / step) / limit_tps, frac, say)
