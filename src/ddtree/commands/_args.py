"""argparse types and arguments shared by the commands (stdlib only, so light commands stay
light), the arguments both training commands take, and ``set_threads``, which applies
``--threads`` (it imports torch when called).

Each type rejects what the command cannot use with one line that argparse prefixes with the
argument's name: ``argument --budget: expected an integer in 1..8192, got '0'``. Floats must be
finite (``nan`` and ``inf`` parse as floats in Python; no command can use them).

One meaning per flag name across commands: ``--threads`` (torch CPU threads, the same default
everywhere), ``--dtype`` (one spelling per dtype), ``--json`` (one JSON document on stdout
instead of the tables), ``--records FILE`` (measurement records appended to FILE, checked by
``records_file`` when the command line is read, before any work).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit integer


def _bounds(low, high, low_open: bool = False) -> str:
    lo, hi = (f"{x:g}" if isinstance(x, float) else str(x) for x in (low, high))
    if high is None:
        return f"> {lo}" if low_open else f">= {lo}"
    return f"in ({lo}, {hi}]" if low_open else f"in {lo}..{hi}"


def int_in(low: int, high: int | None = None, what: str = "an integer") -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (``high`` None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {what} {_bounds(low, high)}, got {text!r}"
            ) from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what} {_bounds(low, high)}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


def float_in(
    low: float, high: float | None = None, low_open: bool = False, what: str = "a number"
) -> Callable[[str], float]:
    """An argparse type: a finite float >= ``low`` (> with ``low_open``), <= ``high``."""

    def parse(text: str) -> float:
        expected = f"expected a finite {what.removeprefix('a ')} {_bounds(low, high, low_open)}"
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
positive_float = float_in(0.0, low_open=True)
non_negative_float = float_in(0.0)
probability = float_in(0.0, 1.0, low_open=True, what="a probability")
seed = int_in(0, MAX_SEED, what="a seed")


# Torch's default is one thread per core. On a machine shared with other jobs, OpenMP threads
# spin at every barrier while a neighbour holds a core. Measured side by side on this project's
# shared 2-core machine (load average 2.3-3.1), torch's 2 threads against one, alternated:
# `generate --stats` (128 tokens) 62.5 / 53.3 / 81.5 vs 552 / 511 / 746 tok/s (one thread
# 8.8-9.6x faster); `replay record` (4 prompts x 64 tokens) 7.09 vs 0.86 s, then 0.78 vs 0.87 s;
# `train target` (8 steps) 4 vs 9 s, then 52 vs 8 s. Two threads gained at most 2.2x while the
# other core was free and lost up to 9.6x while it was not: one thread is the safe default.
# $OMP_NUM_THREADS, when set, is the user's choice.
DEFAULT_THREADS = 1
THREADS_ENV = "OMP_NUM_THREADS"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity; the machine's count where the platform
    has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def threads(text: str) -> int:
    """torch CPU threads: 0 (torch's default) up to this machine's CPU count."""
    return int_in(0, os.cpu_count() or 1, what="a thread count (0: torch's default)")(text)


def add_threads_argument(p: argparse.ArgumentParser, what: str = "torch CPU threads") -> None:
    """``--threads``, with the one default every command shares (see ``DEFAULT_THREADS``)."""
    p.add_argument(
        "--threads",
        type=threads,
        default=None,
        metavar="N",
        help=f"{what}; 0: torch's default (one per core) (default: ${THREADS_ENV} when set, "
        f"else {DEFAULT_THREADS}: safe on a shared machine, where torch's default ran up to 10x "
        "slower in our runs)",
    )


def _env_threads() -> int | None:
    """$OMP_NUM_THREADS as a positive count, or None (unset or not a single number)."""
    try:
        value = int(os.environ.get(THREADS_ENV, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def chosen_threads(requested: int | None) -> int | None:
    """The count ``--threads`` asks for: ``requested``; unset (None): $OMP_NUM_THREADS or
    ``DEFAULT_THREADS``; 0 stays 0 (torch's default)."""
    if requested is not None:
        return requested
    return _env_threads() or DEFAULT_THREADS


def set_threads(args: argparse.Namespace) -> int:
    """Apply ``--threads`` (see ``chosen_threads``); returns the thread count in use."""
    import torch

    n = chosen_threads(args.threads)
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def threads_label(args: argparse.Namespace) -> str:
    """What ``set_threads`` chose and why, for a command's output: ``1 thread (default)``."""
    import torch

    n = torch.get_num_threads()
    if args.threads is None:
        why = f"${THREADS_ENV}" if _env_threads() else "default; --threads N for more"
    elif args.threads == 0:
        why = "torch's default, --threads 0"
    else:
        why = "--threads"
    return f"{n} thread{'' if n == 1 else 's'} ({why})"


# One spelling per dtype, torch's (as vLLM's --dtype); the short forms are read as aliases.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32",
                 "bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16"}  # fmt: skip


def dtype_name(text: str) -> str:
    """An argparse type: a dtype's one spelling (``bf16`` -> ``bfloat16``)."""
    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPE_NAMES)}, got {text!r}")
    return name


