"""Every command in the code blocks of README.md and docs/*.md runs as written, in each
document's order, in one working folder per document (so `runs/engine.jsonl` written by one
command is what a later one of the same document reads; a document needs no other's files).

- Shell lines (``ddtree``, ``torchrun``, ``curl``, ``echo``) run through bash with this
  install's ``bin`` first on PATH; ``python`` blocks run with this interpreter. Placeholders
  take their meaning from the documents: ``--target DIR`` is the bundled target with a chat
  template added, in a folder named ``MODEL`` (the id ``ddtree serve`` gives it), ``--drafter
  DIR`` the bundled drafter, ``TEXT`` a prompt. Ports 8000 and 8001 become free ones.
- Sizes: each command's ``SIZES`` flags go right after the subcommand, before the document's
  own flags, so whatever the document sets wins (argparse keeps the last value) and only the
  defaults it leaves shrink: fewer prompts, tokens, repeats, samples, steps. Nothing a
  document asks for is dropped, but for one thing: a real model shape (``--preset NAME`` of
  ``bench shapes`` and ``bench linear``) runs as ``REAL_SHAPE_IN_TESTS``, see there.
- ``ddtree serve`` lines start a server that the ``curl`` and ``python`` blocks and ``bench
  serve --url`` after them in the same document talk to (stopped when the next document
  starts, and at the end).
- Cheap commands (the estimator's but its corpus validation, eager ``generate``, ``python``
  blocks that need no server) run in the fast suite; the rest are
  marked slow (CI runs them). ``SKIPPED`` names the commands no CPU machine can run, or that
  another test runs already, with the reason; every other command must pass.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddtree.cli import COMMANDS
from ddtree.commands._decode import DEMO_DIR

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = ("ddtree", "torchrun", "curl", "echo", "make")
TIMEOUT_S = 900  # one command, generously: a cold compile cache on a loaded 2-core machine

SIZES: dict[tuple[str, ...], list[str]] = {
    ("demo",): ["--n-prompts", "1", "--max-new-tokens", "8"],
    ("generate",): ["--max-new-tokens", "8"],
    ("bench", "engine"): ["--n-prompts", "1", "--max-new-tokens", "8"],
    ("bench", "shapes"): ["--preset", "tiny-qwen3", "--dtype", "float32", "--budgets", "8",
                          "--prompts", "1", "--context", "16", "--max-new-tokens", "8",
                          "--engine-modes", "eager"],
    ("bench", "linear"): ["--preset", "tiny-qwen3", "--ms", "1,9", "--repeats", "2",
                          "--set-mb", "1"],
    ("bench", "attention"): ["--contexts", "64", "--budgets", "8", "--heads", "4", "--kv-heads",
                             "2", "--head-dim", "16", "--repeats", "2"],
    ("bench", "tree"): ["--vocab", "4096", "--budgets", "16,64", "--batch", "1,4", "--repeats", "3"],
    ("bench", "bandwidth"): ["--sizes-mib", "64", "--repeats", "3", "--warmup", "1"],
    ("bench", "moe"): ["--hidden", "256", "--moe-intermediate", "64", "--experts", "32",
                       "--ms", "1,8", "--repeats", "2"],
    ("bench", "allreduce"): ["--m", "1,1024", "--repeats", "5", "--iters", "4"],
    ("bench", "serve"): ["--repeats", "2", "--max-new-tokens", "8"],
    ("estimate",): ["--samples", "500"],
    ("tune",): ["--samples", "300"],
    ("replay", "record"): ["--n-prompts", "2", "--max-new-tokens", "16", "--candidates", "64"],
    ("replay", "check"): ["--n-prompts", "1", "--budgets", "4"],
    ("train", "target"): ["--steps", "2", "--max-files", "4", "--batch-size", "2",
                          "--seq-len", "64", "--save-every", "2"],
    ("train", "drafter"): ["--steps", "2", "--max-files", "4", "--n-sequences", "4",
                           "--new-tokens", "24", "--seqs-per-step", "2", "--eval-prompts", "1",
                           "--save-every", "2"],
    ("serve",): ["--max-new-tokens", "16"],
}  # fmt: skip

# A real model shape is gigabytes of random weights and minutes a command (qwen3-4b in float32 is
# 16 GB, and took 7 minutes here): the README's `--preset NAME` runs as the tiny preset, the same
# code at a size this suite affords. The real presets' shapes and memory plans are tested in
# tests/models/test_presets.py; their step costs are measured (docs/measurements.md: "Where
# DDTree pays").
REAL_SHAPE = re.compile(r"--preset (?!tiny-)[\w.-]+")
REAL_SHAPE_IN_TESTS = "--preset tiny-qwen3"

SKIPPED = {
    "make demo": "runs `ddtree demo` in .venv, which runs as written below",
    "make test": "this test suite itself",
    "ddtree estimate --validate": "scores the bundled corpus (76 fits, about 4.5 minutes on two "
    "cores): tests/perf/test_validate.py::test_bundled_corpus_is_scored_train_and_test runs it",
    "torchrun --nnodes 2": "needs two machines with 8 CUDA GPUs each",
    "torchrun --nproc-per-node 8 -m ddtree bench allreduce --tp 8 --device cuda": "needs 8 GPUs",
}


@dataclass(frozen=True)
class Command:
    line: int  # where it starts in its document
    text: str  # as written, continuation lines joined
    python: bool = False
    doc: str = "README.md"  # the document, relative to the repository root

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def path(self) -> tuple[str, ...] | None:
        """The ddtree command it runs (``("bench", "engine")``), or None."""
        match = re.search(r"\bddtree ((?:[a-z]+ ?){1,2})", self.text)
        if match is None:
            return None
        words = tuple(match.group(1).split())
        known = {p for p, _, _ in COMMANDS}
        return words if words in known else words[:1] if words[:1] in known else None

    @property
    def skipped(self) -> str | None:
        return next((why for start, why in SKIPPED.items() if self.text.startswith(start)), None)

    @property
    def fast(self) -> bool:
        """Cheap and reading only committed files: in the fast suite."""
        if self.python:
            return "127.0.0.1:" not in self.text  # a library example, not a server's client
        if self.path is None or "runs/" in self.text.replace("--report runs/", ""):
            return False
        if self.path == ("estimate",):
            return "--validate" not in self.text  # scoring the whole corpus takes minutes
        return self.path == ("generate",) and not re.search(r"--tp|compiled", self.text)


def readme_commands(text: str, doc: str = "README.md") -> list[Command]:
    """The commands of a document's fenced code blocks: python blocks whole; in the others,
    each line (with its continuations) that starts with one of ``PROGRAMS``. A block with no
    such line is not commands (the layout tree); one that mixes them with other lines fails."""
    out, block, fence, start = [], [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"\s*```(\w*)\s*$", line)
        if opening and fence is None:
            fence, block, start = opening.group(1), [], number + 1
        elif line.strip() == "```" and fence is not None:
            out += _block_commands(block, start, fence == "python", doc)
            fence = None
        elif fence is not None:
            block.append(line)
    return out


def _block_commands(lines: list[str], start: int, python: bool, doc: str) -> list[Command]:
    if python:
        return [Command(start, "\n".join(lines), python=True, doc=doc)]
    commands, joined, first = [], "", None
    for number, line in enumerate(lines, start):
        stripped = line.strip()
        if first is None:
            first = number
        joined += (
            stripped.removesuffix("\\").rstrip() + " " if stripped.endswith("\\") else stripped
        )
        if stripped.endswith("\\"):
            continue
        if joined:
            commands.append(Command(first, joined, doc=doc))
        joined, first = "", None
    ours = [c for c in commands if c.text.split()[0] in PROGRAMS]
    if ours and len(ours) != len(commands):
        bad = next(c for c in commands if c not in ours)
        raise AssertionError(f"{bad.where}: not a command in a block of commands")
    return ours


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


COMMANDS_IN_DOCS = [
    c for path in DOCUMENTS for c in readme_commands(path.read_text(), _name(path))
]  # README.md's first, then docs/*.md's, each in its own order


def test_the_readme_has_the_commands_this_test_expects():
    assert len(COMMANDS_IN_DOCS) >= 50
    paths = {c.path for c in COMMANDS_IN_DOCS if c.path}
    assert {p for p, _, _ in COMMANDS} - paths == set()  # every ddtree command is shown
    for start in SKIPPED:  # no exception outlives the command it was for
        assert sum(c.text.startswith(start) for c in COMMANDS_IN_DOCS) == 1, start
    assert set(SIZES) <= paths
    readme = [c for c in COMMANDS_IN_DOCS if c.doc == "README.md"]
    assert [c.text.split("#")[0].strip() for c in readme[:2]] == ["make demo", "make test"]
    assert any(c.python and c.fast for c in readme)  # the README's library example


def test_the_readme_stays_a_front_door_that_links_every_document():
    text = README.read_text()
    assert len(text.splitlines()) <= 160
    for doc in DOCUMENTS[1:]:
        assert f"]({_name(doc)}" in text, f"README.md does not link {_name(doc)}"


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_documents_links_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists, and an anchor
    (``file.md#part``) one of that file's headings."""
    bad = []
    for doc in DOCUMENTS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                bad.append(f"{_name(doc)}: {target}: no such file")
            elif anchor and path.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    bad.append(f"{_name(doc)}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def test_sizes_go_before_the_readme_flags_so_the_readme_wins():
    cmd = Command(1, 'echo "x" | ddtree generate --prompt-file - --max-new-tokens 3')
    assert _sized(cmd.text) == (
        'echo "x" | ddtree generate --max-new-tokens 8 --prompt-file - --max-new-tokens 3'
    )
    assert _sized("torchrun --nproc-per-node 2 -m ddtree bench engine --tp 2").endswith(
        "-m ddtree bench engine --n-prompts 1 --max-new-tokens 8 --tp 2"
    )


def test_real_model_shapes_run_as_the_tiny_preset():
    real = [c for c in COMMANDS_IN_DOCS if REAL_SHAPE.search(c.text)]
    assert real  # the README shows real shapes: otherwise this exception has outlived its use
    for c in real:
        assert REAL_SHAPE.sub(REAL_SHAPE_IN_TESTS, c.text).count("--preset tiny-qwen3") == 1


def _sized(text: str) -> str:
    def insert(match: re.Match) -> str:
        words = tuple(match.group(2).split())
        path = words if words in SIZES else words[:1]
        return (
            match.group(0) if path not in SIZES else f"{match.group(0)} {shlex.join(SIZES[path])}"
        )

    return re.sub(r"(\bddtree) ((?:[a-z]+)(?: (?!-)[a-z]+)?)(?=\s|$)", insert, text)


# ---- running them ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workspace:
    """One document's working folder, the placeholders' values and the servers started so
    far."""

    def __init__(self, root: Path) -> None:
        from tests.serve.helpers import chat_checkpoint

        self.root = root
        for name in ("examples", "measurements"):
            (root / name).symlink_to(ROOT / name)
        self.model = chat_checkpoint(root / "checkpoints" / "MODEL")
        self.ports = {8000: _free_port(), 8001: _free_port()}
        self.servers: dict[int, object] = {}  # documented port -> ServerProcess
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"
        self.env.pop("COLUMNS", None)

    def substitute(self, text: str) -> str:
        text = text.replace("--target DIR", f"--target {self.model}")
        text = text.replace("--drafter DIR", f"--drafter {DEMO_DIR / 'drafter'}")
        text = re.sub(r"\bTEXT\b", "'def parse('", text)
        for documented, real in self.ports.items():
            text = text.replace(f"127.0.0.1:{documented}", f"127.0.0.1:{real}")
        return text

    def run(self, command: Command) -> subprocess.CompletedProcess:
        text = self.substitute(command.text)
        if command.python:
            argv = [sys.executable, "-c", text]
        else:
            argv = [
                "bash",
                "-o",
                "pipefail",
                "-c",
                _sized(REAL_SHAPE.sub(REAL_SHAPE_IN_TESTS, text)),
            ]
        return subprocess.run(
            argv, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=TIMEOUT_S
        )

    def serve(self, command: Command) -> None:
        """Start the server the line describes on the free port standing for its documented
        port; a later line for the same documented port replaces it."""
        from ddtree.serve.loadgen import server_process

        argv = shlex.split(self.substitute(command.text), comments=True)[2:]
        port_named = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8000
        argv = [a for i, a in enumerate(argv) if "--port" not in (a, argv[i - 1] if i else "")]
        argv = [*SIZES[("serve",)], *argv, "--port", str(self.ports[port_named])]
        if port_named in self.servers and self.servers[port_named][2] == argv:
            return  # the same server again: it is up
        self.stop(port_named)
        log = self.root / f"serve-{port_named}.log"
        context = server_process(argv, log, self.env, timeout_s=TIMEOUT_S)
        server = context.__enter__()
        self.servers[port_named] = (context, server, argv)

    def stop(self, port_named: int | None = None) -> None:
        for port in [port_named] if port_named is not None else list(self.servers):
            if port in self.servers:
                context, _, _ = self.servers.pop(port)
                context.__exit__(None, None, None)


class Workspaces:
    """A working folder per document, made when its first command runs; moving on to another
    document stops the servers of the one before."""

    def __init__(self, tmp_path_factory) -> None:
        self.factory = tmp_path_factory
        self.spaces: dict[str, Workspace] = {}

    def __getitem__(self, doc: str) -> Workspace:
        if doc not in self.spaces:
            self.stop()
            folder = self.factory.mktemp(re.sub(r"\W+", "-", doc.removesuffix(".md")))
            self.spaces[doc] = Workspace(folder)
        return self.spaces[doc]

    def stop(self) -> None:
        for space in self.spaces.values():
            space.stop()


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    spaces = Workspaces(tmp_path_factory)
    yield spaces
    spaces.stop()


def _params():
    for c in COMMANDS_IN_DOCS:
        if c.skipped:
            continue
        yield pytest.param(c, marks=[] if c.fast else [pytest.mark.slow], id=c.where)


@pytest.mark.parametrize("command", list(_params()))
def test_the_documented_command_runs_as_written(command, workspaces):
    workspace = workspaces[command.doc]
    if command.path == ("serve",) and not command.python:
        workspace.serve(command)
        return
    if command.text.startswith("curl") or command.python:
        needed = [p for p in (8000, 8001) if f":{p}" in command.text]
        missing = [p for p in needed if p not in workspace.servers]
        assert not missing, f"{command.where} needs the server of port {missing}"
    done = workspace.run(command)
    where = f"{command.where}: {command.text}\n--- stderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, where
    assert done.stdout.strip(), where  # every command prints its answer on stdout
    if command.text.startswith("curl"):
        assert '"error"' not in done.stdout, where
