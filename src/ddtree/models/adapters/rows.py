"""Several requests in one target forward: the batched engine's view of a :class:`CachedTarget`.

Each request (a *row*) owns a region of ``row_capacity`` slots in one cache of ``max_rows``
regions; row ``r``'s committed keys sit at slots ``r * row_capacity .. + S_r - 1``. A forward
packs *segments*, one per row taking part: a prompt (a causal chain, committed whole) or a
verify tree (committed by acceptance), ``W`` new rows in all. The model runs its usual
forward over the W rows (the linear layers and experts read their weights once for every
request); attention goes through ``AttentionInputs.packed``: the keys are every row's used
slots, all masked tail keys, and a request sees only its own
(``ddtree.models.static.packed_rows_mask``).

Engine modes: eager runs each forward at its exact width; compiled pads the packed rows to a
width bucket and the keys to a multiple of ``KV_CHUNK`` (the one dynamic dimension), one graph
per bucket, compiled by :meth:`RowsTarget.set_engine_mode`. The models never know which.

Worked example (regions of 8 slots): row 0 has S = 3 committed, row 1 joins with a prompt of
2 tokens. A forward of [row 0: a tree of 2 nodes; row 1: its prompt] has W = 4 new rows
written at slots 3, 4 (row 0) and 8, 9 (row 1), positions 3, 4 and 0, 1. After it, row 0
commits its accepted nodes (its length becomes 3 + tau) and row 1 its 2 prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.models.adapters.target import CachedTarget
from ddtree.models.base import TargetOutput
from ddtree.models.loading.memory import available_bytes
from ddtree.models.nn.attention import AttentionInputs
from ddtree.models.nn.causal_lm import CausalLM
from ddtree.models.nn.layers import check_commit, check_positions
from ddtree.models.static import (
    CompiledForward,
    EngineModeError,
    EnginePlan,
    cache_input,
    kv_bucket,
    mark_key_dim,
)
from ddtree.tree.layout import compaction_indices


@dataclass
class Segment:
    """One row's new tokens in a packed forward: a prompt chunk or a verify tree."""

    row: int  # the request's region
    tokens: torch.Tensor  # [M] int64
    depth: torch.Tensor  # [M] int64: position = the row's S + depth
    visibility: torch.Tensor  # [M, M] bool: ancestor-or-self (a prompt: lower triangle)
    is_prompt: bool = False  # committed whole (``commit_prompt``), not by acceptance

    @classmethod
    def prompt(cls, row: int, input_ids: torch.Tensor) -> Segment:
        t = int(input_ids.shape[0])
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        return cls(row, input_ids, torch.arange(t, device=input_ids.device), causal, True)


@dataclass
class PackedInputs:
    """What :func:`forward_rows` takes for W packed new rows."""

    tokens: torch.Tensor  # [W] int64
    positions: torch.Tensor  # [W] int64
    row_lo: torch.Tensor  # [W] int64: first slot of each row's region
    row_new: torch.Tensor  # [W] int64: its first new slot (lo + S)
    node: torch.Tensor  # [W] int64: index within its segment
    visibility: torch.Tensor  # [W, Mx] bool: the row's visibility row, False-padded
    keys: torch.Tensor  # [T] int64: the cache slots attended over (each row's used slots)
    arange: torch.Tensor  # [max(W, Mx)] int64: 0, 1, ... (filling help, not an input)
    key_buffer: torch.Tensor | None = None  # compiled: what ``keys`` is a view of

    @classmethod
    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def empty(cls, width: int, cols: int, keys: int, device: torch.device) -> PackedInputs:
        def ints(n=width):
            return torch.zeros(n, dtype=torch.int64, device=device)

        visibility = torch.zeros(width, cols, dtype=torch.bool, device=device)
        arange = torch.arange(max(width, cols), device=device)
        buffer = ints(keys)
        return cls(ints(), ints(), ints(), ints(), ints(), visibility, buffer, arange, buffer)

    def fields(self) -> tuple[torch.Tensor, ...]:
        """The forward's inputs, in :func:`forward_rows`' order."""
        return (self.tokens, self.positions, self.row_lo, self.row_new, self.node,
                self.visibility, self.keys)  # fmt: skip


