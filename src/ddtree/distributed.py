"""Process groups over ``torch.distributed`` for the parallel target and ``bench allreduce``.

Two ways to start a group of ``world_size`` ranks:

- **spawned** (:func:`spawn_group`): the calling process is rank 0 and starts ranks
  ``1 .. world_size - 1`` itself (``multiprocessing`` "spawn"); they meet through a TCP store
  on 127.0.0.1 at a free port. This is what ``ddtree generate --tp 2`` does.
- **torchrun** (:func:`join_launched_group`): every rank runs the same command and
  ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` come from the launcher::

      torchrun --nproc-per-node 2 -m ddtree generate --tp 2 --prompt "def f"

Backend: gloo on CPU, NCCL on CUDA (rank ``r`` uses ``cuda:LOCAL_RANK``).

Two timeouts. ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`) bounds every collective: a rank
that dies closes its sockets and the others fail at their next collective at once; a rank that
stalls makes them fail after ``timeout_s``. ``ready_timeout_s`` (default
:data:`DEFAULT_READY_TIMEOUT_S`) bounds the waits for every rank to start and to load its
shard, which take long for big checkpoints; rank 0 stops waiting early when a spawned rank
exits. Either way the ranks raise :class:`~ddtree.errors.DistributedError` naming the ranks,
their exit codes and the errors they reported (through the store) before dying.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddtree.errors import DistributedError

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_READY_TIMEOUT_S = 900.0  # as torchrun's own rendezvous timeout
# The least collective timeout a command takes: the group forms within it too (gloo counts it in
# whole milliseconds; 1e-9 s was 0 ms, a group that never forms).
MIN_TIMEOUT_S = 1.0
LOCALHOST = "127.0.0.1"
# Seconds to wait for a spawned rank's exit code when explaining a failed collective.
EXIT_GRACE_S = 2.0
POLL_S = 0.05
ERROR_KEY = "ddtree/error/{rank}"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def backend_for(device: torch.device | str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    """True when the launcher (torchrun or an equivalent) set RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _exit_codes(processes: list, wait_s: float = 0.0) -> dict[int, int]:
    """``{rank: exit code}`` of spawned ranks (rank i + 1 is processes[i]) that have exited."""
    codes = {}
    for rank, process in enumerate(processes, start=1):
        if wait_s:
            process.join(wait_s)
        if process.exitcode is not None:
            codes[rank] = process.exitcode
    return codes


