"""Per-step cost model: step time as a sum of components, one small function per component.

One DDTree step at verify width ``M = N + 1`` and concurrency ``C`` (``T = M * C`` tokens
through the target), on a group of ``tp`` GPUs working in parallel (figures per GPU), split as
the point's ``Deployment`` says (``DEPLOYMENTS``: everything tensor-parallel, or experts whole
per GPU, or data-parallel attention with expert-parallel MoE and all-to-all dispatch):

    device term = max(bytes / (HBM bw x mem_eff), FLOPs / (dense peak x compute_eff))
                  + launches x launch_s
    step_s      = sum of terms;  tokens_per_s = C x tau / step_s  (tau / step_s per request)

Memory-bound terms scale with 1 / HBM bandwidth, compute-bound ones with 1 / dense FLOP/s,
all-reduces with the interconnect (latency + bytes / link bandwidth), host terms (framework
overhead, tree build on the CPU) stay constant across GPUs. Weights are read once per step
for the whole batch; KV reads, FLOPs and host work grow with C.

Every component function returns a ``Component`` tagged with the ``Stage`` the engine times
it in (``ddtree.vocab.Stage``), so a measured stage is fitted by exactly the components
tagged with it. The target forward (``TARGET_FORWARD``) is costed for a ``Forward``: the
verify (M tokens per request over the cached context) or the prefill (the prompt, no
context).

Policies (``ddtree.vocab.Policy``) set the tree: its budget and the candidates per depth K
(``chain``: budget B-1, K = 1, an argmax; ``ddtree``: K = min(N, V), as the published code
does). A policy without a drafter (``ar``) is the target forward at M = 1 and the step
overhead, nothing else (no drafter, top-k, tree or acceptance).

Engine modes are ``EngineProfile``s (``ENGINES``): ``eager`` (Python dispatch per kernel),
``graphs`` (CUDA-graph replay: a launch costs a fraction, a per-step host cost remains),
``cpp`` (kernels launched one by one from C++, no Python, no graphs: llama.cpp) and
``native`` (graph replay with the tree built on the device). Their host figures are
parameters ``<profile>.<what>`` (``ENGINE_PARAMS``), fitted per profile to the anchors that
ran in it; device efficiencies are shared by every profile.

Every input may be a float or a numpy array (Monte Carlo samples); outputs broadcast.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np

from ddtree.perf.hardware.catalog import GENERATIONS, Hardware, Link, load_hosts
from ddtree.perf.shapes.model import COMPUTE_PRECISION, PRECISION_BYTES, ModelShape
from ddtree.vocab import AR, DEFAULT_POLICY, Drafting, Policy, Stage, get_policy


def _load_kernels() -> dict[str, float]:
    text = resources.files("ddtree.perf").joinpath("data/kernels.toml").read_text(encoding="utf-8")
    return dict(tomllib.loads(text)["kernels"])


KERNELS: dict[str, float] = _load_kernels()
"""Kernels per layer (per step for topk/accept, per forward for lm_head) of ddtree's eager
MLA+MoE engine, counted with torch.profiler (``ddtree.bench.kernels``, data/kernels.toml).
Launch time is these counts x the profile's ``launch``: a fused or graph-replayed engine runs
fewer, cheaper kernels, which its fitted ``launch`` absorbs."""


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
    centre: str = "assumed"  # where ``default`` is from: "assumed" (set by hand) or "corpus"


LINK_CLASSES = ("pcie", "nvlink", "fabric", "inter_node")
INTER_NODE_SCALE_HIGH = 4.0
"""The inter-node latency's prior reaches 4x the catalog's: the catalog takes NCCL's own
tuning-model estimate (25 us), and the one measurement beside it in the same log (NVIDIA/nccl
#1453: 61.58 us for a 128-byte all-reduce across H100 nodes) is 2.4x that."""
"""Which ``allreduce_scale`` applies: the hardware's interconnect class (``link_class``), or
``inter_node`` for a group that spans nodes (the inter-node ``Link``'s latency)."""


KERNEL_PATHS: dict[str, tuple[float, float, float, str]] = {
    "native-8bit": (1.0, 0.5, 1.3, "fp8 weights on GPUs whose tensor units compute them"),
    "native-4bit": (0.9, 0.3, 1.3, "fp4 / mxfp4 weights on GPUs whose tensor units compute them"),
    "dequant-8bit": (0.8, 0.3, 1.3, "fp8 / int8 weights dequantised to 16 bits before the MMA "
                     "(fp8 on Ampere: Marlin-style kernels; weight-only int8, GPTQ / AWQ 8-bit, "
                     "on every GPU)"),
    "dequant-4bit": (0.9, 0.2, 1.3, "int4 weights (AWQ, GPTQ, q4) dequantised to 16 bits "
                     "before the MMA, on every GPU: kernels from 2023's AWQ GEMM to Marlin"),
    "dequant-fp4": (0.9, 0.2, 1.3, "fp4 / mxfp4 weights dequantised to 16 bits before the MMA "
                    "(mxfp4 on Hopper or Ampere: the Marlin-MXFP4 and Triton kernels that came "
                    "with gpt-oss, a kernel family of its own)"),
}  # fmt: skip
"""Kernel paths besides 16-bit weights (multiplier 1): which applies to a weight format on a GPU
is ``kernel_path``; the multiplier's prior is assumed (a low-bit GEMV reaches less of the
bandwidth than a 16-bit one, more so when it dequantises), and fitted."""


FP4_FORMATS = ("fp4", "mxfp4")  # 4-bit floating-point weights (a kernel family apart from int4)


def kernel_path(hw: Hardware, fmt: str) -> str:
    """'16bit' or one of ``KERNEL_PATHS``: the weight format's bits, and whether the GPU's
    tensor units compute it natively (``Hardware.native``; int4 never). Example: fp8 on an
    A100 -> dequant-8bit, on an H100 -> native-8bit; mxfp4 on an H100 -> dequant-fp4; int4 on a
    B200 -> dequant-4bit; int8 (weight-only GPTQ / AWQ / gpt-fast) on an H100 -> dequant-8bit."""
    bits = PRECISION_BYTES.get(fmt, 2.0)
    if bits >= 2.0:
        return "16bit"
    width = "8bit" if bits >= 1.0 else "4bit"
    if hw.native(fmt):
        return f"native-{width}"
    return "dequant-fp4" if fmt in FP4_FORMATS else f"dequant-{width}"


STACKS = ("any", "sglang", "vllm", "trtllm", "transformers", "llamacpp", "ddtree", "other")
"""The serving stacks a point or scenario may name (``stack = "sglang"``); "any" when it does
not say (a projection for no stack in particular), "other" for one without a profile of its own
(MLC, ExLlama, TGI, LMDeploy, a paper's own harness)."""


STACK_SCALES = {
    "host": "multiplier on the engine mode's per-step host overhead (hierarchical: the mode's "
    "value is shared, each serving stack scales it)",
    "spec": "multiplier on the speculative costs (spec_step_overhead, draft_step_overhead, "
    "draft_forward_overhead): how lean its speculative path is",
    "kernel": "multiplier on the memory efficiencies (hierarchical: the shared efficiency, "
    "the GPU generation's and the kernel path's are every stack's; each serving stack's own "
    "GEMV, MoE and attention kernels stream the same bytes at their own share of the peak)",
}
"""A serving stack's multipliers (``stack_<what>.<stack>``, read by ``stack_scale``)."""
NO_STACK_SCALE = {("kernel", "other")}
"""(what, stack) pairs with no multiplier of their own. "other" is not one stack but every
engine the corpus names no stack for (ExLlama, MLC, TinyChat, AutoAWQ, gpt-fast, TGI, ...):
their hosts are alike (lean, no scheduler: the train leave-one-source-out of round 10 gives
24.3% without ``stack_host.other``, 23.3% with), their kernels share nothing (24.1% with a
``stack_kernel.other``, 23.3% without), so "other" streams at the shared efficiencies, as
"any" does."""


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
        ParamSpec(
            "prefill_efficiency", 0.5, 0.2, 0.8, "", False,
            "fraction of dense peak FLOP/s a prompt's forward reaches (e2e points: the prefill "
            "in a request's time)",
        ),
        ParamSpec(
            "spec_step_overhead", 0.4e-3, 0.1e-3, 1.6e-3, "s", True,
            "host and glue time a speculative step adds over an AR step, once per step: "
            "sampling the verified logits, the tree mask and positions, the accept walk's host "
            "syncs, the extra scheduler bookkeeping (prior: serving engines spend ~0.5-1.5 ms "
            "per speculative step beyond its kernels, issue 27)",
        ),
        ParamSpec(
            "draft_step_overhead", 0.5e-3, 0.12e-3, 2e-3, "s", True,
            "host and kernel-glue time per draft step of a stepped drafter (EAGLE step, MTP "
            "layer): its own sampling / top-k, input preparation, a graph replay of its own "
            "(prior: the 0.6-1.5 ms per draft step the published EAGLE-3 and MTP steps hold "
            "beyond their bytes, issue 27)",
        ),
        ParamSpec(
            "draft_forward_overhead", 0.3e-3, 0.07e-3, 1.2e-3, "s", True,
            "host and kernel-glue time per drafter forward of a one-pass drafter (DFlash block, "
            "Medusa heads): its input preparation and graph replay (assumed, like a draft step "
            "but once per step)",
        ),
        *(
            ParamSpec(f"stack_{what}.{s}", 1.0, 0.5, 2.0, "", True, f"{s}: {about}")
            for what, about in STACK_SCALES.items()
            for s in STACKS
            if s != "any" and (what, s) not in NO_STACK_SCALE
        ),
        *(
            ParamSpec(
                f"gen_efficiency.{g}", 1.0, 0.75, 1.33, "", True,
                f"{g} GPUs: multiplier on the memory efficiencies (their kernels' share of "
                "peak bandwidth differs by generation and vendor)",
            )
            for g in GENERATIONS
        ),
        *(
            ParamSpec(
                f"path_efficiency.{path}", default, low, high, "", True,
                f"weights in the {path} kernel path: multiplier on the memory efficiencies "
                f"({about})",
            )
            for path, (default, low, high, about) in KERNEL_PATHS.items()
        ),
        *(
            ParamSpec(
                f"layer_floor.{g}", 4e-6, 2e-6, 10e-6, "s", True,
                f"{g} GPUs: the least device time one layer of a target forward takes at small "
                "batch (kernel tails, synchronisation between a layer's kernels) whatever its "
                "bytes; a forward is max(its device time, layers x floor) (prior: a few us per "
                "layer; ~160 us per FP4 MoE layer seen on a B200 at batch 1, issue 27)",
            )
            for g in GENERATIONS
        ),
        ParamSpec(
            "spec_tp_scale", 1.0, 0.5, 2.0, "", True,
            "multiplier per doubling of the TP group on the speculative host costs (each draft "
            "step's and verify's host work runs in lock-step on every rank: its broadcasts of "
            "the drafted tokens and the wait for the slowest rank grow with the group; assumed "
            "1, no growth, until fitted)",
        ),
        ParamSpec(
            "routing_locality", 0.8, 0.6, 1.0, "", True,
            "exponent g: one request's verify tokens over D positions touch the experts of "
            "M/D x D^g independently routed tokens (routed_tokens; 1: independent). Assumed "
            "prior 0.8, range 0.6-1: consecutive tokens share experts more often than chance "
            "(Mixtral of Experts, Jiang et al. 2024, sec. 5), yet a draft tree's union of "
            "experts still nears the full set (MoE-Spec, McDanel et al. 2026). The range "
            "was chosen on the train leave-one-source-out: a prior reaching 0.4 let the fit "
            "settle at 0.32, the exponent absorbing more than routing",
        ),
        ParamSpec(
            "expert_loop", 60e-6, 20e-6, 200e-6, "s", True,
            "host time per expert per MoE layer of a stack that runs its experts in a Python "
            "loop over every expert (LOOPED_EXPERTS_STACKS): a torch.where on the expert mask, "
            "a device-to-host sync, then the expert's few dispatches (assumed: ~20 us per sync "
            "and ~8 eager dispatches of ~5 us)",
        ),
        ParamSpec(
            "ngram_lookup", 100e-6, 20e-6, 1e-3, "s", True,
            "host time per request per step to find the context's last n-gram's earlier match "
            "(policy ngram; assumed: vLLM's numba KMP over a few thousand tokens)",
        ),
        *(
            ParamSpec(
                f"allreduce_scale.{link}", 1.0, 0.5, INTER_NODE_SCALE_HIGH if link == "inter_node"
                else 2.0, "", False,
                f"multiplier on the catalog all-reduce latency over {link} (assumed figures)",
            )
            for link in LINK_CLASSES
        ),
        *(
            ParamSpec(
                h.param, h.speed, h.low, h.high, "", True,
                f"single-thread speed of the {h.name} over the reference host: divides the "
                f"engine's host costs and kernel launches ({h.provenance.label()})",
            )
            for h in load_hosts().values()
            if h.param is not None
        ),
    ]
}  # fmt: skip


