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
:mod:`ddtree.models.attention` describes. A cache is a few preallocated tensors grown
geometrically (``ensure``), compacted after acceptance (``compact``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ddtree.models.attention import AttentionInputs
from ddtree.models.base import ModelInfo, TargetOutput
from ddtree.models.layers import (
    check_capture_layers,
    check_commit,
    check_finite,
    check_positions,
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


class ModelCache(Protocol):
    """Preallocated per-layer cache tensors of one request."""

    length: int  # committed rows
    capacity_dim: int  # the dimension that grows

    def tensors(self) -> tuple[torch.Tensor, ...]: ...
    def ensure(self, needed: int) -> None: ...
    def compact(self, src: torch.Tensor, dst: torch.Tensor, new_len: int) -> None: ...


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head (``model.embed_tokens``,
    ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``: transformers' names).
    A layer is ``layer(x [M, H], rope, attn, layer_caches) -> [M, H]``, given what
    :meth:`layer_caches` picks from the cache tensors for it. ``lm_head`` None (a
    tensor-parallel rank without the head): [M, 0] logits."""

    model: nn.Module
    lm_head: nn.Module | None

    def layer_caches(self, caches: tuple[torch.Tensor, ...], layer: int) -> tuple:
        """The cache tensors decoder layer ``layer`` reads and writes (default: all of them)."""
        return caches

    def forward(
        self,
        input_ids: torch.Tensor,  # [M] int64
        position_ids: torch.Tensor,  # [M] int64
        attn: AttentionInputs,
        caches: tuple[torch.Tensor, ...],
        capture_layers: tuple[int, ...] = (),
        layers=None,  # the decoder layers to call (default ``model.layers``; compiled copies)
    ) -> TargetOutput:
        m = input_ids.shape[0]
        assert input_ids.dim() == 1 and position_ids.shape == (m,), (
            input_ids.shape,
            position_ids.shape,
        )
        x = self.model.embed_tokens(input_ids)  # [M, H]
        rope = self.model.rotary_emb.tables(position_ids, x.dtype)
        captured = {0: x} if 0 in capture_layers else {}
        for i, layer in enumerate(self.model.layers if layers is None else layers):
            x = layer(x, rope, attn, self.layer_caches(caches, i))
            if i + 1 in capture_layers:
                captured[i + 1] = x
        x = self.model.norm(x)
        n = len(self.model.layers)
        if n in capture_layers:  # transformers' last hidden_states entry is after the final norm
            captured[n] = x
        logits = self.lm_head(x) if self.lm_head is not None else x[:, :0]
        hidden = torch.cat([captured[i] for i in capture_layers], -1) if capture_layers else None
        return TargetOutput(logits=logits, hidden=hidden)


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
        self._compiled: CompiledForward | None = None
        self._static: dict[int, StaticTree] = {}  # width bucket -> its preallocated inputs
        self._warm: set[tuple[int, tuple[int, ...]]] = set()  # (width, capture layers) compiled
        self._start = torch.zeros((), dtype=torch.int64, device=self.device)
        self._keys = KeyPositions(chunk, self.device)

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
        self.capture_layers = check_capture_layers(layer_ids, self.info.num_layers)

    def reset(self) -> None:
        self.cache.length = 0
        self._pending = 0

    @torch.inference_mode()
    def set_engine_mode(self, plan: EnginePlan) -> float:
        """Run the next requests eagerly or compiled (``ddtree.models.static``). Compiled mode
        compiles (warms up) each width bucket not compiled yet for the current capture layers,
        with and without a prefix (a request starts with none), and reserves the cache for
        ``plan.max_len``; returns the seconds that took (0 when nothing new compiled). Resets
        the cache."""
        self.engine = plan
        self.reset()
        if plan.mode == "eager":
            return 0.0
        if self._compiled is None:
            self._compiled = CompiledForward(
                forward_tree, self.device, plan.compile_scope, self.model.model.layers
            )
        elif self._compiled.scope != plan.compile_scope:
            raise EngineModeError(
                f"{self.info.name} was compiled with compile_scope {self._compiled.scope!r}; "
                f"it cannot switch to {plan.compile_scope!r} (load it again)"
            )
        self.cache.ensure(plan.max_len + self.chunk + plan.widths[-1])
        compile_s = 0.0
        for width in plan.widths:
            static = self._static.setdefault(width, StaticTree(width, self.device))
            if (width, self.capture_layers) in self._warm:
                continue
            self.cache.ensure(2 * self.chunk + width)
            for start in (0, self.chunk):  # the graph without a prefix, and with one
                compile_s += self._compiled.warm_up(lambda s=static, t=start: self._run(s, t))
            self._warm.add((width, self.capture_layers))
        self.reset()
        return compile_s

    @torch.inference_mode()
    def layout(self, tree: DraftTree) -> TreeInputs | StaticLayout:
        """What :meth:`verify` takes for ``tree`` (the engine times it as the layout stage):
        eager, the tree on this device; compiled, the tree copied into its width bucket's
        preallocated inputs."""
        if self.engine.mode == "compiled":
            static = self._static[pick_bucket(tree.n_nodes, self.engine.widths)]
            return StaticLayout(static, static.fill(tree.tokens, tree.depth, tree.visibility))
        to = self.device
        return TreeInputs(tree.tokens.to(to), tree.depth.to(to), tree.visibility.to(to))

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        """Append T prompt tokens (all committed). Compiled mode runs them through the widest
        bucket's graph in causal chunks (each chunk a chain tree, committed whole)."""
        assert input_ids.dim() == 1, input_ids.shape  # [T] int64
        t, start = int(input_ids.shape[0]), self.seq_len
        check_positions(self.info, start + t, f"prompt of {t} tokens after {start} cached")
        self._pending = 0
        input_ids = input_ids.to(self.device)
        if self.engine.mode == "eager":
            causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
            arange = torch.arange(t, device=self.device)
            out = self._eager(TreeInputs(input_ids, arange, causal))
            self.cache.length += t
            return out
        static = self._static[self.engine.widths[-1]]
        outs = []
        for chunk in input_ids.split(static.width):
            c = int(chunk.shape[0])
            chain = torch.ones(c, c, dtype=torch.bool, device=self.device).tril()
            static.fill(chunk, torch.arange(c, device=self.device), chain)
            out = self._checked(*self._run(static, self.seq_len), static, c)
            # copied: the next chunk replays the same graph (under CUDA graphs, into the same
            # output memory)
            hidden = None if out.hidden is None else out.hidden.clone()
            outs.append(TargetOutput(logits=out.logits.clone(), hidden=hidden))
            self.cache.length += c
        hidden = None if outs[0].hidden is None else torch.cat([o.hidden for o in outs])
        return TargetOutput(logits=torch.cat([o.logits for o in outs]), hidden=hidden)

    @torch.inference_mode()
    def verify(self, tree: DraftTree, layout: TreeInputs | StaticLayout | None = None):
        m, start = tree.n_nodes, self.seq_len
        depth = int(tree.depth.max())
        check_positions(self.info, start + depth + 1, f"tree of depth {depth}")
        if layout is None:
            layout = self.layout(tree)
        if self.engine.mode == "compiled":
            if not isinstance(layout, StaticLayout):
                raise TypeError("compiled mode: pass target.layout(tree) (a StaticLayout)")
            out = self._checked(*self._run(layout.static, start), layout.static, layout.rows)
        else:
            if not isinstance(layout, TreeInputs):
                raise TypeError("eager mode: pass target.layout(tree) (TreeInputs)")
            out = self._eager(layout)
        self._pending = m
        return out

    @torch.inference_mode()
    def commit(self, accepted: torch.Tensor) -> None:
        check_commit(accepted, self._pending)
        plan = compaction_indices(accepted.to(self.device), self.seq_len)
        self.cache.compact(plan.src, plan.dst, plan.new_len)
        self._pending = 0

    # --- internals ------------------------------------------------------------------------
    def _eager(self, inputs: TreeInputs) -> TargetOutput:
        """The forward at exact shapes: prefix = the S committed rows, tail = the M new ones."""
        m, start = int(inputs.tokens.shape[0]), self.seq_len
        self.cache.ensure(start + m)
        self._start.fill_(start)
        logits, hidden = forward_tree(
            self.model,
            inputs.tokens,
            inputs.depth,
            self._start,
            inputs.visibility,
            self._keys(start),
            self.cache.tensors(),
            self.capture_layers,
            m,
        )
        return self._checked_rows(logits, hidden, start + inputs.depth)

    def _run(self, static: StaticTree, start: int):
        """The compiled forward of one width bucket after ``start`` committed rows: prefix of
        ``P = start`` rounded down to ``chunk`` (0: the graph without a prefix), tail of
        ``chunk + Mb`` keys. Returns (logits [Mb, V], hidden)."""
        if not self._compiled._warming and (static.width, self.capture_layers) not in self._warm:
            raise RuntimeError(
                f"compiled width {static.width} with capture layers {self.capture_layers} was "
                f"not warmed up: call set_capture_layers before set_engine_mode"
            )
        prefix = start // self.chunk * self.chunk
        tail = self.chunk + static.width
        self.cache.ensure(prefix + tail)
        caches = tuple(cache_input(c, self.cache.capacity_dim) for c in self.cache.tensors())
        self._start.fill_(start)
        keys = self._keys(prefix)
        if prefix:
            torch._dynamo.maybe_mark_dynamic(keys, 0)
        return self._compiled(
            self.model,
            static.tokens,
            static.depth,
            self._start,
            static.visibility,
            keys,
            caches,
            self.capture_layers,
            tail,
        )

    def _checked(self, logits, hidden, static: StaticTree, rows: int) -> TargetOutput:
        """The first ``rows`` outputs of a compiled forward (the padded rows are dropped)."""
        hidden = None if hidden is None else hidden[:rows]
        return self._checked_rows(logits[:rows], hidden, self.seq_len + static.depth[:rows])

    def _checked_rows(self, logits, hidden, positions) -> TargetOutput:
        if self.check_finite:
            check_finite(
                logits,
                lambda: (
                    f"{self.info.name}: NaN/inf in logits at positions "
                    f"{int(positions.min())}..{int(positions.max())}"
                ),
            )
        return TargetOutput(logits=logits, hidden=hidden)
