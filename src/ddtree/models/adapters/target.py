"""The ``Target`` protocol over any of our cached causal LMs (the MLA+MoE model, the Qwen3 /
Llama decoder): one adapter owns the engine modes, the verify inputs, prefill, commit and the
non-finite check, so each model is only its modules and its cache.

The one forward (gpt-fast's compile boundary): :func:`forward_tree` runs M new rows (a tree, or
a causal prompt chunk) after ``S`` committed ones. Eager mode calls it at exact shapes (prefix
``P = S``, tail = the M rows); compiled mode calls ``torch.compile(forward_tree)`` at static
shapes (``M`` padded to a width bucket, ``P`` rounded down to a multiple of ``chunk``, a tail of
``chunk + Mb`` keys). The models never know which mode they run in.

A model (:class:`CausalLM`) is ``forward(input_ids [M], position_ids [M], attn, caches,
capture_layers) -> TargetOutput``: it writes its M new rows' cache entries at
``attn.write_slots`` (provisionally: the adapter owns the committed length) and attends as
:mod:`ddtree.models.nn.attention` describes. A cache is a few preallocated tensors grown
geometrically (``ensure``), compacted after acceptance (``compact``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ddtree.models.base import ModelInfo, TargetOutput
from ddtree.models.nn.attention import AttentionInputs
from ddtree.models.nn.causal_lm import CausalLM, ModelCache
from ddtree.models.nn.layers import (
    check_capture_layers,
    check_commit,
    check_positions,
    check_target_logits,
)
from ddtree.models.static import (
    ENGINE_MODES,
    KV_CHUNK,
    CompiledForward,
    EngineModeError,
    EnginePlan,
    KeyPositions,
    StaticLayout,
    StaticTree,
    cache_input,
    pick_bucket,
)
from ddtree.tree.layout import compaction_indices
from ddtree.tree.types import DraftTree


def forward_tree(
    model: CausalLM,
    tokens: torch.Tensor,  # [M] int64
    depth: torch.Tensor,  # [M] int64: position = S + depth
    start: torch.Tensor,  # [] int64: committed rows S
    visibility: torch.Tensor,  # [M, M] bool: ancestor-or-self (a prompt chunk: lower triangle)
    prefix_keys: torch.Tensor,  # [P] int64: its length is P (the dynamic dim when compiled)
    caches: tuple[torch.Tensor, ...],
    capture_layers: tuple[int, ...],
    tail_len: int,  # T: keys P .. P+T-1 attended under the mask
    layers=None,  # compile scope "layer": the compiled decoder layers
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of both engine modes (see the module docstring): (logits [M, V], hidden
    [M, F] or None)."""
    dtype = caches[0].dtype
    attn = AttentionInputs.build(start, visibility, prefix_keys, tail_len, dtype)
    out = model(tokens, start + depth, attn, caches, capture_layers, layers)
    return out.logits, out.hidden


@dataclass
class TreeInputs:
    """An eager verify's inputs: the tree on the target's device (nothing else to lay out: the
    [M, T] tail mask is built inside the forward)."""

    tokens: torch.Tensor  # [M] int64
    depth: torch.Tensor  # [M] int64
    visibility: torch.Tensor  # [M, M] bool