# Engine parameters (``EngineProfile`` fields without the ``_s``): how wide their prior is
# (a factor below and above the default) and what they stand for.
ENGINE_PARAMS: dict[str, tuple[float, str]] = {
    "step_overhead": (3, "host overhead per step"),
    "launch": (4, "time per kernel of the eager layer (KERNELS): dispatch or its fused share"),
    "topk_fixed": (3, "top-k glue per step (selection setup, copies to the tree builder)"),
    "topk_per_candidate": (3, "top-k cost per candidate kept, per drafted position"),
    "tree_fixed": (2, "tree build, fixed part"),
    "tree_per_node": (2, "tree build per draft node"),
    "layout_fixed": (3, "verify layout (positions + ancestor mask), fixed part"),
    "layout_per_node": (3, "verify layout per draft node"),
    "accept_fixed": (3, "acceptance glue per step (host: sampling, the walk's setup)"),
    "accept_per_node": (3, "acceptance walk over the verified tree, per draft node (host)"),
    "commit_fixed": (3, "KV commit glue per step (host: the compaction plan)"),
}


class Launches(StrEnum):
    """Where an engine mode's kernel launches cost time (``EngineProfile.launches``)."""

    AHEAD = "host, ahead"  # host launches (eager PyTorch's Python dispatch, llama.cpp's C++
    # loop) that run ahead of a GPU's stream until a host sync: each stage takes max(device
    # work, launches); / host speed
    DEVICE = "device"  # graph nodes the GPU replays (CUDA graphs): added; the host CPU does not
    # matter


@dataclass(frozen=True)
class EngineProfile:
    """Host-side behaviour of an engine mode; every figure is an assumption until calibrated."""

    name: str
    step_overhead_s: float  # per step: Python dispatch, sampling glue, scheduler
    launch_s: float  # per kernel of ddtree's eager layer (KERNELS): dispatch, or its share of
    # a fused / graph-replayed kernel
    topk_fixed_s: float  # per request per step
    topk_per_candidate_s: float  # per candidate kept per drafted position (sort cost)
    tree_fixed_s: float  # per request per step: top-k copy to host + heap setup (or GPU kernel)
    tree_per_node_s: float  # per draft node
    layout_fixed_s: float  # per request per step: positions + ancestor-only mask
    layout_per_node_s: float
    accept_fixed_s: float  # per request per step
    accept_per_node_s: float  # walk over the verified tree, per draft node
    commit_fixed_s: float  # per request per step
    about: str = ""
    launches: Launches = Launches.DEVICE  # where its launch time goes (``Launches``)

    def specs(self) -> dict[str, ParamSpec]:
        out = {}
        for what, (width, about) in ENGINE_PARAMS.items():
            name = engine_param(self.name, what)
            default = getattr(self, f"{what}_s")
            out[name] = ParamSpec(
                name, default, default / width, default * width, "s", what == "step_overhead",
                f"{self.name} engine: {about}",
            )  # fmt: skip
        return out


_TOPK = dict(topk_fixed_s=10e-6, topk_per_candidate_s=2e-9)
_HOST_TREE = dict(
    **_TOPK,
    tree_fixed_s=100e-6,
    tree_per_node_s=3e-6,
    layout_fixed_s=30e-6,
    layout_per_node_s=0.3e-6,
    accept_fixed_s=30e-6,
    accept_per_node_s=0.2e-6,
    commit_fixed_s=30e-6,
)
_HOST_TREE_ABOUT = (
    "tree built on the CPU (heap ~90 µs at N=32, ~3 µs per node at N=1024: the published "
    "DDTree code's Python heap and visibility loop, timed on a 2-core CPU)"
)

ENGINES: dict[str, EngineProfile] = {
    "eager": EngineProfile(
        "eager",
        step_overhead_s=5e-3,
        launch_s=5e-6,
        **_HOST_TREE,
        about="eager PyTorch (HF transformers, the seed's SGLang DDTree path): Python dispatch "
        "per kernel (~5 us per aten op of ddtree's count, KERNELS), which runs ahead of the GPU "
        "until a host sync, so a small model's forward is dispatch-bound and a large one's "
        f"device-bound (Launches.AHEAD); {_HOST_TREE_ABOUT}",
        launches=Launches.AHEAD,
    ),
    "graphs": EngineProfile(
        "graphs",
        step_overhead_s=0.5e-3,
        launch_s=0.4e-6,
        **_HOST_TREE,
        about="CUDA-graph replay (SGLang/vLLM decode, torch.compile): a kernel costs a graph "
        f"node, not a Python dispatch; a per-step host cost remains; {_HOST_TREE_ABOUT}",
    ),
    "cpp": EngineProfile(
        "cpp",
        step_overhead_s=0.3e-3,
        launch_s=1.2e-6,
        **_HOST_TREE,
        about="a C++ runtime that launches every kernel itself, without graph replay or Python "
        "(llama.cpp's CUDA backend before CUDA graphs): ~20 kernels per GQA layer at a CUDA "
        "launch of ~4 us each, i.e. ~1.2 us per kernel of ddtree's eager count (KERNELS: 65 per "
        "GQA layer with its MLP), asynchronous, so they run ahead of the GPU until the token's "
        "sync (Launches.AHEAD); the step a graph build and sampling on the host (all assumed)",
        launches=Launches.AHEAD,
    ),
    "native": EngineProfile(
        "native",
        step_overhead_s=0.3e-3,
        launch_s=0.15e-6,
        **_TOPK,
        tree_fixed_s=15e-6,
        tree_per_node_s=0.05e-6,
        layout_fixed_s=3e-6,
        layout_per_node_s=0.01e-6,
        accept_fixed_s=3e-6,
        accept_per_node_s=0.01e-6,
        commit_fixed_s=3e-6,
        about="native C++/CUDA engine: graph-replayed kernels, tree built and walked on the "
        "GPU (assumed; no anchor)",
    ),
}
ENGINE_ALIASES = {"python": "eager"}
"""Old profile names still accepted in scenario files (with a note)."""


def default_params(engines: dict[str, EngineProfile] | None = None) -> dict[str, ParamSpec]:
    """Every parameter with its hand-set prior (what ``--validate`` fits from: no source's
    measurements are in it)."""
    specs = dict(BASE_PARAMS)
    for eng in (engines or ENGINES).values():
        specs.update(eng.specs())
    return specs


CORPUS_PRIOR_FILE = Path(str(resources.files("ddtree.perf").joinpath("data/corpus_prior.toml")))


@dataclass(frozen=True)
class CorpusPrior:
    """The cost model fitted on the corpus's train split (data/corpus_prior.toml)."""

    values: dict[str, float]
    points: int
    sources: int


@cache
def corpus_prior() -> CorpusPrior:
    data = tomllib.loads(CORPUS_PRIOR_FILE.read_text(encoding="utf-8"))
    return CorpusPrior(dict(data["values"]), int(data["points"]), int(data["sources"]))


