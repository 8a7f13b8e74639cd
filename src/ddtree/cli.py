"""Command line: a thin table of subcommands.

Each subcommand lives in ``ddtree.commands.<module>`` and exposes
``add_arguments(parser)`` and ``run(args) -> int``. Command modules import heavy
libraries (torch, transformers) inside ``run`` only, so ``ddtree --help`` and
``ddtree estimate`` stay light.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings

from ddtree.errors import DistributedError, MissingExtraError, NonFiniteLogitsError
from ddtree.records import RecordWarning
from ddtree.signals import exit_code, handle_signals, interrupted_line
from ddtree.streams import BROKEN_PIPE_EXIT, broken_stdout, quiet_broken_stdout

# (command path, module, one-line help). A path of two words is a sub-subcommand.
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("demo",), "demo", "decode held-out prompts with AR, chain and DDTree on the bundled pair"),
    (("generate",), "generate", "stream a completion from a local target (and drafter)"),
    (("serve",), "serve", "an OpenAI-compatible HTTP server on the DDTree engine"),
    (
        ("estimate",),
        "estimate",
        "project decode tokens/s for hardware and drafters you do not have",
    ),
    (("tune",), "tune", "best budget per hardware from measured acceptance and the cost model"),
    (
        ("diagnose",),
        "diagnose",
        "attribute the tokens/s ratio of two engine runs to tau and stages",
    ),
    (("bench", "tree"), "bench_tree", "time top-k, tree build and verify layout"),
    (
        ("bench", "attention"),
        "bench_attention",
        "tree-verify attention without a dense mask against the dense mask: time, memory",
    ),
    (
        ("bench", "linear"),
        "bench_linear",
        "a model's linear weights per kernel against verify width M: what makes verify cheap",
    ),
    (("bench", "engine"), "bench_engine", "sweep policies and budgets; write measurement records"),
    (
        ("bench", "shapes"),
        "bench_shapes",
        "step costs at published model shapes (random weights, synthetic acceptance): the regime",
    ),
    (
        ("bench", "serve"),
        "bench_serve",
        "load a ddtree server: requests/s, latencies, HTTP overhead",
    ),
    (("bench", "bandwidth"), "bench_bandwidth", "measure memory bandwidth of this machine"),
    (("bench", "moe"), "bench_moe", "time one MoE layer forward against verify width M"),
    (
        ("bench", "allreduce"),
        "bench_allreduce",
        "all-reduce latency and bandwidth vs message size over N processes",
    ),
    (("replay", "record"), "replay_record", "record a greedy pass with the drafter's top-K"),
    (
        ("replay", "tau"),
        "replay_tau",
        "exact greedy tau of chain/DDTree at any budget, from a trace",
    ),
    (("replay", "check"), "replay_check", "compare replayed taus with the engine's, step by step"),
    (("train", "target"), "train_target", "train the bundled tiny MLA+MoE target"),
    (("train", "drafter"), "train_drafter", "train the bundled DFlash drafter on the target"),
]

DESCRIPTION = (
    "Lossless DDTree speculative decoding, its benchmarks, and grounded projections of decode "
    "tokens/s (`ddtree COMMAND --help` for one command)"
)

GROUP_HELP = {
    "bench": "measurement harnesses that write measurement records",
    "train": "reproduce the bundled demo models",
    "replay": "record a trace once, replay acceptance for any budget",
}


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (lists as ``8,16,32``), unless it has none
    (None, False, an empty list) or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or (isinstance(default, list) and not default)
            or not action.option_strings
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """An argument error is one line naming the argument (argparse's default prints the whole
    usage first); subcommand parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command table. Given ``argv``, only the command it names imports its module
    and adds its arguments (the others are listed by name and help), so ``ddtree --help`` and
    light commands do not import torch through a heavy command's defaults."""
    parser = _Parser(prog="ddtree", description=DESCRIPTION)
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text in COMMANDS:
        subparsers = top
        if len(path) == 2:
            group = path[0]
            if group not in groups:
                group_parser = top.add_parser(group, help=GROUP_HELP[group])
                groups[group] = group_parser.add_subparsers(dest="subcommand", metavar="WHAT")
                group_parser.set_defaults(_group_parser=group_parser)
            subparsers = groups[group]
        sub = subparsers.add_parser(
            path[-1], help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if argv is not None and tuple(argv[: len(path)]) != path:
            continue
        mod = importlib.import_module(f"ddtree.commands.{module}")
        mod.add_arguments(sub)
        sub.set_defaults(_run=mod.run)
    return parser


_default_showwarning = warnings.showwarning


def _showwarning(message, category, filename, lineno, file=None, line=None) -> None:
    """A skipped record (newer schema, truncated line) is one line: ``warning: file:line: ...``."""
    if issubclass(category, RecordWarning):
        print(f"warning: {message}", file=sys.stderr)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _showwarning
    from_command_line = argv is None
    if from_command_line:  # closed streams refused when used, unencodable text replaced
        from ddtree import streams

        streams.prepare()
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        (getattr(args, "_group_parser", None) or parser).print_help()
        return 2
    code = _run_command(run, args)
    if from_command_line and getattr(args, "_quick_exit", False):
        # a server that has answered, written and closed everything: leave without the
        # interpreter's teardown of torch and the models (over a second), so a stop signal's
        # exit comes within the drain it promised
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing more to say
                pass
        os._exit(code)
    return code


def _run_command(run, args: argparse.Namespace) -> int:
    with handle_signals():
        try:
            return int(run(args) or 0)
        except BrokenPipeError:
            # stdout's reader has gone (`ddtree generate | head -c 5`): end quietly, with the
            # status of a program SIGPIPE ended (141), as `yes | head` does
            if not broken_stdout() or os.environ.get("DDTREE_DEBUG"):
                print(f"error: {_describe(sys.exc_info()[1])}", file=sys.stderr)
                return 2
            quiet_broken_stdout()
            return BROKEN_PIPE_EXIT
        except (
            ValueError,
            OSError,
            NonFiniteLogitsError,
            DistributedError,
            MissingExtraError,
        ) as e:
            # bad input (files, fields, arguments), a file that cannot be read or written, a
            # model emitting NaN/inf, or an optional extra not installed: the message names
            # it; DDTREE_DEBUG=1 re-raises
            if os.environ.get("DDTREE_DEBUG"):
                raise
            print(f"error: {_describe(e)}", file=sys.stderr)
            return 2
        except (MemoryError, RuntimeError) as e:
            # sizes too large for this machine (a huge --vocab, --samples, ...): one line
            if not _out_of_memory(e) or os.environ.get("DDTREE_DEBUG"):
                raise
            print(
                f"error: out of memory ({_allocation(e)}); ask for smaller sizes", file=sys.stderr
            )
            return 2
        except KeyboardInterrupt as e:
            # Ctrl-C or SIGTERM (ddtree.signals): what the command kept, and 130 / 143
            print(interrupted_line(e), file=sys.stderr)
            return exit_code(e)
        finally:
            parallel = sys.modules.get("ddtree.models.adapters.parallel")
            if parallel is not None:  # release the ranks of --tp targets the command opened
                parallel.close_open_targets()


def _out_of_memory(e: BaseException) -> bool:
    """MemoryError (numpy, Python), or torch's allocation failures (CPU allocator RuntimeError,
    CUDA ``OutOfMemoryError``)."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    return "can't allocate memory" in str(e)


def _allocation(e: BaseException) -> str:
    """What failed to allocate, in one line: torch's ``you tried to allocate N bytes`` as GB."""
    match = re.search(r"tried to allocate (\d+) bytes", str(e))
    if match:
        return f"tried to allocate {int(match.group(1)) / 1e9:,.1f} GB"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _describe(e: BaseException) -> str:
    """One line: an OSError as ``file: reason`` (its str() starts with ``[Errno N]``)."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split()) or type(e).__name__
