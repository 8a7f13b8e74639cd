"""Count the kernels of one decode step of ddtree's eager MLA+MoE engine with torch.profiler.

The estimator's launch overhead is kernels x time per launch; the kernel counts per layer
(``ddtree/perf/data/kernels.toml``) come from here, not from a guess. On the CPU every aten
op that does work is at least one kernel launch on CUDA in eager mode, so we count the leaf
aten ops (those that call no other aten op) of each part of a step, leaving out ops that
only make views or allocate (no kernel):

- a transformers Qwen3 decoder layer (GQA attention, sdpa) apart from its MLP, for dense
  and GQA targets;
- the target forward over a verify tree, split by module: attention (with the layer's two
  RMSNorms and residual adds), the router and expert dispatch outside the expert loop
  (``routed_moe``), each touched expert (``routed_moe_per_expert``: our MoE loops over the
  touched experts; GPU serving engines run a fused MoE kernel instead), shared experts, the
  dense MLP, and the final norm + LM head;
- one DFlash drafter layer (over the block and 3 newly committed context tokens), the top-k
  over the drafter's logits, the greedy acceptance (argmax + walk) and the KV commit per
  target layer.

Regenerate the data file: ``python -m ddtree.bench.kernels --out src/ddtree/perf/data/kernels.toml``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from ddtree.tree import backend as tree_backend

# aten ops that make views, allocate or read metadata: no kernel
NO_KERNEL = frozenset(
    "aten::" + n
    for n in (
        "view as_strided reshape _reshape_alias _unsafe_view transpose t permute expand "
        "unsqueeze squeeze slice select split split_with_sizes chunk narrow detach alias "
        "empty empty_like empty_strided resize_ lift_fresh item _local_scalar_dense "
        "is_nonzero size stride numel dim contiguous unbind resolve_conj resolve_neg conj "
        "_conj to result_type broadcast_tensors expand_as view_as unsafe_split lift numpy_T "
        "mT mH adjoint"
    ).split()
)
LABEL = "ddtree.kernels:"


def leaf_ops(prof) -> list:
    """The profiler's aten events that launch work: not views or allocations, and no child op
    that does the work instead."""
    out = []
    for ev in prof.events():
        if not ev.name.startswith("aten::") or ev.name in NO_KERNEL:
            continue
        if any(c.name.startswith("aten::") and c.name not in NO_KERNEL for c in ev.cpu_children):
            continue  # the work is in a child op
        out.append(ev)
    return out


def _label_of(ev) -> str | None:
    parent = ev.cpu_parent
    while parent is not None:
        if parent.name.startswith(LABEL):
            return parent.name[len(LABEL) :]
        parent = parent.cpu_parent
    return None


def count_ops(fn: Callable[[], object]) -> int:
    """Leaf aten ops that launch work in one call of ``fn``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return len(leaf_ops(prof))


def count_by_module(fn: Callable[[], object], modules: dict[str, list[nn.Module]]) -> Counter:
    """Leaf ops of one ``fn()`` by the innermost labelled module they ran in ("" for none)."""
    handles, stack = [], []

    def enter(name):
        def hook(module, args):
            ctx = record_function(LABEL + name)
            ctx.__enter__()
            stack.append(ctx)

        return hook

    def leave(module, args, output):
        stack.pop().__exit__(None, None, None)

    for name, mods in modules.items():
        for m in mods:
            handles.append(m.register_forward_pre_hook(enter(name)))
            handles.append(m.register_forward_hook(leave))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        for h in handles:
            h.remove()
    return Counter(_label_of(ev) or "" for ev in leaf_ops(prof))


@torch.inference_mode()
def count_gqa_layer(m: int = 9, context: int = 53) -> float:
    """Kernels per decoder layer of a transformers Qwen3 (GQA) model (sdpa attention, the
    ddtree HF wrapper's default) over ``m`` new tokens after ``context`` cached ones, apart
    from its MLP: attention with the layer's norms and residual adds."""
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).eval()
    cache = DynamicCache(config=cfg)
    # transformers 5.24 renamed the cache keyword (5.15 knows only past_key_values=)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model(torch.arange(context)[None], use_cache=True, **{key: cache})
    ids = torch.arange(m)[None] + 7
    positions = torch.arange(context, context + m)[None]
    layers = list(model.model.layers)
    by = count_by_module(
        lambda: model(ids, position_ids=positions, use_cache=True, **{key: cache}),
        {"layer": layers, "mlp": [lay.mlp for lay in layers]},
    )
    return by["layer"] / len(layers)