def corpus_params(
    engines: dict[str, EngineProfile] | None = None, keep: frozenset[str] = frozenset()
) -> dict[str, ParamSpec]:
    """``default_params`` with each prior centred on the corpus's train fit (``corpus_prior``),
    its width as it was: what ``ddtree estimate`` starts a scenario from, so a question with no
    anchor of its own gets what the published measurements say. ``keep``: names whose default
    the scenario itself set (its [engine] tables), left as they are. Example: the defaults put
    ``stack_host.vllm`` at 1.0; the train fit at about 1.5 (vLLM's per-step host cost)."""
    fit = corpus_prior()
    specs = default_params(engines)
    for name, spec in specs.items():
        if name in fit.values and name not in keep:
            value = fit.values[name]  # may lie past the plausible range the width is from
            about = (
                f"{spec.about}; centred on the train fit of the corpus ({fit.points} points, "
                f"{fit.sources} sources: data/corpus_prior.toml; default {spec.default:.4g})"
            )
            specs[name] = replace(spec, default=value, about=about, centre="corpus")
    return specs


@dataclass(frozen=True)
class Drafter:
    """A drafter: a block drafter (DFlash: one forward over the block), an EAGLE head (one or a
    few layers run once per draft step), or the target's own MTP layer (``layer_shape``: the
    target's decoder layer, costed like the target's forward, one layer deep).

    An EAGLE-3 head keeps its own LM head over a smaller draft vocabulary (``lm_head_vocab``);
    the others share the target's."""

    params: float  # non-embedding parameters
    layers: int
    precision: str = "bf16"
    kv_bytes_per_token: float = 0.0  # drafter KV cache over the context, all layers
    shares_target_lm_head: bool = True
    source: str = ""
    lm_head_vocab: int = 0  # its own LM head's vocabulary (0: the target's, shared)
    layer_shape: ModelShape | None = None  # MTP: one layer of the target's shape
    projection_params: float = 0.0  # MTP: eh_proj, [embedding; hidden] (2h) -> h


@dataclass(frozen=True)
class Deployment:
    """How the model is spread over a point's ``tp`` GPUs.

    ``dp_attention``: attention, dense MLP layers, shared experts, LM head and drafter are
    replicated on every GPU and each GPU serves ceil(C / GPUs) requests (data parallel), else
    they are tensor-parallel (weights / GPUs, every GPU works on every request).
    ``moe_ep``: the routed experts are split into ``moe_ep`` groups of E / moe_ep whole
    experts, each group's experts split over its ``GPUs / moe_ep`` GPUs by their intermediate
    (MoE TP); None: every GPU is its own group (EP over the whole group); 1: no EP.
    Example: TensorRT-LLM's DeepSeek-R1 on 8 B200s, attention TP 8 with MoE TP 2 x EP 4.
    Collectives per target forward follow (``collectives_per_forward``): tensor-parallel
    attention ends each attention and each MLP/MoE sublayer with an all-reduce; data-parallel
    attention needs none, and sends tokens to their experts' GPUs and back (two all-to-alls
    per MoE layer).
    """

    name: str
    dp_attention: bool
    moe_ep: int | None  # expert-parallel groups; None: one per GPU
    about: str


DEPLOYMENTS: dict[str, Deployment] = {
    d.name: d
    for d in (
        Deployment(
            "tp", False, 1,
            "tensor parallel throughout: heads, MLP and every expert's intermediate split over "
            "the GPUs; 2 all-reduces per layer",
        ),
        Deployment(
            "tp-ep", False, None,
            "tensor-parallel attention, E/GPUs whole experts per GPU; every GPU holds every "
            "token after the attention all-reduce, so the MoE output is combined by the "
            "layer's all-reduce (ddtree's --ep runtime)",
        ),
        Deployment(
            "dp-ep", True, None,
            "data-parallel attention (replicated, C/GPUs requests each) and expert-parallel MoE "
            "(E/GPUs experts per GPU): two all-to-alls per MoE layer (dispatch, combine), no "
            "all-reduce (DeepSeek-V3-style large-scale EP serving)",
        ),
    )
}  # fmt: skip


def mixed_deployment(moe_tp: int, moe_ep: int) -> Deployment:
    """Tensor-parallel attention over the group, routed experts as ``moe_ep`` EP groups each
    split ``moe_tp`` ways (the group is moe_tp x moe_ep GPUs); the layer's all-reduce combines
    the MoE output as in ``tp-ep``."""
    return Deployment(
        f"tp-attention, MoE TP{moe_tp} x EP{moe_ep}", False, moe_ep,
        f"tensor-parallel attention over all the GPUs; routed experts in {moe_ep} groups of "
        f"E/{moe_ep} whole experts, each expert's intermediate split over {moe_tp} GPUs; shared "
        "experts and dense layers tensor-parallel; 2 all-reduces per layer",
    )  # fmt: skip


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
    policy: Policy = get_policy(DEFAULT_POLICY)
    deployment: Deployment = DEPLOYMENTS["tp"]
    draft_topk: int = 1  # tokens a draft step keeps per request (EAGLE / MTP: SGLang's topk)
    host: str = ""  # host CPU class ("": the hardware entry's host_cpu)
    gpus_per_node: int = 0  # GPUs sharing the hardware's interconnect (0: the hardware's)
    inter_node: Link | None = None  # the link between nodes when the group spans several
    stack: str = "any"  # the serving stack that ran it (STACKS); "any": not said
    launches: Launches | None = None  # its engine profile's ``launches`` (None: the built-in
    # profile's of that name, ENGINES; a scenario's own [engine.X] passes its base's)

    def __post_init__(self) -> None:
        if self.tp % self.experts_ep:
            raise ValueError(f"{self.experts_ep} EP groups do not divide {self.tp} GPUs")
        want = self.policy.budget(self.block_size, self.budget)
        if self.budget != want:
            raise ValueError(f"a {self.policy} step has budget {want}, got {self.budget}")
        if self.budget < self.policy.min_budget:
            raise ValueError(
                f"a {self.policy} step needs budget >= {self.policy.min_budget}, got {self.budget}"
            )

    @property
    def verify_width(self) -> int:
        return self.budget + 1

    @property
    def host_cpu(self) -> str:
        """The host CPU class that runs the engine's host side."""
        return self.host or self.hardware.host_cpu

    @property
    def experts_ep(self) -> int:
        """Expert-parallel groups of the routed experts (1: none)."""
        ep = self.deployment.moe_ep
        return self.tp if ep is None else ep

    @property
    def experts_tp(self) -> int:
        """GPUs each routed expert's intermediate is split over."""
        return self.tp // self.experts_ep

    @property
    def per_node(self) -> int:
        """GPUs of the group within one node (the interconnect's domain)."""
        return min(self.tp, self.gpus_per_node or self.hardware.gpus_per_node)

    @property
    def nodes(self) -> int:
        return math.ceil(self.tp / self.per_node)

    @property
    def weight_shards(self) -> int:
        """How many GPUs share the non-expert weights (1: replicated, data parallel)."""
        return 1 if self.deployment.dp_attention else self.tp

    @property
    def requests_per_gpu(self) -> int:
        """Requests whose tokens one GPU computes in the non-expert parts."""
        if self.deployment.dp_attention:
            return math.ceil(self.concurrency / self.tp)
        return self.concurrency

    def as_ar(self) -> Point:
        """The autoregressive step on the same hardware, TP, context and engine mode."""
        return replace(self, policy=AR, budget=0, block_size=1, drafter=None)


@dataclass(frozen=True)
class Forward:
    """One target forward: ``width`` new tokens per request over ``context`` cached ones."""

    stage: Stage
    width: float
    context: float


class Bound(StrEnum):
    """What a component's time is bound by (and so how it scales to other hardware)."""

    MEMORY = "memory"
    COMPUTE = "compute"
    LINK = "link"
    HOST = "host"


@dataclass
class Component:
    name: str
    stage: Stage  # the engine stage that times it
    seconds: np.ndarray | float
    hbm_bytes: float  # per GPU
    flops: float  # per GPU
    launches: float
    bound: Bound
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
        found = self.find(name)
        if found is None:
            raise KeyError(name)
        return found

    def find(self, name: str) -> Component | None:
        """The component called ``name``, or None (a dense model has no routed MoE)."""
        return next((c for c in self.components if c.name == name), None)

    def stage_s(self, stage: Stage):
        """Seconds of the components the engine times as ``stage`` (0 when there are none)."""
        return sum((c.seconds for c in self.components if c.stage is stage), 0.0)


EFFICIENCIES = ("moe_efficiency", "weights_efficiency", "compute_efficiency")


def param_for(params: dict, name: str, hw: Hardware):
    """``name@<hardware key>`` when the parameters have one (a device class of its own, such
    as this machine's CPU), else ``name``."""
    return params.get(f"{name}@{hw.key}", params[name])


def compute_efficiency(params: dict, hw: Hardware, stage: Stage):
    """The fraction of peak FLOP/s a forward's compute-bound kernels reach: a prompt's
    (``prefill_efficiency``: long GEMMs, flash-attention over the prompt) apart from a decode
    step's (``compute_efficiency``: a few tokens per request, large only at high concurrency).
    A device class fitted on its own (``compute_efficiency@<key>``) takes its one value."""
    scoped = params.get(f"compute_efficiency@{hw.key}")
    if scoped is not None:
        return scoped
    return params["prefill_efficiency" if stage is Stage.PREFILL else "compute_efficiency"]