def forward_rows(
    model: CausalLM,
    tokens: torch.Tensor,  # [W] int64
    positions: torch.Tensor,  # [W] int64
    row_lo: torch.Tensor,  # [W] int64
    row_new: torch.Tensor,  # [W] int64
    node: torch.Tensor,  # [W] int64
    visibility: torch.Tensor,  # [W, Mx] bool
    keys: torch.Tensor,  # [T] int64: the slots attended over (the compiled graph's dynamic dim)
    caches: tuple[torch.Tensor, ...],
    capture_layers: tuple[int, ...],
    layers=None,  # compile scope "layer": the compiled decoder layers
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The packed forward of both engine modes (:class:`PackedInputs`' fields): (logits
    [W, V], hidden [W, F] or None)."""
    attn = AttentionInputs.packed(row_lo, row_new, node, visibility, keys, caches[0].dtype)
    if layers is not None:  # compile scope "layer": the layer graphs see the key count T
        torch._dynamo.maybe_mark_dynamic(attn.tail_slots, 0)  # through these, made here
        torch._dynamo.maybe_mark_dynamic(attn.tail_mask, 1)  # eagerly: keep it symbolic
    out = model(tokens, positions, attn, caches, capture_layers, layers)
    return out.logits, out.hidden


def pack(
    segments: list[Segment],
    lengths: list[int],
    row_capacity: int,
    out: PackedInputs | None = None,
    spare: int = 0,
) -> PackedInputs:
    """The packed inputs of ``segments`` after each row's ``lengths[row]`` committed tokens.
    The keys are each row's committed and new slots, in row order (attention reads those
    alone, however large the regions). ``out`` (compiled mode): fill these preallocated
    inputs of a width bucket instead; its rows past the segments are padding, written into
    the spare region at slot ``spare`` on, each seeing only itself; the keys are padded with
    spare slots to a multiple of ``KV_CHUNK`` (the graph's one dynamic dimension).

    Example: regions of 8, lengths [3, 0], segments [row 0: tree of 2, row 1: prompt of 2]
    -> positions [3, 4, 0, 1], row_lo [0, 0, 8, 8], row_new [3, 3, 8, 8], node [0, 1, 0, 1],
    keys [0, 1, 2, 3, 4, 8, 9]."""
    total = sum(int(s.tokens.shape[0]) for s in segments)
    device = segments[0].tokens.device
    used = [
        torch.arange(lengths[s.row] + int(s.tokens.shape[0]), device=device) + s.row * row_capacity
        for s in segments
    ]
    if out is None:
        cols = max(int(s.tokens.shape[0]) for s in segments)
        out = PackedInputs.empty(total, cols, 0, device)
        out.keys = torch.cat(used)
    else:  # the real keys, then every padding row's own slot, then spare slots to a chunk
        w = out.visibility.shape[0]
        used.append(spare + out.arange[:w])
        n = sum(int(u.shape[0]) for u in used)
        keys = out.key_buffer[: kv_bucket(n)]
        keys.fill_(spare)
        keys[:n] = torch.cat(used)
        out.keys = mark_key_dim(keys)
    w, cols = out.visibility.shape
    if total > w:
        raise ValueError(f"{total} packed rows do not fit the width bucket {w}")
    out.visibility.zero_()
    at = 0
    for s in segments:
        m = int(s.tokens.shape[0])
        rows = slice(at, at + m)
        out.tokens[rows] = s.tokens
        out.positions[rows] = lengths[s.row] + s.depth
        out.row_lo[rows] = s.row * row_capacity
        out.row_new[rows] = s.row * row_capacity + lengths[s.row]
        out.node[rows] = out.arange[:m]
        out.visibility[rows, :m] = s.visibility
        at += m
    pad = out.arange[: w - at]
    out.tokens[at:] = 0
    out.positions[at:] = 0
    out.row_lo[at:] = spare
    out.row_new[at:] = spare
    out.node[at:] = pad
    out.visibility[at + pad, pad] = True
    return out


def check_rows_fit(target: CachedTarget, max_rows: int, row_capacity: int) -> None:
    """Refuse, before allocating, a batch whose cache does not fit the memory left on the
    target's device, naming its size: ``max_rows x row_capacity`` slots at the bytes one slot
    takes in every layer (the target's own cache tensors tell)."""
    cache = target.cache
    slot_bytes = sum(
        t.numel() // t.shape[cache.capacity_dim] * t.element_size() for t in cache.tensors()
    )
    need = slot_bytes * max_rows * row_capacity
    have = available_bytes(target.device)
    if have is not None and need > have:
        raise MemoryError(
            f"a batch of {max_rows} rows x {row_capacity} cache slots needs "
            f"{need / 1e9:.2f} GB of KV cache ({slot_bytes} bytes a slot); {target.device} has "
            f"{have / 1e9:.2f} GB available: lower --max-batch (rows) or the tokens a request "
            "may hold"
        )


class RowsTarget:
    """Up to ``max_rows`` requests over the model of a :class:`CachedTarget` (see the module
    docstring). The target's own cache is left alone: the rows have a cache of their own,
    ``max_rows`` regions of ``row_capacity`` slots and, in compiled mode, a spare region the
    padding rows are written into."""

    def __init__(self, target: CachedTarget, max_rows: int, row_capacity: int) -> None:
        if not isinstance(target, CachedTarget):
            raise EngineModeError(
                f"{target.info.name} ({target.info.implementation}) decodes one request at a "
                "time: batched decoding runs our cached targets (--impl auto: DeepSeek-V3 / "
                "Kimi-K2, Qwen3, Qwen3-MoE, Llama), not the transformers wrapper"
            )
        if max_rows < 1 or row_capacity < 1:
            raise ValueError(
                f"max_rows and row_capacity must be >= 1, got {max_rows} and {row_capacity}"
            )
        self.target = target
        self.info = target.info
        self.device, self.dtype = target.device, target.dtype
        self.max_rows, self.row_capacity = max_rows, row_capacity
        self.spare = max_rows * row_capacity  # first slot past the regions
        self.capture_layers: tuple[int, ...] = ()
        self.lengths = [0] * max_rows  # committed tokens per row
        self._pending: dict[int, int] = {}  # row -> M of its last verify segment
        self.plan = EnginePlan()
        self._run = self._run_eager  # the runner of the plan's mode, chosen in set_engine_mode
        self._compiled: CompiledForward | None = None
        self._static: dict[int, PackedInputs] = {}  # width bucket -> its preallocated inputs
        self._warm: set[tuple[int, tuple[int, ...]]] = set()  # (width, capture) compiled
        check_rows_fit(target, max_rows, row_capacity)
        self.cache = target.new_cache(self.spare)

    @torch.inference_mode()
    def set_engine_mode(self, plan: EnginePlan, capture_layers: tuple[int, ...]) -> float:
        """Eager, or compiled at the packed-row buckets ``plan.widths`` (each compiled now,
        once); returns the seconds compiling took. Resets every row."""
        self.plan, self.capture_layers = plan, tuple(capture_layers)
        self.lengths = [0] * self.max_rows
        self._pending.clear()
        if plan.mode == "eager":
            self._run = self._run_eager
            return 0.0
        if self.cache.capacity < self.spare + plan.widths[-1]:
            self.cache = self.target.new_cache(self.spare + plan.widths[-1])
        if self._compiled is None:
            layers = self.target.model.model.layers
            self._compiled = CompiledForward(forward_rows, self.device, plan.compile_scope, layers)
        compile_s = 0.0
        one = torch.zeros(1, dtype=torch.int64, device=self.device)
        root = Segment(0, one, one, torch.ones(1, 1, dtype=torch.bool, device=self.device))
        for width in plan.widths:
            keys = kv_bucket(self.spare + width)  # every region full, and the padding rows
            static = self._static.get(width) or PackedInputs.empty(width, width, keys, self.device)
            self._static[width] = static
            if (width, self.capture_layers) in self._warm:
                continue
            pack([root], self.lengths, self.row_capacity, static, self.spare)
            compile_s += self._compiled.warm_up(lambda s=static: self._run_compiled(s))
            self._warm.add((width, self.capture_layers))
        self._run = self._run_bucketed
        return compile_s

    def release(self, row: int) -> None:
        """Free a row's region for the next request."""
        self.lengths[row] = 0
        self._pending.pop(row, None)

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> list[TargetOutput]:
        """One forward over the packed segments; per segment its logits [M, V] and hidden
        states. A prompt's tokens are kept by :meth:`commit_prompt`, a tree's accepted nodes
        by :meth:`commit`. Compiled mode runs it in the smallest width bucket that holds it,
        eagerly when none does (a joining prompt longer than the buckets)."""
        for s in segments:
            m = int(s.tokens.shape[0])
            have = self.lengths[s.row]
            check_positions(self.info, have + int(s.depth.max()) + 1, f"row {s.row}: {m} tokens")
            if have + m > self.row_capacity:
                raise ValueError(
                    f"row {s.row}: {have} cached + {m} new tokens exceed its region of "
                    f"{self.row_capacity} slots (raise the row capacity)"
                )
        inputs, (logits, hidden) = self._run(segments)
        outs, at = [], 0
        for s in segments:
            m = int(s.tokens.shape[0])
            rows = slice(at, at + m)
            h = None if hidden is None else hidden[rows]
            outs.append(self.target.checked_rows(logits[rows], h, inputs.positions[rows]))
            self._pending[s.row] = m
            at += m
        return outs

    def _run_eager(self, segments: list[Segment]):
        """Eager mode's runner: the segments packed as they are, one eager forward."""
        inputs = pack(segments, self.lengths, self.row_capacity)
        caches = self.cache.tensors()
        return inputs, forward_rows(
            self.target.model, *inputs.fields(), caches, self.capture_layers
        )

    def _run_bucketed(self, segments: list[Segment]):
        """Compiled mode's runner: the smallest width bucket that holds the segments, or eagerly
        when none does (a joining prompt longer than the buckets)."""
        total = sum(int(s.tokens.shape[0]) for s in segments)
        width = next((w for w in self.plan.widths if w >= total), None)
        if width is None:
            return self._run_eager(segments)
        inputs = pack(segments, self.lengths, self.row_capacity, self._static[width], self.spare)
        return inputs, self._run_compiled(inputs)

    def _run_compiled(self, inputs: PackedInputs):
        caches = tuple(cache_input(c, self.cache.capacity_dim) for c in self.cache.tensors())
        return self._compiled(self.target.model, *inputs.fields(), caches, self.capture_layers)

    def commit_prompt(self, row: int) -> None:
        """Keep all of the row's last segment (a prompt)."""
        self.lengths[row] += self._pending.pop(row)

    @torch.inference_mode()
    def commit(self, rows: list[int], accepted: list[torch.Tensor]) -> None:
        """Keep each row's accepted nodes (``accepted[i]`` [tau] int64, root first) of its
        last verified tree: one move of cache rows for every request."""
        src, dst = [], []
        for row, acc in zip(rows, accepted, strict=True):
            check_commit(acc, self._pending.pop(row, 0))
            base = row * self.row_capacity
            plan = compaction_indices(acc.to(self.device), self.lengths[row])
            src.append(plan.src + base)
            dst.append(plan.dst + base)
            self.lengths[row] = plan.new_len
        if src:
            self.cache.compact(torch.cat(src), torch.cat(dst), 0)
