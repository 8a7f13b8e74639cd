"""Engine modes of the model forwards, and the static shapes the compiled mode runs on.

- ``eager``: every forward runs op by op (PyTorch dispatch per kernel), at the exact shapes of
  each step.
- ``compiled``: the target's verify/prefill and the drafter's propose run through
  ``torch.compile`` (inductor C++ on CPU; ``mode="reduce-overhead"``, i.e. CUDA graphs, on
  CUDA) at a few static shapes, so each graph compiles once and is replayed every step:

  - verify width ``M`` is padded up to the smallest *width bucket* ``Mb >= M`` (by default the
    policy's own width, so nothing is padded in the common case). Padded rows carry a valid
    token at the root's position and see only the prefix and themselves; their logits are
    never read and their KV rows are never committed.
  - the key length is the committed prefix rounded up to a multiple of ``kv_chunk``; it is the
    one dynamic dimension of a graph (``mark_dynamic``), so a growing context never
    recompiles. Keys past the prefix and the M new rows are masked out.
  - KV caches are preallocated buffers written in place inside the graph (``index_copy_`` at
    the new rows' slots); the attention mask is built inside the graph from the prefix length,
    the key positions and the ``[Mb, Mb]`` tree visibility (never a per-step ``[M, S+M]``
    tensor); MoE dispatch has a fixed shape (``ddtree.models.nn.mla_moe.Experts``).

A compiled graph guards on the dispatch keys of its inputs, and a tensor made under
``torch.inference_mode`` has other keys than one made outside it: the buffers a graph reads
(caches, per-step inputs) are always allocated outside inference mode, so that a cache grown
during a request does not recompile.

The pure pieces (bucket choice, the in-graph mask) live here; each model keeps its own
forward, shared by both modes. Compile time is measured by the warm-up that
``set_engine_mode`` runs, one call per width bucket, and is reported apart from step times.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx.experimental._config

from ddtree.tree.layout import LayoutBuffer, VerifyLayout, verify_layout
from ddtree.tree.types import DraftTree
from ddtree.vocab import EngineMode

ENGINE_MODES = tuple(m.value for m in EngineMode)
COMPILE_SCOPES = ("model", "layer")
"""What compiled mode compiles: ``model``, the whole forward as one graph (fewest launches; the
choice for small, dispatch-bound models and CUDA graphs), or ``layer``, each decoder layer
(regional compilation: the layers share their graphs, so a 28-64-layer model compiles in
seconds instead of minutes; the rest of the forward runs eagerly)."""  # "eager", "compiled" (ddtree.vocab)
# Key-length granularity of the compiled graphs: the prefix is rounded up to a multiple of this
# (the dimension is dynamic, so this bounds the masked-out keys and, on CUDA, the number of
# graph recordings).
KV_CHUNK = 64


class EngineModeError(ValueError):
    """An engine mode a model cannot run (e.g. ``compiled`` on the transformers wrapper)."""


def check_engine_support(mode: str, models: Sequence[tuple[str, Sequence[str]]]) -> None:
    """Refuse, once and before anything loads or compiles, an engine mode one of ``models``
    ((description, the engine modes it declares)) cannot run."""
    check_engine_mode(mode)
    for what, modes in models:
        if mode not in modes:
            raise EngineModeError(
                f"engine mode {mode!r} is not available for {what} (runs: {', '.join(modes)}); "
                f"compiled mode runs our targets (DeepSeek-V3 / Kimi-K2, Qwen3, Qwen3-MoE, "
                f"Llama: --impl auto, one process) and the DFlash drafter"
            )


def check_compile_scope(scope: str) -> str:
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope {scope!r}: expected one of {', '.join(COMPILE_SCOPES)}")
    return scope


def check_engine_mode(mode: str) -> str:
    if mode not in ENGINE_MODES:
        raise ValueError(f"engine_mode {mode!r}: expected one of {', '.join(ENGINE_MODES)}")
    return mode


@dataclass(frozen=True)
class EnginePlan:
    """What the decode loop tells a model before a request."""

    mode: str = "eager"
    widths: tuple[int, ...] = ()  # verify width buckets (compiled; sorted, distinct)
    max_len: int = 0  # positions the request may reach (prompt + new tokens + block)
    compile_scope: str = "model"  # compiled: COMPILE_SCOPES
    # hidden states the target returns (HF hidden_states ids; compiled into its graphs);
    # None: those its set_capture_layers set
    capture_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_engine_mode(self.mode)
        if self.capture_layers is not None:
            object.__setattr__(self, "capture_layers", tuple(self.capture_layers))
        check_compile_scope(self.compile_scope)
        if any(w < 1 for w in self.widths):
            raise ValueError(f"width buckets must be >= 1, got {list(self.widths)}")
        object.__setattr__(self, "widths", tuple(sorted(set(self.widths))))
        if self.mode == "compiled" and not self.widths:
            raise ValueError("compiled mode needs at least one width bucket")


def pick_bucket(width: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``width``. Example: width 5, buckets (1, 9, 33) -> 9."""
    for b in buckets:
        if b >= width:
            return b
    raise ValueError(
        f"verify width {width} exceeds the largest width bucket {max(buckets)} "
        f"(buckets {list(buckets)}): add a bucket of at least {width}"
    )