def scoped_specs(
    specs: dict[str, ParamSpec], hardware_key: str, engines: tuple[str, ...] = ("eager",)
) -> dict[str, ParamSpec]:
    """Parameters of their own for one hardware entry (e.g. ``this-machine``), so CPU
    measurements do not pull the GPU ones: the efficiencies, the routing locality (the
    records' models are ddtree's own small ones, not the published ones), the engine
    parameters of the profiles that ran there (free, fitted to the records' stage timings; the
    prior is wide because a CPU eager op is not a GPU launch), and ``score_passes`` (our
    engine's attention materialises its fp32 scores; GPU serving kernels are fused and have
    none)."""
    out = dict(specs)
    for name in EFFICIENCIES:
        base = specs[name]
        out[f"{name}@{hardware_key}"] = replace(
            base, name=f"{name}@{hardware_key}", about=f"{base.about} (on {hardware_key})"
        )
    g = specs["routing_locality"]
    out[f"{g.name}@{hardware_key}"] = replace(
        g, name=f"{g.name}@{hardware_key}", default=1.0, centre="assumed",
        about=f"{g.about} (on {hardware_key}: ddtree's own small models, taken as routing "
        "independently, 1; a bench moe experts curve, where recorded, replaces it)",
    )  # fmt: skip
    for eng in engines:
        for what in ENGINE_PARAMS:
            base = specs.get(engine_param(eng, what))
            if base is None:
                continue
            scoped = f"{base.name}@{hardware_key}"
            out[scoped] = replace(
                base, name=scoped, low=base.default / 100, high=base.default * 100, fit=True,
                about=f"{base.about} (on {hardware_key})",
            )  # fmt: skip
    scores = f"score_passes@{hardware_key}"
    out[scores] = ParamSpec(
        scores, 9.0, 6.0, 12.0, "", True,
        "fp32 passes over the materialised attention scores [H, M, S+M] in ddtree's eager MLA "
        "(scale: read + write, mask add: read + write, softmax: 3 reads + 1 write, value matmul: "
        f"1 read = 9; 6-12 allowed) on {hardware_key}",
    )  # fmt: skip
    return out


def engine_value(params: dict, engine: str, what: str, hw: Hardware, host: str | None = None):
    """An engine's host parameter, scoped to ``hw`` when the parameters have it, on the host
    CPU class ``host`` (divided by its ``host_speed``; the reference host's is 1)."""
    return param_for(params, engine_param(engine, what), hw) / host_speed(params, host)


def host_speed(params: dict, host: str | None):
    """The host class's speed over the reference (1 for the reference, or no class)."""
    if host is None:
        return 1.0
    name = f"host_speed.{host}"
    return params.get(name, 1.0)


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


def routed_tokens(width, requests, locality: float, depth=None):
    """Independently routed tokens equivalent to ``requests`` requests of ``width`` tokens each
    in one forward, spread over ``depth`` consecutive positions (None: a chain, depth = width):
    requests x (width / depth) x depth^locality. Consecutive tokens of one request pick alike
    experts, so a chain of D touches the experts of D^g independent tokens (g =
    ``routing_locality``; 1: independent); a tree's siblings (other candidates at one position)
    are other tokens and route apart. Example: g = 0.5, 2 requests: a chain of 16 -> 8 tokens'
    worth; a tree of 16 over 4 depths -> 2 x 4 x 2 = 16; W = 1 -> requests whatever g."""
    w = np.asarray(width, dtype=float)
    d = w if depth is None else np.minimum(w, depth)
    return requests * w / d * d**locality


def routed_moe_layer(
    model: ModelShape, tokens, tp: int, curve=None, routed=None
) -> tuple[float, float, str]:
    """(bytes, FLOPs, compute precision) of one routed-MoE layer per GPU (experts TP-sharded).
    ``routed``: the independently routed tokens that decide the experts touched (``tokens``
    when not given); the FLOPs follow every token."""
    touched = experts_touched(
        model.n_routed_experts, model.top_k, tokens if routed is None else routed, curve
    )
    bpp = model.bytes_per_param("routed_experts")
    nbytes = touched * model.expert_params * bpp / tp
    flops = 2.0 * np.asarray(tokens, float) * model.top_k * model.expert_params / tp
    return nbytes, flops, COMPUTE_PRECISION[model.precision["routed_experts"]]


def _work_s(hw: Hardware, nbytes, flops, precision: str, mem_eff, cmp_eff):
    """(seconds, bound) of device work: bytes at mem_eff x HBM bw, FLOPs at cmp_eff x peak."""
    mem_s = nbytes / (hw.hbm_bytes_per_s * mem_eff)
    cmp_s = flops / (hw.peak_flops(precision) * cmp_eff)
    secs = np.maximum(mem_s, cmp_s) if hw.overlaps_memory_and_compute else mem_s + cmp_s
    bound = Bound.COMPUTE if np.asarray(cmp_s > mem_s).all() else Bound.MEMORY
    return secs, bound


def _mean(x) -> float:
    """A component's bytes or FLOPs as one figure: the mean over the samples (the array's own
    sum: ``np.mean``'s dispatch cost a fit on the corpus a fifth of its time, 8.9 s against 6.9 s)."""
    return float(x.sum()) / x.size if isinstance(x, np.ndarray) else float(x)


@cache
def expected_max_binomial(n: int, p: float, groups: int) -> float:
    """E[max of ``groups`` independent Binomial(n, p) counts], exactly:
    sum over x of P(max > x) = 1 - F(x)^groups. Example: n = 1, p = 0.5, 2 groups -> 0.75."""
    if groups == 1 or n == 0 or p <= 0.0 or p >= 1.0:
        return n * min(max(p, 0.0), 1.0)
    if n > 2000:  # normal approximation with the expected maximum of standard normals
        return n * p + math.sqrt(n * p * (1 - p)) * _expected_max_std_normal(groups)
    k = np.arange(n + 1)
    log_pmf = (
        np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in k])
        + k * math.log(p)
        + (n - k) * math.log1p(-p)
    )
    cdf = np.minimum(np.cumsum(np.exp(log_pmf)), 1.0)
    return float(np.sum(1.0 - cdf[:-1] ** groups))


@cache
def _expected_max_std_normal(groups: int) -> float:
    x = np.linspace(-8.0, 8.0, 4001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x]))
    return float(np.trapezoid(x * groups * phi * cdf ** (groups - 1), x))


