"""Tensor- and expert-parallel MLA+MoE target over ``torch.distributed`` (gloo / NCCL).

How the model is split (rank ``r`` of ``tp`` ranks, ``ep`` expert groups, ``t = tp // ep``
ranks per expert group):

==================  ========================================================================
attention           heads ``r*nh/tp ..``: rows of ``q_proj``/``q_b_proj``/``kv_b_proj``,
                    columns of ``o_proj``. The kv latent (``kv_a_proj_with_mqa``, its norm)
                    is replicated, so every rank keeps the whole latent cache, as serving
                    engines do for MLA.
dense MLP, shared   intermediate ``/ tp``: rows of ``gate_proj``/``up_proj``, columns of
experts             ``down_proj``.
routed experts      experts ``g*E/ep ..`` with ``g = r // t`` (EP), and part ``r % t`` of
                    ``t`` of their intermediate (TP); ``ep = 1``: every rank has every expert,
                    ``ep = tp``: whole experts, ``E / tp`` per rank.
replicated          embedding, router, norms. The LM head lives on rank 0 only: the drafter
                    (which shares it), the tree and acceptance are there, and no other rank
                    needs logits.
==================  ========================================================================

Each decoder layer then ends its attention and its MLP/MoE with one all-reduce of the
``[M, hidden]`` partial sums: ``2 x layers`` per forward, the count the estimator's cost model
charges. Expert parallelism here: after the attention all-reduce every rank holds every
token, so dispatch needs no communication; each rank runs its own experts on the tokens routed
to them and the MoE all-reduce combines (an all-to-all dispatch pays off with data-parallel
attention, which this runtime does not do; the estimator models that deployment).

Control: rank 0 runs ``ddtree.engine.generate`` with a :class:`ParallelTarget`. Every Target
call is broadcast first (an :class:`Op` header, then one int64 payload: prompt ids, the tree's
tokens/parents/positions/visibility bits, or the accepted node indices); the other ranks, in
:func:`serve`, make the same call on their shard, so that all ranks meet in the same
all-reduces and commit the same KV entries. Each rank reads only its own slices of the
safetensors checkpoint.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch
import torch.distributed as dist

from ddtree.distributed import (
    DEFAULT_READY_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    Group,
    start_group,
)
from ddtree.errors import DistributedError, NonFiniteLogitsError
from ddtree.models.adapters.mla_moe import MlaMoeTarget
from ddtree.models.base import TargetOutput
from ddtree.models.loading.checkpoint import CheckpointSlices, match_state_dict, read_config
from ddtree.models.loading.quant import dequantized
from ddtree.models.nn.mla_moe import (
    MlaMoeConfig,
    MlaMoeModel,
    ModelShard,
    build_model,
    expected_shapes,
    fuse_per_expert,
)
from ddtree.models.static import EnginePlan
from ddtree.tree.layout import pack_bits
from ddtree.tree.types import DraftTree


class ParallelConfigError(ValueError):
    """A ``tp``/``ep`` choice the model's sizes cannot be split by."""


@dataclass(frozen=True)
class ShardRanges:
    """Which heads, intermediate columns and experts one rank holds (Python ranges)."""

    heads: range
    dense: range  # dense MLP intermediate
    shared: range  # shared-expert intermediate
    experts: range
    expert_intermediate: range

    def model_shard(self, lm_head: bool, reduce=None) -> ModelShard:
        return ModelShard(
            heads=len(self.heads),
            dense_intermediate=len(self.dense),
            shared_intermediate=len(self.shared),
            first_expert=self.experts.start,
            n_experts=len(self.experts),
            expert_intermediate=len(self.expert_intermediate),
            lm_head=lm_head,
            reduce=reduce,
        )


def _part(total: int, parts: int, index: int) -> range:
    size = total // parts
    return range(index * size, (index + 1) * size)


