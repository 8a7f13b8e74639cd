"""Locales and standard streams (issue 30 item 8), on real ``python -m ddtree`` children.

- Under ``LC_ALL=C PYTHONUTF8=0`` (an ASCII locale) and with a latin-1 stdout, ``ddtree
  estimate`` reads its UTF-8 data files and scenario and prints its whole answer (``--explain``
  included): what the terminal cannot hold becomes ``?``, it does not stop the command.
- A stdout closed before the command starts (``>&-``) is an error when the answer is written
  (exit 2, one line naming stdout), not an exit 0 with the answer lost; a closed stdin read by
  ``--prompt-file -`` is one line naming it; never a traceback.
- A stdout whose reader has gone (``ddtree generate | head -c 5``) ends the command quietly,
  nothing on stderr, with the status a shell gives a program that ``SIGPIPE`` killed: 141
  (128 + 13), the conventional behaviour of ``yes | head`` and ``cat file | head``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ddtree

ROOT = Path(__file__).resolve().parents[1]
SRC = str(Path(ddtree.__file__).resolve().parents[1])
SEED = str(ROOT / "examples" / "seed_kimi_b300.toml")
GENERATE = ["generate", "--prompt", "hi", "--max-new-tokens", "8"]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC, **extra}
    env.pop("DDTREE_DEBUG", None)
    return env


def _ddtree(argv: list[str], shell_redirect: str = "", **env: str):
    """``python -m ddtree ARGV`` (through ``bash -c 'exec ... REDIRECT'`` when given)."""
    cmd = [sys.executable, "-m", "ddtree", *argv]
    if shell_redirect:
        cmd = ["bash", "-c", f'exec "$@" {shell_redirect}', "ddtree", *cmd]
    return subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, timeout=300)


def _lines(err: bytes) -> list[str]:
    return [x for x in err.decode("utf-8", "replace").splitlines() if not x.startswith("note:")]


LOCALES = {  # name: (environment, the encoding stdout then has)
    "C": ({"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}, "ascii"),
    "latin-1": ({"PYTHONIOENCODING": "latin-1", "PYTHONUTF8": "0"}, "latin-1"),
}


@pytest.mark.parametrize("locale", list(LOCALES))
@pytest.mark.parametrize("explain", [False, True], ids=["answer", "explain"])
def test_estimate_prints_its_whole_answer_in_any_locale(locale, explain):
    argv = ["estimate", SEED] + (["--explain"] if explain else [])
    utf8 = _ddtree(argv, PYTHONIOENCODING="utf-8")
    assert utf8.returncode == 0, utf8.stderr
    env, encoding = LOCALES[locale]
    run = _ddtree(argv, **env)
    assert run.returncode == 0, run.stderr
    assert b"Traceback" not in run.stderr and b"codec" not in run.stderr, run.stderr
    # the whole answer, line by line: each character the locale cannot hold is one "?" (or
    # rich's ASCII box drawing)
    out = run.stdout.decode(encoding).splitlines()
    assert [len(x) for x in out] == [len(x) for x in utf8.stdout.decode().splitlines()]
    if "\u2014" in utf8.stdout.decode():
        assert "?" in "".join(out)


def test_a_closed_stdout_is_an_error_not_a_lost_answer():
    run = _ddtree(["estimate", SEED], ">&-")
    assert run.returncode == 2
    assert _lines(run.stderr) == [
        "error: stdout: Bad file descriptor; it was closed when ddtree started"
    ]


@pytest.mark.slow
def test_generate_to_a_closed_stdout_is_one_line():
    run = _ddtree(GENERATE, ">&-")
    assert run.returncode == 2
    assert _lines(run.stderr) == [
        "error: stdout: Bad file descriptor; it was closed when ddtree started"
    ]


@pytest.mark.slow
def test_a_prompt_file_from_a_closed_stdin_is_one_line():
    run = _ddtree(["generate", "--prompt-file", "-"], "<&-")
    assert run.returncode == 2
    lines = _lines(run.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: --prompt-file -: cannot read stdin")


@pytest.mark.slow
def test_generate_into_a_pipe_nobody_reads_exits_141_quietly():
    """The reader is gone before the first token is written (deterministic, unlike ``head -c
    5``, which may read everything before exiting): 141, stderr holds only notes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree", *GENERATE],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    assert _lines(err) == [], err