def kv_bucket(length: int, chunk: int = KV_CHUNK) -> int:
    """Keys a compiled forward attends over for ``length`` needed rows: ``length`` rounded up
    to a multiple of ``chunk``, at least one chunk. Example: 130 rows, chunk 64 -> 192."""
    return max(chunk, -(-length // chunk) * chunk)


def static_attention_mask(
    start: torch.Tensor,  # [] int64: committed prefix length S
    visibility: torch.Tensor,  # [Mb, Mb] bool: the (padded) tree's ancestor-or-self relation
    key_positions: torch.Tensor,  # [K] int64: 0 .. K-1, the cache slots attended over
    dtype: torch.dtype,
) -> torch.Tensor:
    """[Mb, K] additive mask for Mb new rows written at slots ``S .. S+Mb-1``: every row sees
    the prefix ``< S``, new slot ``S + j`` when ``visibility[i, j]``, nothing past ``S + Mb``.

    Worked example: S = 2, K = 5, visibility [[1, 0], [1, 1]] -> visible columns
    row 0: {0, 1, 2}, row 1: {0, 1, 2, 3}; column 4 (past the new rows) is hidden.
    Runs inside the compiled graph (no host work, no data-dependent shapes).
    """
    mb = visibility.shape[0]
    rel = key_positions - start  # [K]: the new-row index of each key slot
    in_tree = (rel >= 0) & (rel < mb)
    tree_cols = visibility[:, rel.clamp(0, mb - 1)] & in_tree  # [Mb, K]
    visible = (rel < 0) | tree_cols
    zero = torch.zeros((), dtype=dtype, device=visibility.device)
    hidden = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=visibility.device)
    return torch.where(visible, zero, hidden)


def packed_rows_mask(
    row_lo: torch.Tensor,  # [W] int64: the first cache slot of each query's row
    row_new: torch.Tensor,  # [W] int64: the slot of its row's first new key (= lo + S_row)
    visibility: torch.Tensor,  # [W, Mx] bool: each query's own row of its tree's visibility
    key_slots: torch.Tensor,  # [T] int64: the cache slots attended over
    dtype: torch.dtype,
) -> torch.Tensor:
    """[W, T] additive mask of a packed batch: the W new rows of several requests in one
    forward, each request owning a region of the cache. A query sees its own request's
    committed keys (slots ``lo .. new-1``) and the new keys of its own tree that its
    visibility row marks (slot ``new + j`` when ``visibility[q, j]``); nothing of another
    request. A visibility row is padded with False past its tree's M nodes.

    Worked example: two requests, regions of 4 slots; request a (lo 0) has S = 2 committed and
    a tree of 2 nodes (root, child); request b (lo 4) has S = 1 and its root alone. Queries
    [a0, a1, b0], visibility [[1, 0], [1, 1], [1, 0]], keys 0..5 -> visible columns
    a0: {0, 1, 2}, a1: {0, 1, 2, 3}, b0: {4, 5}.
    Runs inside a compiled graph (no host work, no data-dependent shapes)."""
    width = visibility.shape[1]
    rel = key_slots[None, :] - row_new[:, None]  # [W, T]: the new-row index of each key
    in_tree = (rel >= 0) & (rel < width)
    tree_cols = visibility.gather(1, rel.clamp(0, width - 1)) & in_tree  # [W, T]
    committed = (key_slots[None, :] >= row_lo[:, None]) & (rel < 0)
    zero = torch.zeros((), dtype=dtype, device=visibility.device)
    hidden = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=visibility.device)
    return torch.where(committed | tree_cols, zero, hidden)