@dataclass(frozen=True)
class ParallelPlan:
    """``tp`` ranks; routed experts split into ``ep`` groups (``ep`` divides ``tp``)."""

    tp: int
    ep: int = 1

    def check(self, config: MlaMoeConfig, source: str = "config.json") -> None:
        """Raise :class:`ParallelConfigError` naming the first size that does not split."""
        if self.tp < 1 or self.ep < 1:
            raise ParallelConfigError(f"tp and ep must be >= 1, got tp={self.tp}, ep={self.ep}")
        if self.tp % self.ep:
            raise ParallelConfigError(f"ep={self.ep} must divide tp={self.tp}")
        c = config
        splits = [("num_attention_heads", c.num_attention_heads, self.tp)]
        if c.first_k_dense_replace > 0:
            splits.append(("intermediate_size", c.intermediate_size, self.tp))
        if c.first_k_dense_replace < c.num_hidden_layers:
            shared = c.moe_intermediate_size * c.n_shared_experts
            splits += [
                ("moe_intermediate_size x n_shared_experts", shared, self.tp),
                ("n_routed_experts", c.n_routed_experts, self.ep),
                ("moe_intermediate_size", c.moe_intermediate_size, self.tp // self.ep),
            ]
        for name, size, parts in splits:
            if size % parts:
                raise ParallelConfigError(
                    f"{source}: {name}={size} does not split into {parts} equal parts "
                    f"(tp={self.tp}, ep={self.ep})"
                )

    def ranges(self, config: MlaMoeConfig, rank: int) -> ShardRanges:
        c, per_group = config, self.tp // self.ep
        return ShardRanges(
            heads=_part(c.num_attention_heads, self.tp, rank),
            dense=_part(c.intermediate_size, self.tp, rank),
            shared=_part(c.moe_intermediate_size * c.n_shared_experts, self.tp, rank),
            experts=_part(c.n_routed_experts, self.ep, rank // per_group),
            expert_intermediate=_part(c.moe_intermediate_size, per_group, rank % per_group),
        )


# --- reading one rank's slices ---------------------------------------------------------------


def _span(r: range, unit: int) -> slice:
    return slice(r.start * unit, r.stop * unit)


def _split_rules(config: MlaMoeConfig) -> dict[str, tuple[str, int, int]]:
    """Per-layer parameter name -> (ShardRanges field, split dim, rows or columns per index).
    Parameters not listed are replicated."""
    c = config
    per_head_kv = c.qk_nope_head_dim + c.v_head_dim
    return {
        "self_attn.q_proj.weight": ("heads", 0, c.qk_head_dim),
        "self_attn.q_b_proj.weight": ("heads", 0, c.qk_head_dim),
        "self_attn.kv_b_proj.weight": ("heads", 0, per_head_kv),
        "self_attn.o_proj.weight": ("heads", 1, c.v_head_dim),
        "mlp.gate_proj.weight": ("dense", 0, 1),
        "mlp.up_proj.weight": ("dense", 0, 1),
        "mlp.down_proj.weight": ("dense", 1, 1),
        "mlp.shared_experts.gate_proj.weight": ("shared", 0, 1),
        "mlp.shared_experts.up_proj.weight": ("shared", 0, 1),
        "mlp.shared_experts.down_proj.weight": ("shared", 1, 1),
    }


def _layer_prefix(name: str) -> tuple[str, str]:
    """``model.layers.3.mlp.gate.weight`` -> (``model.layers.3.``, ``mlp.gate.weight``)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        return ".".join(parts[:3]) + ".", ".".join(parts[3:])
    return "", name


def _read_experts(
    ckpt: CheckpointSlices, prefix: str, which: str, r: ShardRanges, config, per_expert: bool
) -> torch.Tensor:
    """This rank's routed experts in the fused layout: ``gate_up_proj`` [E_r, 2 I_r, H] or
    ``down_proj`` [E_r, H, I_r], from a fused or a per-expert checkpoint."""
    inter = r.expert_intermediate
    gate = slice(inter.start, inter.stop)
    up = slice(
        config.moe_intermediate_size + inter.start, config.moe_intermediate_size + inter.stop
    )
    if not per_expert:
        experts, name = slice(r.experts.start, r.experts.stop), f"{prefix}mlp.experts.{which}"
        if which == "down_proj":
            return ckpt.read(name, (experts, slice(None), gate))
        return torch.cat([ckpt.read(name, (experts, gate)), ckpt.read(name, (experts, up))], 1)
    out = []
    for e in r.experts:
        base = f"{prefix}mlp.experts.{e}."
        if which == "down_proj":
            out.append(ckpt.read(base + "down_proj.weight", (slice(None), gate)))
        else:
            out.append(
                torch.cat(
                    [
                        ckpt.read(base + "gate_proj.weight", (gate,)),
                        ckpt.read(base + "up_proj.weight", (gate,)),
                    ]
                )
            )
    return torch.stack(out)


def read_shard(
    path: str | Path,
    config: MlaMoeConfig,
    ranges: ShardRanges,
    shard: ModelShard,
    attn_impl: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """This rank's parameters ``{name: tensor}``, read slice by slice from the checkpoint.

    The whole checkpoint's names and shapes are checked first from the file headers, with the
    same errors as a single-process load. Quantized weights are read as the blocks, words and
    groups covering this rank's slices, dequantized into ``dtype`` (``ddtree.models.loading.quant``)."""
    path = Path(path)
    rules = _split_rules(config)
    with CheckpointSlices(path) as stored:
        ckpt = dequantized(stored, config.quantization, dtype)
        header = {n: torch.empty(s, device="meta") for n, s in ckpt.shapes().items()}
        fused = fuse_per_expert(header, config)  # meta tensors: names and shapes only
        match_state_dict(expected_shapes(config, attn_impl), fused, str(path))
        per_expert = len(fused) != len(header)
        out = {}
        for name, shape in expected_shapes(config, attn_impl, shard).items():
            prefix, local = _layer_prefix(name)
            if local in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                which = local.rsplit(".", 1)[1]
                tensor = _read_experts(ckpt, prefix, which, ranges, config, per_expert)
            elif local in rules:
                field, dim, unit = rules[local]
                index = (slice(None),) * dim + (_span(getattr(ranges, field), unit),)
                tensor = ckpt.read(name, index)
            else:
                tensor = ckpt.read(name)
            assert tuple(tensor.shape) == shape, (name, tuple(tensor.shape), shape)
            out[name] = tensor
    return out


# --- control channel --------------------------------------------------------------------------


class Op(IntEnum):
    """What rank 0 asks the other ranks to do next."""

    OPEN = 1  # payload: JSON session spec (utf-8 bytes as int64); load a shard
    RESET = 2
    PREFILL = 3  # payload: [T] prompt ids
    VERIFY = 4  # payload: tree (see encode_tree); header arg: M
    COMMIT = 5  # payload: [tau] accepted node indices
    CLOSE = 6  # end the session (drop the shard)
    EXIT = 7  # leave serve()


HEADER_LEN = 4  # int64: op, payload length, rank 0's seq_len, op argument


@dataclass
class Message:
    op: Op
    payload: torch.Tensor  # [n] int64 (on the group's device)
    seq_len: int
    arg: int


class Channel:
    """Broadcasts of Target calls from rank 0: a fixed header, then the payload if any."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.broadcasts = 0

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        try:
            dist.broadcast(tensor, src=0)
        except (RuntimeError, dist.DistError) as err:
            raise self.group.failure(what, err) from None
        self.broadcasts += 1

    def send(self, op: Op, payload: torch.Tensor | None = None, seq_len: int = 0, arg: int = 0):
        device = self.group.device
        n = 0 if payload is None else int(payload.numel())
        header = torch.tensor([int(op), n, seq_len, arg], dtype=torch.int64, device=device)
        self._broadcast(header, f"sending {op.name}")
        if n:
            self._broadcast(payload.to(device=device, dtype=torch.int64), f"sending {op.name}")

    def recv(self) -> Message:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.group.device)
        self._broadcast(header, "waiting for rank 0")
        op, n, seq_len, arg = header.tolist()
        payload = torch.empty(n, dtype=torch.int64, device=self.group.device)
        if n:
            self._broadcast(payload, f"receiving {Op(op).name}")
        return Message(Op(op), payload, seq_len, arg)


def encode_tree(tree: DraftTree) -> torch.Tensor:
    """[3M + M*W] int64: tokens, parents, depths, then the visibility packed into
    W = ceil(M/64) words per row (``pack_bits``)."""
    return torch.cat(
        [
            tree.tokens.cpu(),
            tree.parents.cpu(),
            tree.depth.cpu(),
            pack_bits(tree.visibility.cpu()).flatten(),
        ]
    ).to(torch.int64)


def unpack_bits(words: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: [M, W] int64 -> [M, m] bool."""
    as_bytes = words.contiguous().view(torch.uint8)  # [M, 8W], little endian
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    bits = (as_bytes[..., None] >> shifts) & 1  # [M, 8W, 8]
    return bits.reshape(words.shape[0], -1)[:, :m].bool()


def decode_tree(payload: torch.Tensor, m: int) -> DraftTree:
    """The ``DraftTree`` of ``encode_tree``'s payload (scores are not sent: zeros)."""
    words = (m + 63) // 64
    tokens, parents, depth, bits = payload.split([m, m, m, m * words])
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depth=depth,
        scores=torch.zeros(m, dtype=torch.float64),
        visibility=unpack_bits(bits.view(m, words), m),
    )


# --- rank 0 -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionSpec:
    """What every rank loads for one parallel target (sent as JSON with ``Op.OPEN``)."""

    path: str
    ep: int
    dtype: str  # "float32", "bfloat16", ...
    attn_impl: str = "absorbed"
    capacity: int = 4096
    check_finite: bool = True


def load_shard(
    path: str | Path,
    plan: ParallelPlan,
    rank: int,
    reduce,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_impl: str = "absorbed",
    capacity: int = 4096,
    check_finite: bool = True,
) -> MlaMoeTarget:
    """Rank ``rank``'s shard of the target at ``path`` as a single-rank ``MlaMoeTarget`` whose
    sublayers call ``reduce`` (the group's all-reduce) on their partial outputs."""
    path = Path(path)
    config = MlaMoeConfig.from_hf(read_config(path), source=str(path / "config.json"))
    plan.check(config, str(path / "config.json"))
    ranges = plan.ranges(config, rank)
    shard = ranges.model_shard(lm_head=rank == 0, reduce=reduce)
    tensors = read_shard(path, config, ranges, shard, attn_impl, dtype)
    model = build_model(config, attn_impl, tensors, dtype, device, shard)
    return MlaMoeTarget(model, name=path.name, capacity=capacity, check_finite=check_finite)


def _load_local(group: Group, spec: SessionSpec) -> MlaMoeTarget:
    return load_shard(
        spec.path,
        ParallelPlan(group.world_size, spec.ep),
        group.rank,
        _all_reducer(group),
        getattr(torch, spec.dtype),
        group.device,
        spec.attn_impl,
        spec.capacity,
        spec.check_finite,
    )


def _all_reducer(group: Group):
    def reduce(x: torch.Tensor) -> torch.Tensor:  # [M, H] partial sums -> sums, in place
        try:
            dist.all_reduce(x)
        except (RuntimeError, dist.DistError) as err:
            raise group.failure("all-reduce", err) from None
        return x

    return reduce


def _load_agreed(group: Group, spec: SessionSpec, session: int) -> MlaMoeTarget:
    """Load this rank's shard; then every rank posts whether it loaded, so that a failure on
    any rank fails every rank (rank 0 raises its own error, or names the rank and its error)
    instead of leaving the others waiting in a collective."""
    local, error = None, None
    try:
        local = _load_local(group, spec)
    except Exception as err:
        error = err
    status = "" if error is None else f"{type(error).__name__}: {error}"
    failed = group.agree(f"loaded/{session}", status, f"loading shards of {spec.path}")
    if error is not None and group.rank == 0:
        raise error
    if failed:
        why = "; ".join(f"rank {r} could not load its shard: {msg}" for r, msg in failed.items())
        raise DistributedError(f"{group.describe}: {why}")
    return local


_SESSIONS = itertools.count()  # OPEN numbers on rank 0: store keys of one session's statuses
_OPEN_TARGETS: set[ParallelTarget] = set()  # until closed (a dropped target still holds ranks)


@atexit.register
def close_open_targets() -> None:
    """Close every open ParallelTarget of this process (the CLI's commands end with it, and
    so does the interpreter), releasing the other ranks."""
    for target in list(_OPEN_TARGETS):
        target.close()


class ParallelTarget:
    """Rank 0's ``Target`` over a tensor/expert-parallel group (see the module docstring).

    Build it with :func:`load_parallel_target` (or :meth:`open` on an existing group);
    ``close()`` releases the other ranks (also at interpreter exit).
    """

    engine_modes = ("eager",)  # see set_engine_mode

    def __init__(self, local: MlaMoeTarget, group: Group, channel: Channel, spec, owns_group):
        self.local = local
        self.group = group
        self.channel = channel
        self.spec = spec
        self.owns_group = owns_group
        self.config = local.config
        self.dtype, self.device = local.dtype, local.device
        with torch.device("meta"):
            whole = MlaMoeModel(local.config, spec.attn_impl)
        full = sum(p.numel() for p in whole.parameters())
        self.info = dataclasses.replace(local.info, n_params=full, tp=group.world_size, ep=spec.ep)
        self.closed = False
        _OPEN_TARGETS.add(self)

    @classmethod
    def open(cls, group: Group, spec: SessionSpec, owns_group: bool = False) -> ParallelTarget:
        """Every rank of ``group`` (the others in :func:`serve`) loads its shard of ``spec``."""
        if group.rank != 0:
            raise DistributedError(f"ParallelTarget lives on rank 0, not rank {group.rank}")
        channel = Channel(group)
        data = torch.frombuffer(
            bytearray(json.dumps(dataclasses.asdict(spec)).encode()), dtype=torch.uint8
        )
        session = next(_SESSIONS)
        channel.send(Op.OPEN, data.to(torch.int64), arg=session)
        return cls(_load_agreed(group, spec, session), group, channel, spec, owns_group)

    # --- Target protocol ----------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.local.seq_len

    @property
    def embed_tokens(self):
        return self.local.embed_tokens

    @property
    def lm_head(self):
        return self.local.lm_head

    def set_capture_layers(self, layer_ids: list[int]) -> None:
        self.local.set_capture_layers(layer_ids)  # hidden states are needed on rank 0 only

    def reset(self) -> None:
        self._send(Op.RESET)
        self.local.reset()

    def set_engine_mode(self, plan: EnginePlan) -> float:
        """Eager only (``engine_modes``, checked by the engine before this is called): every
        layer all-reduces across processes, which the compiled graphs do not capture here."""
        self._send(Op.RESET)
        return self.local.set_engine_mode(plan)

    def layout(self, tree: DraftTree):
        return self.local.layout(tree)

    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        self._send(Op.PREFILL, input_ids)
        return self.local.prefill(input_ids)

    def verify(self, tree: DraftTree, layout=None) -> TargetOutput:
        self._send(Op.VERIFY, encode_tree(tree), arg=tree.n_nodes)
        return self.local.verify(tree, layout)

    def commit(self, accepted: torch.Tensor) -> None:
        self._send(Op.COMMIT, accepted)
        self.local.commit(accepted)

    # --- lifecycle ----------------------------------------------------------------------------
    def _send(self, op: Op, payload: torch.Tensor | None = None, arg: int = 0) -> None:
        if self.closed:
            raise DistributedError("the parallel target is closed")
        self.channel.send(op, payload, self.seq_len, arg)

    def close(self) -> None:
        """End the session on every rank (and the group, when this target started it)."""
        if self.closed:
            return
        self.closed = True
        _OPEN_TARGETS.discard(self)
        try:
            self.channel.send(Op.CLOSE)
        except DistributedError:
            pass  # the other ranks are gone already
        if self.owns_group:
            release(self.group)

    def __enter__(self) -> ParallelTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- ranks > 0 --------------------------------------------------------------------------------


def _follow_verify(local: MlaMoeTarget, msg: Message) -> None:
    local.verify(decode_tree(msg.payload.cpu(), msg.arg))


FOLLOW = {
    Op.RESET: lambda local, msg: local.reset(),
    Op.PREFILL: lambda local, msg: local.prefill(msg.payload),
    Op.VERIFY: _follow_verify,
    Op.COMMIT: lambda local, msg: local.commit(msg.payload.cpu()),
}


def serve(group: Group) -> None:
    """The loop of ranks > 0: load the shards rank 0 asks for and make its Target calls on
    them, until ``Op.EXIT``.

    An input error (``ValueError``, e.g. a prompt past the position limit) raised by the
    same checks on every rank before the forward is skipped here; rank 0 raises it to its
    caller. A rank whose cache length disagrees with rank 0's fails the group."""
    channel = Channel(group)
    local: MlaMoeTarget | None = None
    while True:
        msg = channel.recv()
        if msg.op == Op.EXIT:
            return
        if msg.op == Op.CLOSE:
            local = None
            continue
        if msg.op == Op.OPEN:
            spec = SessionSpec(**json.loads(bytes(msg.payload.to(torch.uint8).tolist())))
            try:
                local = _load_agreed(group, spec, msg.arg)
            except (ValueError, OSError, DistributedError):  # rank 0 raises it: next OPEN
                local = None
            continue
        if local is None:
            raise DistributedError(f"rank {group.rank}: {msg.op.name} before OPEN")
        if msg.seq_len != local.seq_len:
            raise DistributedError(
                f"rank {group.rank}: {local.seq_len} cached tokens, rank 0 has {msg.seq_len}"
            )
        try:
            FOLLOW[msg.op](local, msg)
        except (ValueError, NonFiniteLogitsError):
            continue


def serve_spawned(group: Group, threads: int) -> None:
    """Entry of a spawned rank: the caller's torch thread count, then :func:`serve`."""
    torch.set_num_threads(threads)
    serve(group)


def load_parallel_target(
    path: str | Path,
    tp: int,
    ep: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_impl: str = "absorbed",
    capacity: int = 4096,
    check_finite: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
) -> ParallelTarget:
    """The MLA+MoE target at ``path`` split over ``tp`` ranks (routed experts in ``ep``
    groups).

    Under a launcher (torchrun: RANK/WORLD_SIZE set) this process joins the launched group;
    on ranks > 0 it then serves rank 0 until rank 0 closes the target and exits the process
    (``SystemExit(0)``), so the rest of the script runs on rank 0 only. Otherwise this process
    becomes rank 0 and spawns ranks 1 .. tp-1 itself.
    """
    path = Path(path)
    config = MlaMoeConfig.from_hf(read_config(path), source=str(path / "config.json"))
    ParallelPlan(tp, ep).check(config, str(path / "config.json"))  # before starting processes
    spec = SessionSpec(
        path=str(path.resolve()),
        ep=ep,
        dtype=str(dtype).removeprefix("torch."),
        attn_impl=attn_impl,
        capacity=capacity,
        check_finite=check_finite,
    )
    threads = (torch.get_num_threads(),)
    group = start_group(tp, serve_spawned, threads, device, timeout_s, ready_timeout_s)
    if group is None:  # a rank > 0 under torchrun: it served rank 0, which has closed
        raise SystemExit(0)
    try:
        return ParallelTarget.open(group, spec, owns_group=True)
    except BaseException:
        release(group)
        raise


def release(group: Group) -> None:
    """On rank 0: let the ranks in :func:`serve` exit, then leave the group."""
    try:
        Channel(group).send(Op.EXIT)
    except DistributedError:
        pass  # they are gone already
    group.close()