class CachedTarget:
    """The ``Target`` protocol (batch of one request) over a :class:`CausalLM` and its cache.

    ``chunk`` (compiled mode): the prefix granularity; a graph's prefix length changes once
    per ``chunk`` committed tokens (on CUDA: one graph recording each time).
    """

    engine_modes = ENGINE_MODES
    plain_linears: tuple[str, ...] = ()  # linear layers a faster kernel must leave as they are

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def __init__(
        self,
        model: CausalLM,
        cache: ModelCache,
        info: ModelInfo,
        check_finite: bool = True,
        chunk: int = KV_CHUNK,
    ) -> None:
        self.model = model.eval()
        self.config = getattr(model, "config", None)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.cache = cache
        self.info = info
        self.check_finite = check_finite
        self.chunk = chunk
        self.capture_layers: tuple[int, ...] = ()
        self._pending = 0  # M of the last verify, awaiting commit
        self.engine = EnginePlan()
        self._runner: EagerRunner | CompiledRunner = EagerRunner(self)
        self._graphs: CompiledRunner | None = None  # kept across plans: its graphs compile once
        # what both runners' forwards read: S as a tensor, key positions 0..n-1
        self.start_t = torch.zeros((), dtype=torch.int64, device=self.device)  # [] int64
        self.key_positions = KeyPositions(chunk, self.device)

    # --- protocol -------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.cache.length

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.model.embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    def set_capture_layers(self, layer_ids: list[int]) -> None:
        """The hidden states the next forwards return (the engine passes them in its plan
        instead). In compiled mode the current plan is compiled for them too, so this may come
        before or after :meth:`set_engine_mode`."""
        layers = check_capture_layers(layer_ids, self.info.num_layers)
        if layers != self.capture_layers and self._runner is self._graphs:
            self.set_engine_mode(dataclasses.replace(self.engine, capture_layers=layers))
        self.capture_layers = layers

    def reset(self) -> None:
        self.cache.length = 0
        self._pending = 0

    @torch.inference_mode()
    def set_engine_mode(self, plan: EnginePlan) -> float:
        """Run the next requests eagerly or compiled (``ddtree.models.static``): picks the
        runner of ``plan.mode`` once, so no forward tests the mode. The plan's capture layers
        (None: those of :meth:`set_capture_layers`) are part of what compiles. Compiled mode
        compiles (warms up) each width bucket not compiled yet for them, with and without a
        prefix (a request starts with none), and reserves the cache for ``plan.max_len``;
        returns the seconds that took (0 when nothing new compiled). Resets the cache."""
        if plan.capture_layers is not None:
            self.capture_layers = check_capture_layers(plan.capture_layers, self.info.num_layers)
        self.engine = plan
        self.reset()
        if plan.mode == "eager":
            self._runner = EagerRunner(self)
            return 0.0
        if self._graphs is None:
            self._graphs = CompiledRunner(self, plan.compile_scope)
        self._runner = self._graphs
        compile_s = self._graphs.plan(plan, self.capture_layers)
        self.reset()
        return compile_s

    @torch.inference_mode()
    def layout(self, tree: DraftTree) -> TreeInputs | StaticLayout:
        """What :meth:`verify` takes for ``tree`` (the engine times it as the layout stage):
        eager, the tree on this device; compiled, the tree copied into its width bucket's
        preallocated inputs."""
        return self._runner.layout(tree)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        """Append T prompt tokens (all committed). Compiled mode runs them through the widest
        bucket's graph in causal chunks (each chunk a chain tree, committed whole)."""
        assert input_ids.dim() == 1, input_ids.shape  # [T] int64
        t, start = int(input_ids.shape[0]), self.seq_len
        check_positions(self.info, start + t, f"prompt of {t} tokens after {start} cached")
        self._pending = 0
        return self._runner.prefill(input_ids.to(self.device))

    @torch.inference_mode()
    def verify(self, tree: DraftTree, layout: TreeInputs | StaticLayout | None = None):
        m, start = tree.n_nodes, self.seq_len
        depth = int(tree.depth.max())
        check_positions(self.info, start + depth + 1, f"tree of depth {depth}")
        if layout is None:
            layout = self.layout(tree)
        out = self._runner.verify(layout)
        self._pending = m
        return out

    @torch.inference_mode()
    def commit(self, accepted: torch.Tensor) -> None:
        check_commit(accepted, self._pending)
        plan = compaction_indices(accepted.to(self.device), self.seq_len)
        self.cache.compact(plan.src, plan.dst, plan.new_len)
        self._pending = 0

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def new_cache(self, capacity: int) -> ModelCache:
        """An empty cache of this model with ``capacity`` slots, beside its own (the batched
        engine's: one region of slots per request, ``ddtree.models.adapters.rows``)."""
        return type(self.cache)(self.model.config, capacity, self.dtype, self.device)

    # --- internals ------------------------------------------------------------------------
    def checked_rows(self, logits, hidden, positions) -> TargetOutput:
        if self.check_finite:
            check_target_logits(self.info.name, logits, positions)
        return TargetOutput(logits=logits, hidden=hidden)


class EagerRunner:
    """Eager mode of a :class:`CachedTarget`: :func:`forward_tree` at the exact shapes of each
    forward (prefix = the S committed rows, tail = the M new ones)."""

    def __init__(self, target: CachedTarget) -> None:
        self.target = target

    def layout(self, tree: DraftTree) -> TreeInputs:
        to = self.target.device
        return TreeInputs(tree.tokens.to(to), tree.depth.to(to), tree.visibility.to(to))

    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        t, device = int(input_ids.shape[0]), input_ids.device
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        out = self._forward(TreeInputs(input_ids, torch.arange(t, device=device), causal))
        self.target.cache.length += t
        return out

    def verify(self, layout: TreeInputs) -> TargetOutput:
        if not isinstance(layout, TreeInputs):
            raise TypeError("eager mode: pass target.layout(tree) (TreeInputs)")
        return self._forward(layout)

    def _forward(self, inputs: TreeInputs) -> TargetOutput:
        t = self.target
        m, start = int(inputs.tokens.shape[0]), t.seq_len
        t.cache.ensure(start + m)
        t.start_t.fill_(start)
        logits, hidden = forward_tree(
            t.model,
            inputs.tokens,
            inputs.depth,
            t.start_t,
            inputs.visibility,
            t.key_positions(start),
            t.cache.tensors(),
            t.capture_layers,
            m,
        )
        return t.checked_rows(logits, hidden, start + inputs.depth)