class StaticTree:
    """Preallocated per-step inputs of one width bucket ``Mb``: the padded tree's tokens,
    depths and visibility, refilled in place every step."""

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def __init__(self, width: int, device: torch.device) -> None:
        self.width = width
        self.tokens = torch.zeros(width, dtype=torch.int64, device=device)  # [Mb]
        self.depth = torch.zeros(width, dtype=torch.int64, device=device)  # [Mb]
        self._eye = torch.eye(width, dtype=torch.bool, device=device)  # [Mb, Mb]
        self.visibility = self._eye.clone()  # [Mb, Mb] bool

    def fill(self, tokens: torch.Tensor, depth: torch.Tensor, visibility: torch.Tensor) -> int:
        """Copy a tree of M <= Mb nodes (tokens/depth [M], visibility [M, M]); padded rows get
        the root's token at depth 0 and see only themselves among the new rows. Returns M."""
        m = int(tokens.shape[0])
        if m > self.width:
            raise ValueError(f"{m} rows do not fit the width bucket {self.width}")
        self.tokens[:m] = tokens
        self.tokens[m:] = tokens[0]
        self.depth[:m] = depth
        self.depth[m:] = 0
        self.visibility.copy_(self._eye)
        self.visibility[:m, :m] = visibility
        return m


@dataclass
class StaticLayout:
    """A compiled verify's layout: the width bucket's inputs, filled with ``rows`` real rows."""

    static: StaticTree
    rows: int  # M: the tree's nodes; rows M..Mb-1 are padding


class EagerLayouts:
    """Eager verify layouts (``verify_layout``) filled into one ``LayoutBuffer`` sized for a
    request by :meth:`reserve`: no per-step allocation of the [M, S+M] mask. A tree that does
    not fit (a direct call outside a planned request) gets a layout of its own."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.buffer: LayoutBuffer | None = None

    def reserve(self, plan: EnginePlan) -> None:
        rows = max(plan.widths, default=1)
        cols = plan.max_len + rows
        if self.buffer is None or self.buffer.rows < rows or self.buffer.cols < cols:
            self.buffer = LayoutBuffer(rows, cols, self.dtype, self.device)

    def fill(self, tree: DraftTree, start: int) -> VerifyLayout:
        m, buffer = tree.n_nodes, self.buffer
        if buffer is None or m > buffer.rows or start + m > buffer.cols:
            return verify_layout(tree, start, self.dtype)
        return verify_layout(tree, start, self.dtype, out=buffer)


# Graphs one forward function may hold: every model of the process shares its code object, and
# each compiles (widths x with/without a prefix) graphs; Dynamo's default stops at 8.
RECOMPILE_LIMIT = 256


def compile_options(device: torch.device) -> dict:
    """``torch.compile`` options of the compiled engine mode: one graph per call (``fullgraph``:
    a graph break is a bug, not a slowdown), static shapes except the marked key dimension,
    CUDA graphs on CUDA."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT)
    mode = "reduce-overhead" if torch.device(device).type == "cuda" else None
    return {"fullgraph": True, "dynamic": False, "mode": mode}