@dataclass
class KernelCounts:
    attention: float
    attention_gqa: float
    routed_moe: float
    routed_moe_per_expert: float
    shared_experts: float
    dense_mlp: float
    lm_head: float
    drafter_layer: float
    topk: float
    accept: float
    commit_per_layer: float
    verify_width: int
    context_tokens: int
    experts_touched_per_layer: float


def _expert_loop(experts: nn.Module, hidden: int, top_k: int) -> tuple[float, float]:
    """(ops outside the loop, ops per touched expert) of the routed experts' forward, from
    inputs routed to exactly one and exactly two experts."""
    x = torch.randn(4, hidden, dtype=experts.gate_up_proj.dtype)
    w = torch.full((4, top_k), 1.0 / top_k)

    def ops(n_experts: int) -> int:
        ids = torch.arange(4 * top_k).reshape(4, top_k) % n_experts  # [4, k]
        return count_ops(lambda: experts(x, w, ids))

    one, two = ops(1), ops(2)
    return float(one - (two - one)), float(two - one)


@torch.inference_mode()
def count_kernels(target_dir: Path, drafter_dir: Path, prompt: list[int], budget: int = 8):
    """Counts over one verify at budget ``budget`` after prefilling ``prompt``."""
    from ddtree import tree as tree_core
    from ddtree.models import load_drafter, load_target
    from ddtree.models.nn.layers import GatedMLP
    from ddtree.models.nn.mla_moe import Attention, MoE

    torch.manual_seed(0)
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target)
    model, cfg = target.model, target.config
    target.set_capture_layers(list(drafter.target_layer_ids))
    out = target.prefill(torch.tensor(prompt))
    root = int(out.logits[-1].argmax())
    logits = drafter.propose(out.hidden, root)  # [B-1, V]
    top = tree_core.topk_logprobs(logits, budget)
    tree = tree_core.build_tree(root, top.logprobs, top.tokens, budget)
    layout = target.layout(tree)
    layers = list(model.model.layers)
    moe = [lay.mlp for lay in layers if isinstance(lay.mlp, MoE)]
    dense = [lay.mlp for lay in layers if isinstance(lay.mlp, GatedMLP)]
    parts = {
        "layer": layers,
        "attention": [m for m in model.modules() if isinstance(m, Attention)],
        "moe": moe,
        "router": [m.gate for m in moe],
        "experts": [m.experts for m in moe],
        "shared": [m.shared_experts for m in moe],
        "dense": dense,
        "lm_head": [model.model.norm, model.lm_head],
    }
    touched = [
        float(m.gate(torch.randn(tree.tokens.numel(), cfg.hidden_size)).__getitem__(1).unique()
              .numel()) for m in moe
    ]  # fmt: skip
    by = count_by_module(lambda: target.verify(tree, layout), parts)
    fixed, per_expert = _expert_loop(moe[0].experts, cfg.hidden_size, cfg.num_experts_per_tok)
    n_moe, n_dense, n = len(moe), len(dense), len(layers)
    # the layer's own ops (norms, residual adds) go with the attention
    attention = (by["attention"] + by["layer"]) / n
    routed = (by["router"] + by["moe"]) / n_moe + fixed
    verify_logits = target.model.lm_head(torch.randn(tree.tokens.numel(), cfg.hidden_size))
    accept = count_ops(lambda: tree_core.accept_greedy(tree, verify_logits.argmax(dim=-1)))
    accepted = tree_core.accept_greedy(tree, verify_logits.argmax(dim=-1)).accepted
    commit = count_ops(lambda: target.commit(accepted)) / n
    # a step's draft also projects the context of the tokens the last step committed (3 here);
    # everything but the shared LM head goes to the drafter's layers
    new_context = out.hidden[-3:]
    d_by = count_by_module(lambda: drafter.propose(new_context, root), {"head": [drafter.lm_head]})
    n_drafter = len(drafter.model.layers)
    return KernelCounts(
        attention=attention,
        attention_gqa=count_gqa_layer(int(tree.tokens.numel()), len(prompt)),
        routed_moe=routed,
        routed_moe_per_expert=per_expert,
        shared_experts=by["shared"] / n_moe,
        dense_mlp=by["dense"] / max(n_dense, 1),
        lm_head=float(by["lm_head"]),
        drafter_layer=(d_by.total() - d_by["head"]) / n_drafter,
        topk=float(count_ops(lambda: tree_core.topk_logprobs(logits, budget))),
        accept=float(accept),
        commit_per_layer=commit,
        verify_width=int(tree.tokens.numel()),
        context_tokens=len(prompt),
        experts_touched_per_layer=sum(touched) / len(touched),
    )