def expert_parallel_moe_layer(model: ModelShape, tokens, gpus: int, curve=None, routed=None):
    """(bytes, FLOPs, compute precision) of one routed-MoE layer on the busiest GPU when each
    GPU holds E / gpus whole experts. Bytes: the expected maximum over GPUs of the experts a
    GPU's tokens touch (each of its E/gpus experts touched independently with the probability
    ``experts_touched / E``); FLOPs: the expected maximum of routed slots per GPU (the T x k
    slots land on a GPU with probability 1/gpus). Example: Kimi (E=384, k=8) at T=9 over 8
    GPUs: 66.3/384 -> 8.3 experts per GPU on average, 12.1 on the busiest."""
    e, k = model.n_routed_experts, model.top_k
    p = float(np.mean(experts_touched(e, k, tokens if routed is None else routed, curve))) / e
    busiest = expected_max_binomial(e // gpus, p, gpus)
    slots = expected_max_binomial(int(round(float(np.mean(tokens)) * k)), 1.0 / gpus, gpus)
    nbytes = busiest * model.expert_params * model.bytes_per_param("routed_experts")
    flops = 2.0 * slots * model.expert_params
    return nbytes, flops, COMPUTE_PRECISION[model.precision["routed_experts"]]


def moe_layer_s(model: ModelShape, hw: Hardware, m, params: dict, tp: int = 1, curve=None):
    """Kernel time of one routed-MoE layer at M tokens (what ``bench moe`` measures)."""
    nbytes, flops, prec = routed_moe_layer(model, m, tp, curve)
    eff = param_for(params, "moe_efficiency", hw), param_for(params, "compute_efficiency", hw)
    return _work_s(hw, nbytes, flops, prec, *eff)[0]


_DEVICE_RULE = "1 / HBM bandwidth (memory-bound) or 1 / dense FLOP/s (compute-bound)"


def _stream(
    name: str, stage: Stage, pt: Point, params: dict, nbytes, launches: float, formula: str
) -> Component:
    """A component that streams large contiguous buffers (logits, attention scores) once per
    pass: bytes at the peak bandwidth, plus its kernel launches."""
    secs = nbytes / pt.hardware.hbm_bytes_per_s + launch_seconds(pt, params, launches)
    return Component(name, stage, secs, _mean(nbytes), 0.0, launches, Bound.MEMORY,
                     "1 / HBM bandwidth (streaming at peak)", formula)  # fmt: skip


def _device(
    name: str,
    stage: Stage,
    pt: Point,
    params: dict,
    nbytes,
    flops,
    precision: str,
    launches: float,
    formula: str,
    efficiency: str = "weights_efficiency",
    fmt: str = "bf16",
) -> Component:
    """A device component: its work at the fitted efficiencies plus its kernel launches. The
    memory efficiency is the component's (``efficiency``) x its GPU generation's x its weight
    format's kernel path's x its serving stack's (``memory_efficiency``)."""
    hw = pt.hardware
    secs, bound = _work_s(
        hw, nbytes, flops, precision, memory_efficiency(params, efficiency, hw, fmt, pt.stack),
        compute_efficiency(params, hw, stage),
    )  # fmt: skip
    secs = secs + launch_seconds(pt, params, launches)
    return Component(name, stage, secs, _mean(nbytes), _mean(flops),
                     launches, bound, _DEVICE_RULE, formula)  # fmt: skip


MAX_MEMORY_EFFICIENCY = 0.97  # no kernel streams its weights at more than this of the peak


def memory_efficiency(
    params: dict, efficiency: str, hw: Hardware, fmt: str = "bf16", stack: str = "any"
):
    """``efficiency`` (weights or MoE) x ``gen_efficiency.<generation>`` x
    ``path_efficiency.<kernel_path>`` x ``stack_kernel.<stack>``, at most
    ``MAX_MEMORY_EFFICIENCY``. A GPU without a generation (a typed-in table, this machine's
    CPU), 16-bit weights and a stack without a multiplier ("any", "other": ``NO_STACK_SCALE``)
    take multiplier 1."""
    eff = param_for(params, efficiency, hw)
    if f"{efficiency}@{hw.key}" in params:
        return eff  # a device class fitted on its own (this machine's CPU records)
    gen = getattr(hw, "generation", "")
    if gen:
        eff = eff * params.get(f"gen_efficiency.{gen}", 1.0)
    path = kernel_path(hw, fmt)
    if path != "16bit":
        eff = eff * params.get(f"path_efficiency.{path}", 1.0)
    eff = eff * stack_scale(params, stack, "kernel")
    return np.minimum(eff, MAX_MEMORY_EFFICIENCY)


def launch_kind(pt: Point) -> Launches:
    """The point's engine profile's ``Launches`` (graph replay for an engine of no profile)."""
    if pt.launches is not None:
        return pt.launches
    profile = ENGINES.get(pt.engine)
    return Launches.DEVICE if profile is None else profile.launches


def dispatch_overlaps(pt: Point) -> bool:
    """True when the point's kernel launches run ahead of its device work rather than adding to
    it: host launches (``Launches.AHEAD``: eager PyTorch, llama.cpp) on a GPU, whose stream
    queues the kernels while the host launches the next. On a device without a GPU generation
    (this machine's CPU) the host runs the kernels itself."""
    return launch_kind(pt) is Launches.AHEAD and bool(getattr(pt.hardware, "generation", ""))


def launch_s(pt: Point, params: dict):
    """One launch's time: the profile's ``launch``, / the host CPU's speed where the host pays it
    (``Launches.AHEAD``); a replayed graph node's is the GPU's (``DEVICE``), the same on any
    host."""
    host = None if launch_kind(pt) is Launches.DEVICE else pt.host_cpu
    return engine_value(params, pt.engine, "launch", pt.hardware, host)


def launch_seconds(pt: Point, params: dict, launches):
    """The launch time a device component adds to its own seconds: launches x ``launch_s``, or
    0 where dispatch overlaps the device work (``dispatch_overlaps``; the stage's
    ``exposed_dispatch`` then holds what the device work does not hide)."""
    if dispatch_overlaps(pt):
        return 0.0
    return launches * launch_s(pt, params)


EXPOSED_DISPATCH = "kernel dispatch beyond device time"  # each stage's: "... (verify)"


def device_s(comps: list[Component]):
    """The device time of ``comps``: their memory- and compute-bound components' seconds (with
    whatever launch time those carry), not their host or link time."""
    return sum(c.seconds for c in comps if c.bound in (Bound.MEMORY, Bound.COMPUTE))


def exposed_dispatch(pt: Point, params: dict, comps: list[Component]) -> list[Component]:
    """Where dispatch overlaps the device work (``dispatch_overlaps``), one component per
    stage: max(0, the stage's launches x ``launch`` - its device time). The host queues a
    stage's kernels while the GPU runs the earlier ones, and the stages are apart by host
    syncs (sampling, the tree, the accept walk), so a stage takes the longer of the two.
    Example: a 28-layer 7B forward dispatching 1,700 kernels at 10 us (17 ms) over 8 ms of
    weight reads takes 17 ms, and reading int4 weights instead (2.5 ms) leaves it at 17 ms."""
    if not dispatch_overlaps(pt):
        return []
    launch = launch_s(pt, params)
    out = []
    for stage in dict.fromkeys(c.stage for c in comps):
        own = [c for c in comps if c.stage is stage]
        launches = sum(c.launches for c in own)
        if not launches:
            continue
        out.append(Component(
            f"{EXPOSED_DISPATCH} ({stage})", stage,
            np.maximum(0.0, launches * launch - device_s(own)),
            0.0, 0.0, 0.0, Bound.HOST,
            f"{pt.engine} engine on the {pt.host_cpu} host: constant across GPUs, / host speed",
            f"max(0, {launches:.0f} launches x {pt.engine}.launch - the stage's device time)",
        ))  # fmt: skip
    return out


def _host(name: str, stage: Stage, pt: Point, seconds, formula: str) -> Component:
    return Component(
        name, stage, seconds, 0.0, 0.0, 0.0, Bound.HOST,
        f"{pt.engine} engine on the {pt.host_cpu} host: constant across GPUs, / host speed",
        formula,
    )  # fmt: skip


def _state_bytes(model: ModelShape, pt: Point) -> float:
    """Linear-attention layers: each request's recurrent state, read and written once per
    forward (split over TP by value heads)."""
    if not model.linear_layers:
        return 0.0
    shard = min(pt.weight_shards, model.linear_num_value_heads)
    per = model.linear_layers * model.state_bytes_per_request_layer() * 2.0 / shard
    return pt.requests_per_gpu * per


# ---- the target forward -------------------------------------------------------------------


def attention(model: ModelShape, pt: Point, params: dict, fwd: Forward) -> Component:
    """Attention weights once, KV over the context per request; every query scores the
    context and the ``width`` new keys (the tree mask is dense ``[M, S + M]``)."""
    L, C, tp = model.num_layers, pt.requests_per_gpu, pt.weight_shards
    T = fwd.width * C
    weights = L * model.attention_params_per_shard(tp) * model.bytes_per_param("attention")
    kv = C * model.kv_bytes_read(fwd.context, tp)
    flops = 2.0 * T * L * model.attention_params_per_layer / tp + (
        T * model.score_flops(fwd.context, fwd.width) / tp
        + T * model.linear_layers * model.linear_flops_per_token_layer() / tp
    )
    return _device(
        "attention (weights + KV)", fwd.stage, pt, params,
        weights + kv + _state_bytes(model, pt), flops,
        COMPUTE_PRECISION[model.precision["attention"]],
        L * KERNELS["attention" if model.attention == "mla" else "attention_gqa"],
        "L x attn params x bytes/param / TP (K/V projections replicated past the KV heads) + "
        "C x L x context (sliding layers: at most the "
        "window; linear-attention layers none) x KV bytes/token + C x L_linear x state bytes "
        "x 2 (read + write) "
        "(FLOPs 2 x M x C x L x attn params + M x C x (keys read + L_attn x M) x "
        "FLOPs/query-key)", fmt=model.precision["attention"],
    )  # fmt: skip


def attention_scores(model: ModelShape, pt: Point, params: dict, fwd: Forward):
    """Memory traffic of a materialised fp32 score matrix ``[H, M, S + M]`` per layer and
    request (an unfused eager softmax): ``score_passes`` reads/writes of it. Only where the
    parameters carry ``score_passes@<hardware>`` (this machine); fused GPU attention has none."""
    passes = params.get(f"score_passes@{pt.hardware.key}")
    if passes is None:
        return None
    heads = model.num_heads / min(pt.weight_shards, model.num_heads)
    keys = model.kv_tokens_read(fwd.context) + model.attention_layers * fwd.width
    scores = pt.requests_per_gpu * heads * fwd.width * keys
    return _stream(
        "attention scores", fwd.stage, pt, params, scores * 4.0 * passes, 0.0,
        "C x heads/TP x M x (keys read over the layers + L_attn x M) x 4 B x score passes "
        "(unfused softmax)",
    )  # fmt: skip


def forward_routing(pt: Point, params: dict, fwd: Forward) -> tuple[float, float]:
    """(routed tokens T, exponent g) of a forward's routed-MoE layers (``routed_tokens``). A
    verify's tokens (a tree over at most the block's positions) route alike, at
    ``routing_locality`` (the hardware entry's own where it has one); a prompt's hundreds of
    tokens are taken as independent, and a measured experts curve was read off real routing,
    locality included: g = 1 for both."""
    local = fwd.stage is Stage.VERIFY and not pt.experts_curve
    g = param_for(params, "routing_locality", pt.hardware) if local else 1.0
    return routed_tokens(fwd.width, pt.concurrency, g, pt.block_size if local else None), g


def routed_moe(model: ModelShape, pt: Point, params: dict, fwd: Forward) -> Component | None:
    Lm = model.num_moe_layers
    if not Lm:
        return None
    tokens = fwd.width * pt.concurrency
    routed, _ = forward_routing(pt, params, fwd)
    if pt.experts_ep > 1:
        ep, etp = pt.experts_ep, pt.experts_tp
        nbytes, flops, prec = expert_parallel_moe_layer(model, tokens, ep, pt.experts_curve, routed)
        nbytes, flops = nbytes / etp, flops / etp
        formula = (
            "L_moe x E[max over EP groups of experts touched in a group] x expert params x "
            "bytes/param / MoE TP (each group's E/EP experts touched independently with "
            "p = 1-(1-k/E)^T); FLOPs over E[max] routed slots per group / MoE TP"
        )
    else:
        nbytes, flops, prec = routed_moe_layer(model, tokens, pt.tp, pt.experts_curve, routed)
        formula = "L_moe x E(1-(1-k/E)^T) x expert params x bytes/param / TP"
    formula += (
        " (T = C x M/D x D^g routed tokens: a request's M tokens over D positions, consecutive "
        "ones routing alike, g = routing_locality)"
    )
    launches = KERNELS["routed_moe"]
    if pt.hardware.looped_moe and pt.engine == "eager":
        # ddtree's own eager MoE: a few kernels per touched expert (compiled mode's fixed-shape
        # dispatch, read as the graphs profile, launches none per expert)
        touched = experts_touched(model.n_routed_experts, model.top_k, routed, pt.experts_curve)
        launches = launches + KERNELS["routed_moe_per_expert"] * touched / pt.tp
    return _device(
        "routed MoE", fwd.stage, pt, params, Lm * nbytes, Lm * flops, prec, Lm * launches,
        formula + (" [measured experts curve]" if pt.experts_curve else ""),
        efficiency="moe_efficiency", fmt=model.precision["routed_experts"],
    )  # fmt: skip


LOOPED_EXPERTS_STACKS = ("transformers",)
"""Stacks whose eager MoE block runs the experts one by one in Python over every expert of the
layer, whatever the batch: Hugging Face transformers' Mixtral / Qwen2-MoE / Qwen3-MoE blocks
(``for expert_idx in range(num_experts)``, a ``torch.where`` on the expert mask each) in the
4.3x-4.5x releases the corpus's sources ran. Later releases loop over the experts the batch
touches only (``expert_hit``) and are over-priced by this rule."""


def expert_loop(model: ModelShape, pt: Point, params: dict, fwd: Forward) -> Component | None:
    """The host time of a looped-experts stack's MoE blocks: L_moe x E x ``expert_loop`` /
    host speed, per forward. At batch 1 it dwarfs the experts' bytes (Qwen3-30B-A3B: 48 x 128
    iterations a token)."""
    if pt.stack not in LOOPED_EXPERTS_STACKS or pt.engine != "eager" or not model.num_moe_layers:
        return None
    loops = model.num_moe_layers * model.n_routed_experts
    return _host(
        "per-expert loop", fwd.stage, pt,
        loops * params["expert_loop"] / host_speed(params, pt.host_cpu),
        f"L_moe x E x expert_loop ({model.num_moe_layers} x {model.n_routed_experts}, "
        f"{pt.stack}'s Python loop over every expert, a host sync each) / host speed",
    )  # fmt: skip


def shared_experts(model: ModelShape, pt: Point, params: dict, fwd: Forward) -> Component | None:
    Lm = model.num_moe_layers
    if not Lm or not model.n_shared_experts:
        return None
    sp = model.shared_expert_params
    return _device(
        "shared experts", fwd.stage, pt, params,
        Lm * sp * model.bytes_per_param("shared_experts") / pt.weight_shards,
        2.0 * fwd.width * pt.requests_per_gpu * Lm * sp / pt.weight_shards,
        COMPUTE_PRECISION[model.precision["shared_experts"]], Lm * KERNELS["shared_experts"],
        "L_moe x shared x expert params x bytes/param / TP", fmt=model.precision["shared_experts"],
    )  # fmt: skip


def dense_mlp(model: ModelShape, pt: Point, params: dict, fwd: Forward) -> Component | None:
    Ld = model.num_dense_layers
    if not Ld:
        return None
    return _device(
        "dense MLP layers", fwd.stage, pt, params,
        Ld * model.dense_mlp_params * model.bytes_per_param("dense_mlp") / pt.weight_shards,
        2.0 * fwd.width * pt.requests_per_gpu * Ld * model.dense_mlp_params / pt.weight_shards,
        COMPUTE_PRECISION[model.precision["dense_mlp"]], Ld * KERNELS["dense_mlp"],
        "L_dense x 3 x hidden x intermediate x bytes/param / TP", fmt=model.precision["dense_mlp"],
    )  # fmt: skip


def lm_head(model: ModelShape, pt: Point, params: dict, fwd: Forward) -> Component:
    return _device(
        "LM head over M", fwd.stage, pt, params,
        model.lm_head_params * model.bytes_per_param("lm_head") / pt.weight_shards,
        2.0 * fwd.width * pt.requests_per_gpu * model.lm_head_params / pt.weight_shards,
        COMPUTE_PRECISION[model.precision["lm_head"]], KERNELS["lm_head"],
        "vocab x hidden x bytes/param / TP (FLOPs 2 x M x C x vocab x hidden / TP)",
        fmt=model.precision["lm_head"],
    )  # fmt: skip


@dataclass(frozen=True)
class Collectives:
    """Collectives one target forward issues on every GPU."""

    all_reduce: int
    all_to_all: int


def collectives_per_forward(model: ModelShape, deployment: Deployment) -> Collectives:
    """Tensor-parallel attention: an all-reduce after each attention and each MLP/MoE
    sublayer (2 x L; expert-parallel experts are combined by the MoE's). Data-parallel
    attention: a dispatch and a combine all-to-all per MoE layer (2 x L_moe), no all-reduce.
    The parallel runtime (``ddtree.models.adapters.parallel``) is tested to issue exactly these."""
    if deployment.dp_attention:
        return Collectives(all_reduce=0, all_to_all=2 * model.num_moe_layers)
    return Collectives(all_reduce=2 * model.num_layers, all_to_all=0)


def _latency_s(pt: Point, params: dict):
    """The latency of one collective of the point's group: the inter-node link's when the
    group spans nodes (its 2-node figure times log2(nodes): NCCL's small-message all-reduce
    across nodes runs on trees, whose latency grows with their depth; assumed), else the
    hardware interconnect's. A measured latency (``bench
    allreduce`` record) is used as it is; a catalog or assumed one times the
    ``allreduce_scale.<class>`` parameter."""
    if pt.nodes > 1:  # the link's latency is for 2 nodes; a tree over n nodes has log2(n) levels
        depth = math.log2(pt.nodes)
        return pt.inter_node.allreduce_latency_s * depth * params["allreduce_scale.inter_node"]
    hw = pt.hardware
    prov = hw.provenance.get("allreduce_latency")
    scale = 1.0 if prov is not None and prov.kind == "measured" else (
        params[f"allreduce_scale.{link_class(hw)}"]
    )  # fmt: skip
    return hw.allreduce_latency_s * scale


def _link_s(pt: Point, params: dict, intra_bytes, inter_bytes=0.0):
    """One collective: latency + bytes over the node's interconnect + bytes over the
    inter-node link (per GPU, per direction)."""
    inter = inter_bytes / pt.inter_node.bytes_per_s if pt.nodes > 1 else 0.0
    return _latency_s(pt, params) + intra_bytes / (pt.hardware.link_bytes_per_s or 1e30) + inter


def _link_rule(pt: Point) -> str:
    hw = pt.hardware
    prov = hw.provenance.get("link_bandwidth")
    how = f", {prov.label()}" if prov is not None else ""
    rule = f"interconnect ({hw.interconnect or 'unknown'}{how})"
    if pt.nodes > 1:
        link = pt.inter_node
        rule += (
            f" within each of {pt.nodes} nodes of {pt.per_node} GPUs, {link.name} between them "
            f"({link.provenance['bandwidth'].label()}; latency {link.provenance['allreduce_latency'].label()})"
        )
    return rule + ": latency + bytes / link bandwidth"


def allreduce_bytes(pt: Point, nbytes: float) -> tuple[float, float]:
    """(bytes over the node's interconnect, bytes over the inter-node link) per GPU for an
    all-reduce of ``nbytes``: a ring within a node, 2(g-1)/g x S; across n nodes the
    hierarchical scheme NCCL uses, each GPU's 1/g share all-reduced between nodes over its own
    NIC, 2(n-1)/n x S/g. Example: TP 16 as 2 x 8, S = 14 kB: 24.5 kB in the node, 1.75 kB out."""
    g, n = pt.per_node, pt.nodes
    return 2.0 * (g - 1) / g * nbytes, 2.0 * (n - 1) / n * nbytes / g


def tp_allreduce(model: ModelShape, pt: Point, params: dict, fwd: Forward) -> Component | None:
    """The all-reduces of the bf16 activations (``collectives_per_forward``)."""
    count = collectives_per_forward(model, pt.deployment).all_reduce
    if pt.tp <= 1 or not count:
        return None
    ar_bytes = fwd.width * pt.concurrency * model.hidden_size * 2.0
    per = _link_s(pt, params, *allreduce_bytes(pt, ar_bytes))
    across = "" if pt.nodes == 1 else " + 2(n-1)/n x (M x C x hidden x 2 B)/g / inter-node bw"
    return Component(
        "TP all-reduce", fwd.stage, count * per, 0.0, 0.0, 0.0, Bound.LINK, _link_rule(pt),
        f"{count} (2 x L) x (latency + 2(g-1)/g x M x C x hidden x 2 B / link bw{across})",
    )  # fmt: skip


def ep_alltoall(model: ModelShape, pt: Point, params: dict, fwd: Forward) -> Component | None:
    """Dispatch and combine all-to-alls of data-parallel attention + expert-parallel MoE: a
    GPU sends each of its tokens' hidden vectors (bf16) to the GPUs of its k experts that are
    not its own, and gets the results back; the copies bound for another node cross the
    inter-node link. The latency of an all-to-all is taken as an all-reduce's (assumed)."""
    count = collectives_per_forward(model, pt.deployment).all_to_all
    if pt.tp <= 1 or not count:
        return None
    local_tokens = fwd.width * pt.requests_per_gpu
    per_copy = local_tokens * model.top_k * model.hidden_size * 2.0 / pt.tp
    intra, inter = per_copy * (pt.per_node - 1), per_copy * (pt.tp - pt.per_node)
    return Component(
        "EP all-to-all", fwd.stage, count * _link_s(pt, params, intra, inter), 0.0, 0.0, 0.0,
        Bound.LINK, _link_rule(pt),
        f"{count} (2 x L_moe) x (latency [as an all-reduce's, assumed] + M x ceil(C/GPUs) x k x "
        "(g-1)/GPUs x hidden x 2 B / link bw + the (GPUs-g)/GPUs bound for other nodes / "
        "inter-node bw)",
    )  # fmt: skip


CONTROL_BROADCASTS_PER_CALL = 2
"""Broadcasts from rank 0 per Target call (verify, commit) in a tensor-parallel group: a
header, then the call's payload (``ddtree.models.adapters.parallel.Channel``; tested)."""


def _control(pt: Point, params: dict, stage: Stage, name: str) -> Component | None:
    if pt.tp <= 1 or pt.deployment.dp_attention:
        return None
    return Component(
        name, stage, CONTROL_BROADCASTS_PER_CALL * _latency_s(pt, params), 0.0, 0.0, 0.0,
        Bound.LINK, _link_rule(pt),
        f"{CONTROL_BROADCASTS_PER_CALL} small broadcasts from rank 0 per Target call x latency "
        "(which call, then its tokens or indices)",
    )  # fmt: skip


def control_broadcasts(model: ModelShape, pt: Point, params: dict, fwd: Forward):
    """Rank 0 telling the other ranks which forward to run (data-parallel attention: each GPU
    schedules its own requests, none)."""
    return _control(pt, params, fwd.stage, "TP control broadcasts")


TARGET_FORWARD: tuple[Callable[..., Component | None], ...] = (
    attention,
    attention_scores,
    routed_moe,
    expert_loop,
    shared_experts,
    dense_mlp,
    lm_head,
    tp_allreduce,
    ep_alltoall,
    control_broadcasts,
)


def target_forward(model: ModelShape, pt: Point, params: dict, fwd: Forward) -> list[Component]:
    """The target forward's components, tagged ``fwd.stage``, and its per-layer floor."""
    comps = [c for fn in TARGET_FORWARD if (c := fn(model, pt, params, fwd)) is not None]
    floor = layer_floor(model, pt, params, fwd, comps)
    return comps if floor is None else [*comps, floor]


def layer_floor(
    model: ModelShape, pt: Point, params: dict, fwd: Forward, comps
) -> Component | None:
    """What a forward's layers take beyond their bytes and launches when those fall under the
    GPU generation's per-layer floor: max(0, L x floor - device time of the forward). Small-
    batch kernels have tails and synchronisation between a layer's kernels that bytes do not
    reach (a prefill is far above it)."""
    gen = getattr(pt.hardware, "generation", "")
    name = f"layer_floor.{gen}"
    if not gen or name not in params:
        return None
    secs = np.maximum(0.0, model.num_layers * params[name] - device_s(comps))
    return Component(
        "per-layer kernel floor", fwd.stage, secs, 0.0, 0.0, 0.0, Bound.HOST,
        f"a {gen} kernel's small-batch floor: constant across bandwidth",
        f"max(0, L x {name} - the forward's device time)",
    )  # fmt: skip


# ---- the rest of a step -------------------------------------------------------------------


def drafter_forward(model: ModelShape, pt: Point, params: dict) -> Component | None:
    """The drafter over the block (B slots), plus the target's LM head over B-1 slots, or
    its own head over a draft vocabulary of ``lm_head_vocab`` rows (``--draft-vocab K``)."""
    d = pt.drafter
    if d is None:
        return None
    C, B, tp = pt.requests_per_gpu, pt.block_size, pt.weight_shards
    nbytes = d.params * PRECISION_BYTES[d.precision] / tp + C * pt.context_tokens * (
        d.kv_bytes_per_token / tp
    )
    flops = 2.0 * C * B * d.params / tp
    launches = d.layers * KERNELS["drafter_layer"]
    if d.lm_head_vocab:  # K rows of the head, copied at the drafter's precision
        head = d.lm_head_vocab * model.hidden_size
        nbytes = nbytes + head * PRECISION_BYTES[d.precision] / tp
        flops = flops + 2.0 * C * (B - 1) * head / tp
        launches += KERNELS["lm_head"]
    elif d.shares_target_lm_head:
        nbytes = nbytes + model.lm_head_params * model.bytes_per_param("lm_head") / tp
        flops = flops + 2.0 * C * (B - 1) * model.lm_head_params / tp
        launches += KERNELS["lm_head"]
    return _device(
        "drafter forward", Stage.DRAFT, pt, params, nbytes, flops,
        COMPUTE_PRECISION[d.precision], launches,
        "drafter params x bytes/param / TP + target LM head over B-1 slots",
    )  # fmt: skip


def candidates(model: ModelShape, pt: Point) -> int:
    """K, the candidates per depth taken from the drafter: the policy's (1 for chain, min(N, V)
    for ddtree)."""
    return pt.policy.candidates(pt.budget, model.vocab_size)


def topk(model: ModelShape, pt: Point, params: dict) -> Component:
    """log-softmax + top-K over the (B-1) x V drafter logits (float32): three passes (V: the
    drafter's draft vocabulary when it has one)."""
    vocab = (pt.drafter.lm_head_vocab if pt.drafter is not None else 0) or model.vocab_size
    return _stream(
        "top-k over (B-1) x V", Stage.TOPK, pt, params,
        pt.requests_per_gpu * (pt.block_size - 1) * vocab * 4.0 * 3, KERNELS["topk"],
        "C x (B-1) x vocab x 4 B x 3 (log-softmax read + write, top-k read) / HBM bw",
    )  # fmt: skip


def topk_sort(model: ModelShape, pt: Point, params: dict) -> Component:
    """The top-k's selection and sort of the K kept candidates: grows with the budget (K =
    min(N, V) for ddtree)."""
    fixed = engine_value(params, pt.engine, "topk_fixed", pt.hardware, pt.host_cpu)
    per = engine_value(params, pt.engine, "topk_per_candidate", pt.hardware, pt.host_cpu)
    rows = pt.block_size - 1
    return _host(
        "top-k sort over K", Stage.TOPK, pt,
        pt.requests_per_gpu * (fixed + rows * candidates(model, pt) * per),
        "C x (fixed + (B-1) x K x per candidate)",
    )  # fmt: skip


def tree_build(pt: Point, params: dict) -> Component:
    fixed = engine_value(params, pt.engine, "tree_fixed", pt.hardware, pt.host_cpu)
    per_node = engine_value(params, pt.engine, "tree_per_node", pt.hardware, pt.host_cpu)
    return _host(
        "tree build", Stage.BUILD, pt, pt.requests_per_gpu * (fixed + pt.budget * per_node),
        "C x (fixed + N x per node)",
    )  # fmt: skip


def verify_layout(pt: Point, params: dict) -> Component:
    fixed = engine_value(params, pt.engine, "layout_fixed", pt.hardware, pt.host_cpu)
    per_node = engine_value(params, pt.engine, "layout_per_node", pt.hardware, pt.host_cpu)
    return _host(
        "verify layout", Stage.LAYOUT, pt, pt.requests_per_gpu * (fixed + pt.budget * per_node),
        "C x (fixed + N x per node): positions and the ancestor-only mask",
    )  # fmt: skip


def accept(model: ModelShape, pt: Point, params: dict) -> Component:
    """The target's token at every tree node: an argmax over the verify logits [C x M, V]."""
    return _stream(
        "accept", Stage.ACCEPT, pt, params, pt.requests_per_gpu * pt.verify_width * model.vocab_size
        * 4.0, KERNELS["accept"], "C x M x vocab x 4 B (argmax over the fp32 logits) / HBM bw",
    )  # fmt: skip


def accept_walk(pt: Point, params: dict) -> Component:
    fixed = engine_value(params, pt.engine, "accept_fixed", pt.hardware, pt.host_cpu)
    per_node = engine_value(params, pt.engine, "accept_per_node", pt.hardware, pt.host_cpu)
    return _host(
        "accept walk", Stage.ACCEPT, pt, pt.requests_per_gpu * (fixed + pt.budget * per_node),
        "C x (fixed + N x per node) (the accepted path is walked on the host)",
    )  # fmt: skip


def commit_glue(pt: Point, params: dict) -> Component:
    return _host(
        "KV commit glue", Stage.COMMIT, pt,
        pt.requests_per_gpu * engine_value(params, pt.engine, "commit_fixed", pt.hardware, pt.host_cpu),
        "C x fixed (the compaction plan, on the host)",
    )  # fmt: skip


def kv_commit(model: ModelShape, pt: Point, params: dict, tau) -> Component:
    """Keep the accepted path's KV entries: read + write tau tokens per layer."""
    tau_v = 0.0 if tau is None else np.asarray(tau)
    return _device(
        "KV commit", Stage.COMMIT, pt, params,
        pt.requests_per_gpu * tau_v * model.kv_bytes_per_token(pt.weight_shards) * 2.0
        + np.minimum(tau_v, 1.0) * _state_bytes(model, pt),
        0.0, "bf16", model.num_layers * KERNELS["commit_per_layer"],
        "C x tau x L_attn x KV bytes/token x 2 (read + write) + C x L_linear x state bytes x 2 "
        "(the accepted node's recurrent state), one kernel per layer",
    )  # fmt: skip


def stack_scale(params: dict, stack: str, what: str):
    """``stack_<what>.<stack>`` for a serving stack (1 for "any": a projection for no stack in
    particular takes the shared values; 1 for a pair in ``NO_STACK_SCALE``)."""
    return params.get(f"stack_{what}.{stack}", 1.0)


def framework_overhead(pt: Point, params: dict) -> Component:
    return _host(
        "framework overhead", Stage.OTHER, pt,
        engine_value(params, pt.engine, "step_overhead", pt.hardware, pt.host_cpu)
        * stack_scale(params, pt.stack, "host"),
        f"{pt.engine} engine step overhead x stack_host.{pt.stack}",
    )  # fmt: skip


def spec_overhead(
    pt: Point, params: dict, what: str, stage: Stage, times: int = 1
) -> Component | None:
    """One of a GPU serving engine's speculative host costs (``spec_step_overhead`` once per
    step, ``draft_step_overhead`` per draft step, ``draft_forward_overhead`` per one-pass
    drafter forward) x the stack's ``stack_spec`` / host speed, x ``spec_tp_scale`` per doubling
    of the TP group (log2 TP of them). None on a device without a GPU
    generation (this machine's CPU: our engine's stage timings price its host work through the
    profile's own top-k, tree, layout, accept and commit figures)."""
    if not getattr(pt.hardware, "generation", ""):
        return None
    secs = params[what] * stack_scale(params, pt.stack, "spec") / host_speed(params, pt.host_cpu)
    if pt.tp > 1:
        secs = secs * params["spec_tp_scale"] ** np.log2(pt.tp)
    label = what.replace("_", " ")
    formula = f"{what} x stack_spec.{pt.stack}" + (
        f" x spec_tp_scale^log2({pt.tp})" if pt.tp > 1 else ""
    )
    return _host(
        label if times == 1 else f"{times} x {label}", stage, pt, secs * times,
        f"{times} x {formula}" if times != 1 else formula,
    )  # fmt: skip


def _total(pt: Point, params: dict, comps: list[Component]) -> StepCost:
    comps = [*comps, *exposed_dispatch(pt, params, comps)]
    step_s = sum(c.seconds for c in comps)
    hbm = sum(c.hbm_bytes for c in comps)
    return StepCost(pt, comps, step_s, hbm, hbm / pt.hardware.hbm_bytes_per_s)


def _check(pt: Point) -> None:
    if pt.tp < 1 or pt.concurrency < 1:
        raise ValueError(
            f"tp and concurrency must be >= 1, got tp={pt.tp}, concurrency={pt.concurrency}"
        )


def block_draft(model: ModelShape, pt: Point, params: dict) -> list[Component | None]:
    """DFlash-style drafting (``Drafting.BLOCK``): one drafter forward over the block, the
    top-K of its B-1 distributions, the tree and its verify layout."""
    return [
        drafter_forward(model, pt, params),
        spec_overhead(pt, params, "draft_forward_overhead", Stage.DRAFT),
        topk(model, pt, params),
        topk_sort(model, pt, params),
        tree_build(pt, params),
        verify_layout(pt, params),
    ]


def _repeated(comps: list[Component], times: int, what: str) -> list[Component]:
    """``times`` identical passes of the same components (the draft steps)."""
    return [
        replace(
            c,
            name=f"{what}: {c.name}",
            seconds=c.seconds * times,
            hbm_bytes=c.hbm_bytes * times,
            flops=c.flops * times,
            launches=c.launches * times,
            formula=f"{times} x ({c.formula})",
        )  # fmt: skip
        for c in comps
    ]


def draft_step_pass(model: ModelShape, pt: Point, params: dict) -> list[Component]:
    """One draft step of an EAGLE head or an MTP layer over the ``draft_topk`` tokens each
    request keeps (the first step extends the accepted tokens into the drafter's cache:
    taken as one step too, assumed).

    MTP (``layer_shape``): the target's own decoder layer, costed like one layer of the
    target's forward (attention over the context, its experts, the shared LM head, the
    layer's all-reduces), plus eh_proj. EAGLE: its layers' weights and KV, its own LM head
    (draft vocabulary) or the target's, and 2 all-reduces per layer under TP."""
    d = pt.drafter
    w = pt.draft_topk
    fwd = Forward(Stage.DRAFT, w, pt.context_tokens)
    if d.layer_shape is not None:
        comps = target_forward(d.layer_shape, pt, params, fwd)
        C, tp = pt.requests_per_gpu, pt.weight_shards
        comps.append(_device(
            "MTP eh_proj", Stage.DRAFT, pt, params,
            d.projection_params * PRECISION_BYTES[d.precision] / tp,
            2.0 * C * w * d.projection_params / tp, COMPUTE_PRECISION[d.precision], 1,
            "2h x h projection of [embedding; hidden] x bytes/param / TP",
        ))  # fmt: skip
        return comps
    C, tp = pt.requests_per_gpu, pt.weight_shards
    vocab = d.lm_head_vocab or model.vocab_size
    head = vocab * model.hidden_size
    head_bpp = PRECISION_BYTES[d.precision] if d.lm_head_vocab else model.bytes_per_param("lm_head")
    nbytes = (d.params * PRECISION_BYTES[d.precision] + head * head_bpp) / tp
    nbytes = nbytes + C * pt.context_tokens * d.kv_bytes_per_token / tp
    flops = 2.0 * C * w * (d.params + head) / tp
    comps = [_device(
        "drafter step", Stage.DRAFT, pt, params, nbytes, flops, COMPUTE_PRECISION[d.precision],
        d.layers * KERNELS["drafter_layer"] + KERNELS["lm_head"],
        "(drafter params + its LM head (draft vocabulary, or the target's)) x bytes/param / TP "
        "+ C x context x drafter KV bytes/token / TP",
    )]  # fmt: skip
    if tp > 1:
        ar_bytes = w * pt.concurrency * model.hidden_size * 2.0
        per = _link_s(pt, params, *allreduce_bytes(pt, ar_bytes))
        comps.append(Component(
            "drafter all-reduce", Stage.DRAFT, 2 * d.layers * per, 0.0, 0.0, 0.0, Bound.LINK,
            _link_rule(pt), f"2 x {d.layers} layers x (latency + w x C x hidden x 2 B / link bw)",
        ))  # fmt: skip
    return comps


def stepped_draft(model: ModelShape, pt: Point, params: dict) -> list[Component | None]:
    """EAGLE / MTP drafting (``Drafting.STEPS``, ``Drafting.MTP``): k = B - 1 draft steps in
    sequence, each a pass of the drafter over the tokens it keeps and a top-k over their
    (draft-vocabulary) logits; then the tree of N nodes and its verify layout."""
    k = pt.block_size - 1
    d = pt.drafter
    vocab = d.lm_head_vocab or model.vocab_size
    per_step_topk = _stream(
        "top-k over w x V", Stage.TOPK, pt, params,
        pt.requests_per_gpu * pt.draft_topk * vocab * 4.0 * 3, KERNELS["topk"],
        "C x topk x draft vocab x 4 B x 3 (log-softmax read + write, top-k read) / HBM bw",
    )  # fmt: skip
    glue = spec_overhead(pt, params, "draft_step_overhead", Stage.DRAFT)
    one = [*draft_step_pass(model, pt, params), per_step_topk, *([glue] if glue else [])]
    steps = _repeated(one, k, f"{k} draft steps")
    return [*steps, tree_build(pt, params), verify_layout(pt, params)]


def lookup_draft(model: ModelShape, pt: Point, params: dict) -> list[Component | None]:
    """n-gram / prompt-lookup drafting (``Drafting.LOOKUP``): a search of the context on the
    host for the last n-gram's earlier match, no drafter forward; then the verify layout."""
    lookup = _host(
        "n-gram lookup", Stage.DRAFT, pt,
        pt.requests_per_gpu * params["ngram_lookup"] / host_speed(params, pt.host_cpu),
        "C x lookup per step (host search of the context)",
    )  # fmt: skip
    return [lookup, verify_layout(pt, params)]


DRAFTING_COST: dict[Drafting, Callable[..., list[Component | None]]] = {
    Drafting.BLOCK: block_draft,
    Drafting.STEPS: stepped_draft,
    Drafting.MTP: stepped_draft,
    Drafting.LOOKUP: lookup_draft,
    # Medusa heads: one pass over the heads' weights (their own vocabulary projections
    # included, ``shares_target_lm_head`` False), then top-k, tree and layout as a block drafter
    Drafting.HEADS: block_draft,
}
"""A policy's ``drafting`` -> the components its drafting adds to a step."""


def step_cost(model: ModelShape, pt: Point, params: dict, tau=None) -> StepCost:
    """Cost one step. ``params`` maps every name in ``default_params()`` to a value (or array).

    ``tau`` only enters the KV commit (bytes moved per accepted token); it may be None (0).
    A step without a drafter (``ar``) is the target forward at M = 1 and the framework overhead;
    with one, the policy's drafting (``DRAFTING_COST``), then acceptance and the KV commit.
    """
    _check(pt)
    verify = Forward(Stage.VERIFY, pt.verify_width, pt.context_tokens)
    comps = target_forward(model, pt, params, verify)
    if pt.policy.needs_drafter:
        comps += [
            c
            for c in (
                *DRAFTING_COST[pt.policy.drafting](model, pt, params),
                accept(model, pt, params),
                accept_walk(pt, params),
                kv_commit(model, pt, params, tau),
                commit_glue(pt, params),
                spec_overhead(pt, params, "spec_step_overhead", Stage.OTHER),
                _control(pt, params, Stage.COMMIT, "TP control broadcasts (commit)"),
            )
            if c is not None
        ]
    return _total(pt, params, [*comps, framework_overhead(pt, params)])


def prefill_cost(model: ModelShape, pt: Point, params: dict, prompt_tokens: float) -> StepCost:
    """The target forward over a prompt of ``prompt_tokens`` per request (no cached context)."""
    _check(pt)
    fwd = Forward(Stage.PREFILL, prompt_tokens, 0)
    return _total(pt, params, target_forward(model, pt, params, fwd))


def tokens_per_s(cost: StepCost, tau):
    """Aggregate decode tokens/s: C x tau / step_s."""
    return cost.point.concurrency * np.asarray(tau, dtype=float) / cost.step_s


def params_at(specs: dict[str, ParamSpec], overrides: dict | None = None) -> dict:
    out = {k: s.default for k, s in specs.items()}
    out.update(overrides or {})
    return out


LIMITS = {
    "memory": "HBM bandwidth",
    "compute": "FLOP/s",
    "link": "interconnect",
    "host": "host CPU",
    "launch": "kernel launches",
}
"""What a share of the step is bound by: a device component's bytes or FLOPs (its kernel
launches counted apart), a link component, host work, every kernel's launch."""
OVERHEADS = ("host", "launch", "link")  # time that faster memory does not shrink
_SHORT = {
    "memory": "HBM",
    "compute": "FLOP/s",
    "link": "link",
    "host": "host",
    "launch": "launches",
}


@dataclass
class Amdahl:
    limit_step_s: float
    limit_tokens_per_s: float
    fraction_of_limit: float
    overhead_fraction: float  # host + launches + link latency over step
    statement: str
    shares: dict[str, float]  # LIMITS key -> its share of the step (they add up to 1)

    @property
    def binds(self) -> str:
        """The limit that binds, in a few words: the overheads when they are most of the step
        (with their two largest parts), else the device limit with the largest share."""
        if self.overhead_fraction > 0.5:
            top = sorted(OVERHEADS, key=lambda k: -self.shares[k])[:2]
            parts = ", ".join(f"{_SHORT[k]} {self.shares[k]:.0%}" for k in top)
            return f"overheads {self.overhead_fraction:.0%} ({parts})"
        device = max(("memory", "compute"), key=lambda k: self.shares[k])
        return f"{_SHORT[device]} {self.shares[device]:.0%}"


def amdahl(cost: StepCost, params: dict, tau: float) -> Amdahl:
    """Physical limit (bytes per GPU / peak HBM bw), how much of the step is overhead, and
    the step's shares by what bounds them (``LIMITS``)."""
    step = float(np.median(np.asarray(cost.step_s)))
    seconds = dict.fromkeys(LIMITS, 0.0)
    for c in cost.components:
        if c.name.startswith(EXPOSED_DISPATCH):  # launches the device work did not hide
            seconds["launch"] += c.seconds
            continue
        launch = launch_seconds(cost.point, params, c.launches)
        seconds[str(c.bound)] += c.seconds - launch
        seconds["launch"] += launch
    shares = {k: float(np.median(np.asarray(s))) / step for k, s in seconds.items()}
    frac = sum(shares[k] for k in OVERHEADS)
    C = cost.point.concurrency
    limit_tps = C * tau / cost.limit_step_s
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
    return Amdahl(cost.limit_step_s, limit_tps, (C * tau / step) / limit_tps, frac, say, shares)