def wait_for_keys(
    store: dist.Store, keys: dict[int, str], what: str, timeout_s: float, processes: list = ()
) -> dict[int, str]:
    """Wait until every rank has set its key (``{rank: key}``); returns ``{rank: value}``.
    Raises DistributedError after ``timeout_s``, or as soon as a spawned rank has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        present = {r for r, k in keys.items() if store.check([k])}
        if len(present) == len(keys):
            return {r: store.get(k).decode(errors="replace") for r, k in keys.items()}
        missing = sorted(set(keys) - present)
        exited = {r: c for r, c in _exit_codes(list(processes)).items() if r in missing}
        if exited or time.monotonic() > deadline:
            why = ", ".join(f"rank {r} exited with code {c}" for r, c in exited.items())
            why = why or f"no word from rank(s) {missing} within {timeout_s:g} s"
            raise DistributedError(f"{what}: {len(present)} of {len(keys)} ranks ready ({why})")
        time.sleep(POLL_S)


@dataclass
class Group:
    """One process group: this rank's view (the default ``torch.distributed`` group)."""

    rank: int
    world_size: int
    backend: str
    device: torch.device  # this rank's device for collectives and models
    timeout_s: float  # one collective
    ready_timeout_s: float  # every rank started / loaded
    store: dist.Store | None  # None once a launched rank has closed the group
    launcher: str  # "spawned" | "torchrun"
    processes: list = field(default_factory=list)  # spawned ranks (on rank 0 only)

    @property
    def describe(self) -> str:
        return f"{self.world_size}-rank {self.backend} group ({self.launcher})"

    def agree(self, key: str, status: str, what: str) -> dict[int, str]:
        """Every rank posts ``status`` ("" for success) under ``key``; returns the non-empty
        statuses ``{rank: status}`` once all ranks have posted (store-based, so a slow rank
        gets ``ready_timeout_s``, not the collective timeout)."""
        self.store.set(f"ddtree/{key}/{self.rank}", status)
        keys = {r: f"ddtree/{key}/{r}" for r in range(self.world_size)}
        posted = wait_for_keys(self.store, keys, what, self.ready_timeout_s, self.processes)
        return {r: s for r, s in posted.items() if s}

    def _wait_until_all_left(self) -> None:
        """Ranks > 0 post that they left; rank 0 waits for every such post (bounded by the
        ready timeout: a rank that died posts nothing, and rank 0 leaves anyway)."""
        try:
            if self.rank:
                self.store.set(f"ddtree/left/{self.rank}", "")
                return
            keys = [f"ddtree/left/{r}" for r in range(1, self.world_size)]
            self.store.wait(keys, _timedelta(self.ready_timeout_s))
        except Exception:  # the group is over: a rank that is gone is not an error
            pass

    def report_error(self, message: str) -> None:
        """Leave ``message`` in the store for the other ranks' error messages."""
        try:
            self.store.set(ERROR_KEY.format(rank=self.rank), message)
        except Exception:  # the store's host (rank 0) may be gone already
            pass

    def reported_errors(self) -> dict[int, str]:
        """``{rank: message}`` left by other ranks that failed (never blocks)."""
        found = {}
        for rank in range(self.world_size):
            key = ERROR_KEY.format(rank=rank)
            try:
                if rank != self.rank and self.store.check([key]):
                    found[rank] = self.store.get(key).decode(errors="replace")
            except Exception:
                break
        return found

    def failure(self, what: str, err: BaseException) -> DistributedError:
        """A DistributedError for a failed ``what`` (a collective), with what is known of why:
        the errors ranks reported and the exit codes of spawned ranks."""
        reasons = [f"rank {r} reported: {msg}" for r, msg in self.reported_errors().items()]
        wait_s = EXIT_GRACE_S if not reasons else 0.1
        for rank, code in _exit_codes(self.processes, wait_s).items():
            if code != 0:
                reasons.append(f"rank {rank} exited with code {code}")
        if not reasons:
            first_line = (str(err).strip() or type(err).__name__).splitlines()[0]
            reasons.append(
                f"a rank died or stalled past the {self.timeout_s:g} s collective timeout "
                f"({first_line})"
            )
        return DistributedError(
            f"{self.describe}, rank {self.rank}: {what} failed: " + "; ".join(reasons)
        )

    def close(self) -> None:
        """Leave the group; on rank 0, wait for the other ranks to have left (under a launcher
        rank 0 hosts the store the others tear down with: leaving first made a rank abort at
        exit in about 1 run of 4) and for spawned ranks to exit. A launched rank then frees its
        store client here, while Python runs: left to the interpreter's exit, its destructor ran
        after Python's own teardown and aborted the rank ('terminate called without an active
        exception', SIGABRT) in 7 of 105 torchrun runs on a loaded 2-core machine; 0 of 140
        since."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.launcher == "torchrun":
            self._wait_until_all_left()
            self.store = None
            gc.collect()  # the process group's own references to it go with it
        for process in self.processes:
            process.join(EXIT_GRACE_S)
            if process.is_alive():
                process.terminate()
                process.join(EXIT_GRACE_S)
        self.processes = []


def _not_formed(rank: int, world_size: int, timeout_s: float, err: BaseException):
    return DistributedError(
        f"rank {rank}: the {world_size}-rank group did not form within {timeout_s:g} s (are "
        f"all {world_size} ranks started, with the same --tp?): "
        f"{(str(err).strip() or type(err).__name__).splitlines()[0]}"
    )


def _init(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
    ready_timeout_s: float,
    launcher: str,
    processes: list = (),
) -> Group:
    """Wait (store-based) for every rank, then form the default process group."""
    if dist.is_initialized():
        raise DistributedError("a torch.distributed group is already initialised in this process")
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    group = Group(rank, world_size, backend, device, timeout_s, ready_timeout_s, store, launcher)
    group.processes = list(processes)
    try:
        group.agree(f"joined/{attempt}", "", f"rank {rank}: forming the {world_size}-rank group")
    except DistributedError as err:
        raise _not_formed(rank, world_size, ready_timeout_s, err) from None
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"ddtree/pg/{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=_timedelta(timeout_s),
        )
    except (RuntimeError, dist.DistError) as err:
        raise _not_formed(rank, world_size, timeout_s, err) from None
    return group


def _rank_device(device: torch.device | str, local_rank: int) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.device("cuda", local_rank)
    return device


def join_launched_group(
    world_size: int,
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
) -> Group:
    """Join the group a launcher (torchrun) started; its WORLD_SIZE must equal ``world_size``."""
    missing = [v for v in LAUNCHER_VARS if v not in os.environ]
    if missing:
        raise DistributedError(f"launcher environment incomplete: {', '.join(missing)} not set")
    launched = int(os.environ["WORLD_SIZE"])
    if launched != world_size:
        raise DistributedError(
            f"the launcher started WORLD_SIZE={launched} ranks but --tp {world_size} was asked: "
            f"start torchrun with --nproc-per-node {world_size}"
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=_timedelta(ready_timeout_s)))
    except (RuntimeError, ValueError, dist.DistError) as err:
        raise _not_formed(rank, world_size, ready_timeout_s, err) from None
    device = _rank_device(device, local_rank)
    return _init(store, rank, world_size, device, timeout_s, ready_timeout_s, "torchrun")


def _spawned_main(
    entry: Callable,
    rank: int,
    world_size: int,
    port: int,
    device: str,
    timeouts: tuple[float, float],
    args: tuple,
) -> None:
    """Body of a spawned rank: join the group, run ``entry(group, *args)``, report failures."""
    timeout_s, ready_timeout_s = timeouts
    store = dist.TCPStore(LOCALHOST, port, world_size, False, timeout=_timedelta(ready_timeout_s))
    device = _rank_device(device, rank)
    group = _init(store, rank, world_size, device, timeout_s, ready_timeout_s, "spawned")
    try:
        _run_entry(group, entry, args)
    except BaseException as err:  # noqa: B036 - reported to rank 0; exit non-zero
        if not isinstance(err, DistributedError | KeyboardInterrupt):
            traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_entry(group: Group, entry: Callable, args: tuple) -> None:
    """A rank > 0 runs ``entry(group, *args)``; any failure is reported to rank 0 (which raises
    it naming the rank) and re-raised, however the rank was started."""
    try:
        entry(group, *args)
    except BaseException as err:  # noqa: B036 - report anything
        group.report_error(f"{type(err).__name__}: {err}")
        raise


def spawn_group(
    world_size: int,
    entry: Callable,
    args: tuple = (),
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
) -> Group:
    """Become rank 0 of a new group; ranks ``1 .. world_size - 1`` run ``entry(group, *args)``
    in spawned processes (``entry`` must be importable: a module-level function)."""
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 to spawn a group, got {world_size}")
    store = dist.TCPStore(
        LOCALHOST, 0, world_size, True, timeout=_timedelta(ready_timeout_s), wait_for_workers=False
    )
    ctx = multiprocessing.get_context("spawn")
    processes = []
    for rank in range(1, world_size):
        process = ctx.Process(
            target=_spawned_main,
            args=(
                entry,
                rank,
                world_size,
                store.port,
                str(device),
                (timeout_s, ready_timeout_s),
                args,
            ),
            name=f"ddtree-rank{rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)
    try:
        return _init(
            store,
            0,
            world_size,
            _rank_device(device, 0),
            timeout_s,
            ready_timeout_s,
            "spawned",
            processes,
        )
    except DistributedError:
        for process in processes:
            process.terminate()
        raise


def start_group(
    world_size: int,
    entry: Callable,
    args: tuple = (),
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
) -> Group | None:
    """Rank 0's group, however the ranks start: under a launcher (torchrun) this process joins
    the launched group, and on ranks > 0 runs ``entry(group, *args)``, leaves the group and
    returns None; otherwise this process becomes rank 0 and spawns the others running
    ``entry``."""
    if not launched_by_torchrun():
        return spawn_group(world_size, entry, args, device, timeout_s, ready_timeout_s)
    group = join_launched_group(world_size, device, timeout_s, ready_timeout_s)
    if group.rank == 0:
        return group
    try:
        _run_entry(group, entry, args)
    finally:
        group.close()
    return None