class CompiledRunner:
    """Compiled mode of a :class:`CachedTarget`: ``torch.compile(forward_tree)`` at static
    shapes, one graph per (width bucket, capture layers), each compiled by :meth:`plan` and
    only replayed afterwards. Kept by the target across plans, so a graph compiles once."""

    def __init__(self, target: CachedTarget, scope: str) -> None:
        self.target = target
        self.scope = scope
        self.forward = CompiledForward(
            forward_tree, target.device, scope, target.model.model.layers
        )
        self.plan_: EnginePlan = EnginePlan()
        self.capture_layers: tuple[int, ...] = ()
        self.static: dict[int, StaticTree] = {}  # width bucket -> its preallocated inputs
        self.warm: set[tuple[int, tuple[int, ...]]] = set()  # (width, capture layers) compiled

    def plan(self, plan: EnginePlan, capture_layers: tuple[int, ...]) -> float:
        """Compile what ``plan`` runs with ``capture_layers`` and is not compiled yet; returns
        the seconds that took."""
        t = self.target
        if plan.compile_scope != self.scope:
            raise EngineModeError(
                f"{t.info.name} was compiled with compile_scope {self.scope!r}; "
                f"it cannot switch to {plan.compile_scope!r} (load it again)"
            )
        self.plan_, self.capture_layers = plan, capture_layers
        t.cache.ensure(plan.max_len + t.chunk + plan.widths[-1])
        compile_s = 0.0
        for width in plan.widths:
            static = self.static.setdefault(width, StaticTree(width, t.device))
            if (width, capture_layers) in self.warm:
                continue
            t.cache.ensure(2 * t.chunk + width)
            for start in (0, t.chunk):  # the graph without a prefix, and with one
                compile_s += self.forward.warm_up(lambda s=static, p=start: self._run(s, p))
            self.warm.add((width, capture_layers))
        return compile_s

    def layout(self, tree: DraftTree) -> StaticLayout:
        static = self.static[pick_bucket(tree.n_nodes, self.plan_.widths)]
        return StaticLayout(static, static.fill(tree.tokens, tree.depth, tree.visibility))

    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        t, device = self.target, input_ids.device
        static = self.static[self.plan_.widths[-1]]
        outs = []
        for chunk in input_ids.split(static.width):
            c = int(chunk.shape[0])
            chain = torch.ones(c, c, dtype=torch.bool, device=device).tril()
            static.fill(chunk, torch.arange(c, device=device), chain)
            out = self._checked(*self._run(static, t.seq_len), static, c)
            # copied: the next chunk replays the same graph (under CUDA graphs, into the same
            # output memory)
            hidden = None if out.hidden is None else out.hidden.clone()
            outs.append(TargetOutput(logits=out.logits.clone(), hidden=hidden))
            t.cache.length += c
        hidden = None if outs[0].hidden is None else torch.cat([o.hidden for o in outs])
        return TargetOutput(logits=torch.cat([o.logits for o in outs]), hidden=hidden)

    def verify(self, layout: StaticLayout) -> TargetOutput:
        if not isinstance(layout, StaticLayout):
            raise TypeError("compiled mode: pass target.layout(tree) (a StaticLayout)")
        out = self._run(layout.static, self.target.seq_len)
        return self._checked(*out, layout.static, layout.rows)

    def _run(self, static: StaticTree, start: int):
        """The compiled forward of one width bucket after ``start`` committed rows: prefix of
        ``P = start`` rounded down to ``chunk`` (0: the graph without a prefix), tail of
        ``chunk + Mb`` keys. Returns (logits [Mb, V], hidden)."""
        t = self.target
        prefix = start // t.chunk * t.chunk
        tail = t.chunk + static.width
        t.cache.ensure(prefix + tail)
        caches = tuple(cache_input(c, t.cache.capacity_dim) for c in t.cache.tensors())
        t.start_t.fill_(start)
        keys = t.key_positions(prefix)
        if prefix:
            torch._dynamo.maybe_mark_dynamic(keys, 0)
        return self.forward(
            t.model,
            static.tokens,
            static.depth,
            t.start_t,
            static.visibility,
            keys,
            caches,
            self.capture_layers,
            tail,
        )

    def _checked(self, logits, hidden, static: StaticTree, rows: int) -> TargetOutput:
        """The first ``rows`` outputs of a compiled forward (the padded rows are dropped)."""
        hidden = None if hidden is None else hidden[:rows]
        positions = self.target.seq_len + static.depth[:rows]
        return self.target.checked_rows(logits[:rows], hidden, positions)