def to_toml(counts: KernelCounts, about: str) -> str:
    c = counts
    rows = {
        "attention": (c.attention, "MLA attention + the layer's 2 RMSNorms and residual adds"),
        "attention_gqa": (
            c.attention_gqa,
            "GQA attention (transformers Qwen3, sdpa) + the layer's norms and residual adds",
        ),
        "routed_moe": (
            c.routed_moe,
            "router, expert sort/dispatch and combine (outside the expert loop)",
        ),  # fmt: skip
        "routed_moe_per_expert": (
            c.routed_moe_per_expert,
            "per touched expert in ddtree's looped MoE (a fused MoE kernel on GPUs has none)",
        ),  # fmt: skip
        "shared_experts": (c.shared_experts, "shared-expert MLP"),
        "dense_mlp": (c.dense_mlp, "dense MLP of the first_k_dense layers"),
        "lm_head": (c.lm_head, "final norm + LM head (per forward)"),
        "drafter_layer": (
            c.drafter_layer,
            "per DFlash drafter layer: the block and the new "
            "context tokens, with the drafter's glue (its LM head is lm_head)",
        ),
        "topk": (c.topk, "log-softmax + top-k over the drafter logits (per step)"),
        "accept": (c.accept, "greedy acceptance: argmax over the verify logits + walk (per step)"),
        "commit_per_layer": (c.commit_per_layer, "KV commit, per target layer"),
    }
    lines = [
        "# Kernels per layer / per step of ddtree's eager engine, counted with torch.profiler on",
        "# the CPU: leaf aten ops that do work (views and allocations left out). In eager mode on",
        "# CUDA each is at least one kernel launch. Regenerate (do not edit by hand):",
        "#   python -m ddtree.bench.kernels --out src/ddtree/perf/data/kernels.toml",
        "[measured]",
        f'how = "{about}"',
        f'torch = "{torch.__version__}"',
        f'tree_backend = "{tree_backend()}"  # the accept walk: 1 op in C++, several in Python',
        f"verify_width = {c.verify_width}",
        f"context_tokens = {c.context_tokens}",
        f"experts_touched_per_layer = {c.experts_touched_per_layer:.2f}",
        "",
        "[kernels]",
    ]
    for key, (value, about_row) in rows.items():
        lines.append(f"{key} = {value:g}  # {about_row}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from ddtree.train.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the TOML here (default: print it)")
    p.add_argument("--budget", type=int, default=8, help="verify budget N (default 8: M = 9)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    demo = Path(str(files("ddtree") / "assets" / "demo"))
    text = json.loads((demo / "prompts.json").read_text(encoding="utf-8"))[0]
    prompt = load_tokenizer(demo / "target").encode(text).ids[:64]
    with contextlib.redirect_stdout(None):
        counts = count_kernels(demo / "target", demo / "drafter", prompt, args.budget)
    text = to_toml(
        counts,
        f"bundled demo pair (MLA+MoE target, DFlash drafter), float32, CPU, one verify at "
        f"budget {args.budget} after a {len(prompt)}-token prompt",
    )
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