def compile_forward(fn: Callable, device: torch.device) -> Callable:
    """``fn`` compiled whole, with :func:`compile_options`."""
    return torch.compile(fn, **compile_options(device))


class CompiledForward:
    """An eager forward compiled for the compiled engine mode: calls replay its graphs
    (:func:`replay`); calls made inside :meth:`warm_up` compile them, and the seconds they took
    are what ``set_engine_mode`` reports as compile time. ``scope`` (:data:`COMPILE_SCOPES`):
    ``model`` compiles ``fn`` whole; ``layer`` calls ``fn`` as it is with ``layers=`` compiled
    copies of ``layers`` (the modules themselves stay eager for eager-mode calls)."""

    def __init__(
        self, fn: Callable, device: torch.device, scope: str = "model", layers: Sequence = ()
    ) -> None:
        self.scope = scope
        self.layers = None
        if scope == "layer":
            options = compile_options(device)
            self.layers = [torch.compile(layer, **options) for layer in layers]
            self.compiled = fn
        else:
            self.compiled = compile_forward(fn, device)
        self._warming = False

    def __call__(self, *args, **kwargs):
        if self.layers is not None:
            kwargs["layers"] = self.layers
        return replay(self.compiled, *args, warm_up=self._warming, **kwargs)

    def warm_up(self, call: Callable[[], object]) -> float:
        """Run ``call`` (which calls this forward) compiling as needed; returns its seconds."""
        self._warming = True
        try:
            return timed(call)
        finally:
            self._warming = False


def replay(compiled: Callable, *args, warm_up: bool = False, **kwargs):
    """Call a compiled forward. ``warm_up`` (``set_engine_mode``): compile as needed. Otherwise
    its graphs are compiled already: only the guards that tell them apart are evaluated
    (``skip_guard_eval_unsafe``; the full guard set cost 0.2-0.4 ms per call here), and a
    recompile raises instead of hiding in a step time."""
    if warm_up:
        # no duck shaping: a cache capacity that happens to equal the key bucket while
        # compiling must not become one symbol with it (a later, larger cache would recompile)
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)
    with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
        return compiled(*args, **kwargs)


def cache_input(cache: torch.Tensor, capacity_dim: int) -> torch.Tensor:
    """Prepare a KV cache buffer as a compiled graph's input, which the graph updates in
    place: its capacity dimension dynamic (a cache grown for a longer request reuses the
    graph); on CUDA a static address, without which CUDA graphs would copy it every replay."""
    torch._dynamo.maybe_mark_dynamic(cache, capacity_dim)
    if cache.device.type == "cuda":
        torch._dynamo.mark_static_address(cache)
    return cache


class KeyPositions:
    """Key positions ``0 .. n-1`` ([n] int64) as views of one arange grown by doubling: what a
    compiled graph reads as its key index, allocated outside inference mode (see above)."""

    @torch.inference_mode(False)
    def __init__(self, n: int, device: torch.device) -> None:
        self.device = device
        self._arange = torch.arange(n, device=device)

    @torch.inference_mode(False)
    def __call__(self, n: int) -> torch.Tensor:
        if self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, 2 * self._arange.shape[0]), device=self.device)
        return self._arange[:n]


def mark_key_dim(key_positions: torch.Tensor) -> torch.Tensor:
    """Mark dim 0 of the key positions dynamic, so the growing prefix reuses one graph."""
    torch._dynamo.maybe_mark_dynamic(key_positions, 0)
    return key_positions


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took (synchronising CUDA): the compile-time figure of a warm-up."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0