dtype_name.__name__ = "dtype"


def add_dtype_argument(p: argparse.ArgumentParser, default: str, what: str) -> None:
    p.add_argument(
        "--dtype",
        type=dtype_name,
        default=default,
        metavar="{" + ",".join(DTYPE_NAMES) + "}",
        help=f"{what} (default: %(default)s)",
    )


def add_json_argument(p: argparse.ArgumentParser) -> None:
    """``--json``: one meaning in every command."""
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document to stdout instead of the tables (notes and progress "
        "go to stderr)",
    )


def add_training_arguments(p: argparse.ArgumentParser, defaults) -> None:
    """What ``train target`` and ``train drafter`` both take after their own arguments: peak
    learning rate, seed, corpus slice, checkpoint interval, resume, threads, progress
    (``defaults``: the recipe's config, for the rate, the seed and the interval)."""
    p.add_argument("--lr", type=positive_float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--seed", type=seed, default=defaults.seed, help="weights and data order")
    p.add_argument("--max-files", type=positive_int, default=None, help="first N corpus files only")
    p.add_argument(
        "--save-every", type=positive_int, default=defaults.save_every, help="checkpoint interval"
    )
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    add_threads_argument(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@contextmanager
def naming_the_checkpoint(out: Path, steps: int) -> Iterator[None]:
    """Around a training run: on an interrupt, say which checkpoint this run left (the
    training loop saves the last finished step's before the interrupt goes on;
    ``ddtree.signals``). A checkpoint older than the run is not this run's to name."""
    started = time.time()
    try:
        yield
    except KeyboardInterrupt:
        from ddtree.signals import keep
        from ddtree.train.state import CHECKPOINT_DIR, checkpoint_step

        ckpt = Path(out) / CHECKPOINT_DIR
        step = checkpoint_step(out)
        if step is not None and (ckpt / "state.json").stat().st_mtime >= started - 1:
            keep(
                ckpt,
                f"the checkpoint of step {step} of {steps} (the same command with --resume "
                "continues from it)",
            )
        raise


def training_config(cls, args: argparse.Namespace):
    """The training config dataclass ``cls`` from the parsed arguments of its field names."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def output_file(text: str) -> Path:
    """A file to write by replacing it (traces): what ``ddtree.files.check_output_file``
    accepts (a regular, writable file or a new path; not a folder, device or FIFO)."""
    from ddtree.files import check_output_file

    return _checked(check_output_file, text)


def records_file(text: str) -> Path:
    """A records file to append to: what ``ddtree.records.check_records_file`` accepts (also
    not a file of something else, such as a TOML scenario, nor one with other hard links)."""
    from ddtree.records import check_records_file

    return _checked(check_records_file, text)


def output_folder(text: str) -> Path:
    """A folder to write files into (``--out`` of training, ``--report``): what
    ``ddtree.files.check_output_folder`` accepts (an existing writable folder or a new path)."""
    from ddtree.files import check_output_folder

    return _checked(check_output_folder, text)


def _checked(check: Callable[[str], Path], text: str) -> Path:
    """``Path(text)`` once ``check`` accepts it; its OSError as argparse's one line."""
    try:
        check(text)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{exc.filename}: {exc.strerror}") from None
    return Path(text)


def int_list_upto(high: int | None) -> Callable[[str], list[int]]:
    """An argparse type: "8,16,32" -> [8, 16, 32], a non-empty list of integers in 1..high."""
    expected = f"comma-separated integers, each {_bounds(1, high)}"

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not values or min(values) < 1 or (high is not None and max(values) > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return values

    parse.__name__ = "integer list"
    return parse


int_list = int_list_upto(None)

AUTO = "auto"


def budget(text: str) -> int | str:
    """An argparse type: a DDTree budget N in 1..8192, or ``auto`` (each step chooses,
    ``ddtree.engine.budget``)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int_in(1, 8192, what="a budget")(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a budget in 1..8192 or 'auto', got {text!r}"
        ) from None


def budget_list(text: str) -> list[int | str]:
    """An argparse type: "8,32,auto" -> [8, 32, "auto"]."""
    values = [budget(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated budgets, got {text!r}")
    return values


def add_renamed(p: argparse.ArgumentParser, old: str, new: str, why: str) -> None:
    """A flag that moved: ``old`` is refused with one line naming ``new`` (hidden in --help)."""

    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{old} is now {new} here ({why})")

    p.add_argument(old, action=Renamed, nargs="?", help=argparse.SUPPRESS)


def add_alias(p: argparse.ArgumentParser, action: argparse.Action, alias: str) -> None:
    """``alias`` sets what ``action`` sets (vLLM's and SGLang's names for our flags). Its own
    entry stays out of --help (the action's help names it), and an error names the flag the
    user typed."""
    p.add_argument(
        alias,
        dest=action.dest,
        type=action.type,
        choices=action.choices,
        metavar=action.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


# ---- --device: one check of the string and of this machine, for every command ---------------

DEVICE_KINDS = ("cpu", "cuda", "mps", "xpu")  # where a command can run; meta holds no data


def machine_devices() -> list[str]:
    """The devices torch can use on this machine: ``cpu``, then ``cuda:0..`` (and ``mps``,
    ``xpu:0..`` where present)."""
    import torch

    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        names += [f"xpu:{i}" for i in range(xpu.device_count())]
    return names


def _device_count(kind: str) -> int:
    import torch

    if kind == "cpu":
        return 1
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return int(mps is not None and mps.is_available())
    module = getattr(torch, kind, None)
    return module.device_count() if module is not None and module.is_available() else 0


def device_problem(text: str, kinds: tuple[str, ...] = DEVICE_KINDS, indexed: bool = True):
    """Why ``text`` is not a device this command can run on here, or None when it is."""
    import torch

    if not text.strip():
        return "an empty device"
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        return "not a torch device"
    if dev.type == "meta":
        return "meta tensors hold no data, so nothing can run there"
    if dev.type not in kinds:
        return f"this command runs on {' or '.join(kinds)}"
    if dev.index is not None and not indexed:
        return f"this command takes {dev.type} without an index"
    count = _device_count(dev.type)
    if count == 0:
        if dev.type == "cuda" and not torch.backends.cuda.is_built():
            return "this torch is built without CUDA"
        return f"torch sees no {dev.type.upper()} device on this machine"
    if dev.index is not None and dev.index >= count:
        return f"torch sees {count} {dev.type.upper()} device{'s' if count > 1 else ''}"
    return None


def device(
    kinds: tuple[str, ...] = DEVICE_KINDS, auto: bool = False, indexed: bool = True
) -> Callable[[str], str]:
    """An argparse type: a torch device of one of ``kinds`` that this machine has (``cuda:7``
    only with 8 GPUs), or ``auto`` where the command takes it. The default ``cpu`` is accepted
    without importing torch. The error lists the devices this machine has."""

    def parse(text: str) -> str:
        if text == "cpu" or (auto and text == "auto"):
            return text
        why = device_problem(text, kinds, indexed)
        if why is None:
            return text
        have = [d for d in machine_devices() if d.split(":")[0] in kinds]
        if not indexed:
            have = list(dict.fromkeys(d.split(":")[0] for d in have))
        have = (["auto"] if auto else []) + have
        raise argparse.ArgumentTypeError(
            f"expected a device this machine has ({', '.join(have)}), got {text!r}: {why}"
        )

    parse.__name__ = "device"
    return parse


# ---- text a user gives (prompts, messages): UTF-8, checked before any tokenizer sees it -----
