"""Nothing lost on a signal: real SIGINT / SIGTERM sent to real ``python -m ddtree`` child
processes once they have finished something (a progress line on stderr, a checkpoint or a
plot on disk). Each must exit 130 (SIGINT) or 143 (SIGTERM), print one line naming what it
kept and where, keep every finished point (records appended, a trace of the recorded
prompts, a checkpoint of the last finished step, the finished plots), leave no partial file
under a final name and no temporary file beside it, and no traceback.

The decode and training commands take seconds to start and to reach their first progress line
(printed every few seconds without a terminal): they are marked slow."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ddtree.cli import main
from ddtree.commands._decode import DEMO_DIR

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
PNG_END = b"IEND\xaeB`\x82"  # the last chunk of every complete PNG


class Child:
    """``python -m ddtree ARGV`` in ``cwd``, its stdout and stderr read as they come."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("DDTREE_DEBUG", None)
        self.argv = argv
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddtree", *argv],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.err: list[str] = []
        self.out: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(s, lines), daemon=True)
            for s, lines in ((self.proc.stderr, self.err), (self.proc.stdout, self.out))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_until(self, ready: Callable[[], object], what: str, timeout_s: float = 240):
        """Poll ``ready()`` until it returns something true; fail if the child exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = ready()
            if got:
                return got
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.argv} exited {self.proc.returncode} before {what}:\n"
                    + "\n".join(self.err[-20:])
                )
            time.sleep(0.01)
        self.proc.kill()
        pytest.fail(f"{self.argv}: no {what} after {timeout_s} s:\n" + "\n".join(self.err[-20:]))

    def progress(self, what: str, at_least: int):
        """Wait for a progress line ``WHAT k/n: ...`` with k >= ``at_least``; returns k."""
        pattern = re.compile(rf"^{re.escape(what)} (\d+)/\d+: ")

        def seen():
            done = [int(m.group(1)) for m in map(pattern.match, list(self.err)) if m]
            return max(done, default=0) if max(done, default=0) >= at_least else 0

        return self.wait_until(seen, f"a '{what} k/n' line with k >= {at_least}")

    def stop(self, sig: int) -> tuple[int, str]:
        """Send ``sig``; the exit code and the last stderr line."""
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=120)
        for reader in self._readers:
            reader.join(timeout=10)
        stderr = "\n".join(self.err)
        assert "Traceback" not in stderr, stderr
        return code, self.err[-1] if self.err else ""


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def _prompts(folder: Path, n: int) -> Path:
    path = folder / "prompts.json"
    path.write_text(json.dumps([f"def function_{i}(x):\n    return" for i in range(n)]))
    return path


# ---- estimate --report: the default suite ---------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_estimate_report_keeps_its_finished_plots(tmp_path, sig):
    child = Child(["estimate", "--report", "rep", "--samples", "2000"], tmp_path)
    plot = tmp_path / "rep" / "breakdown.png"
    child.wait_until(plot.exists, "rep/breakdown.png")
    code, line = child.stop(sig)
    assert code == EXIT[sig], child.err
    kept = sorted(p for p in _files(tmp_path / "rep"))
    assert "report.md" not in kept and kept and all(p.endswith(".png") for p in kept), kept
    for name in kept:
        assert (tmp_path / "rep" / name).read_bytes().endswith(PNG_END), name
    name = signal.Signals(sig).name
    assert (
        line == f"interrupted by {name}: kept {', '.join(kept)} (report.md not written yet) in rep"
    )


def test_a_signal_as_a_file_lands_waits_until_the_file_is_counted(tmp_path, monkeypatch):
    """The race CI hit once: SIGTERM between ``os.replace`` and the caller's ``keep`` left a
    written plot uncounted ("before any result was written"). ``on_replaced`` runs in the
    replace's deferred section, so the signal is raised only after it."""
    import ddtree.files
    from ddtree.signals import Interrupted, handle_signals, kept
    from ddtree.signals import keep as keep_it

    real_replace = os.replace

    def replace_then_signal(src, dst):
        real_replace(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives the moment the file has its name

    monkeypatch.setattr(ddtree.files.os, "replace", replace_then_signal)
    path = tmp_path / "plot.png"
    with pytest.raises(Interrupted), handle_signals():
        try:
            with ddtree.files.replace_atomically(
                path, on_replaced=lambda p: keep_it(p.parent, p.name)
            ) as partial:
                partial.write_bytes(b"png")
        finally:
            seen = kept()
    assert path.read_bytes() == b"png"
    assert seen == {str(tmp_path): "plot.png"}


@pytest.mark.parametrize(
    "argv, expect",
    [
        ("bench engine --records {scenario}", "is not a records file"),
        ("bench shapes --preset tiny-qwen3 --records {scenario}", "is not a records file"),
        ("replay record --out {folder}", "is a folder"),
        ("train target --out {scenario}", "is not a folder"),
        ("train drafter --out {scenario}", "is not a folder"),
        ("estimate --report {scenario}", "is not a folder"),
    ],
    ids=["bench-engine", "bench-shapes", "replay-record", "train-target", "train-drafter",
         "estimate-report"],
)  # fmt: skip
def test_output_paths_are_checked_before_any_work(tmp_path, capsys, argv, expect):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[model]\npreset = "kimi-k2"\n')
    folder = tmp_path / "folder"
    folder.mkdir()
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        main(argv.format(scenario=scenario, folder=folder).split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err
    assert time.perf_counter() - start < 5  # no model was loaded, nothing measured
    assert scenario.read_text() == '[model]\npreset = "kimi-k2"\n' and _files(folder) == set()


# ---- the decode and training commands: slow --------------------------------------------------


@pytest.mark.slow
def test_bench_engine_keeps_the_records_of_the_finished_prompts(tmp_path):
    _prompts(tmp_path, 200)
    child = Child(
        ["bench", "engine", "--prompts", "prompts.json", "--policies", "ar,ddtree", "--budgets",
         "4", "--max-new-tokens", "24", "--records", "r.jsonl"],
        tmp_path,
    )  # fmt: skip
    done = child.progress("decoding", at_least=2)  # two configs: a round is two generations
    code, line = child.stop(signal.SIGTERM)
    assert code == 143, child.err
    match = re.fullmatch(
        r"interrupted by SIGTERM: kept 2 engine_run records over the first (\d+) of 200 "
        r"prompts in r\.jsonl",
        line,
    )
    assert match, line
    rounds = int(match.group(1))
    assert rounds >= done // 2
    from ddtree.records import read_records

    records = read_records(tmp_path / "r.jsonl")
    assert [r.policy for r in records] == ["ar", "ddtree"]
    for r in records:
        assert r.config_extra["interrupted"] == f"after {rounds} of 200 prompts"
        assert r.prompt_set["count"] == rounds == len(r.prompt_lengths)
    assert _files(tmp_path) == {"prompts.json", "r.jsonl"}


@pytest.mark.slow
def test_bench_shapes_keeps_its_bandwidth_record_and_finished_prompts(tmp_path):
    child = Child(
        ["bench", "shapes", "--preset", "tiny-qwen3", "--dtype", "float32", "--budgets", "8",
         "--prompts", "100", "--context", "16", "--max-new-tokens", "24", "--engine-modes",
         "eager", "--records", "s.jsonl"],
        tmp_path,
    )  # fmt: skip
    done = child.progress("decoding", at_least=3)  # ar, chain, ddtree N=8
    code, line = child.stop(signal.SIGINT)
    assert code == 130, child.err
    match = re.fullmatch(
        r"interrupted by SIGINT: kept 1 bench_bandwidth record and 3 engine_run records over "
        r"the first (\d+) of 100 prompts in s\.jsonl",
        line,
    )
    assert match, line
    assert int(match.group(1)) >= done // 3
    from ddtree.records import read_records

    records = read_records(tmp_path / "s.jsonl")
    assert [r.kind for r in records] == ["bench_bandwidth"] + ["engine_run"] * 3
    assert {r.config_extra.get("interrupted") for r in records[1:]} == {
        f"after {match.group(1)} of 100 prompts"
    }
    assert _files(tmp_path) == {"s.jsonl"}


@pytest.mark.slow
def test_replay_record_keeps_a_trace_of_the_recorded_prompts_beside_the_final_name(tmp_path):
    _prompts(tmp_path, 150)
    child = Child(
        ["replay", "record", "--prompts", "prompts.json", "--max-new-tokens", "32",
         "--candidates", "16", "--out", "t.safetensors"],
        tmp_path,
    )  # fmt: skip
    done = child.progress("recording", at_least=1)
    code, line = child.stop(signal.SIGTERM)
    assert code == 143, child.err
    match = re.fullmatch(
        r"interrupted by SIGTERM: kept a trace of the first (\d+) of 150 prompts \(not "
        r"t\.safetensors\) in t\.partial\.safetensors",
        line,
    )
    assert match, line
    from ddtree.replay.trace import load_trace

    trace = load_trace(tmp_path / "t.partial.safetensors")  # its content hash checked
    assert len(trace.header.prompts) == int(match.group(1)) >= done
    assert _files(tmp_path) == {"prompts.json", "t.partial.safetensors"}


def _checkpoint_step(out: Path) -> int:
    return json.loads((out / "checkpoint" / "state.json").read_text())["step"]


TRAIN_TARGET = ["train", "target", "--out", "tgt", "--batch-size", "2", "--seq-len", "32",
                "--max-files", "3", "--vocab-size", "300", "--warmup-steps", "1",
                "--save-every", "1000", "--no-progress"]  # fmt: skip


@pytest.mark.slow
def test_train_target_keeps_a_checkpoint_of_the_last_finished_step(tmp_path):
    child = Child([*TRAIN_TARGET, "--steps", "3000"], tmp_path)
    child.wait_until(lambda: any("target step 20/3000" in x for x in child.err), "step 20")
    code, line = child.stop(signal.SIGTERM)
    assert code == 143, child.err
    step = _checkpoint_step(tmp_path / "tgt")  # saved at the interrupt: save-every is 1000
    assert step >= 20
    assert line == (
        f"interrupted by SIGTERM: kept the checkpoint of step {step} of 3000 (the same command "
        "with --resume continues from it) in tgt/checkpoint"
    )
    assert _files(tmp_path) == {
        "tgt/tokenizer.json", "tgt/tokenizer_config.json", "tgt/checkpoint/state.json",
        "tgt/checkpoint/model.safetensors", "tgt/checkpoint/optimizer.safetensors",
    }  # fmt: skip  # no exported model, no temporary file
    resumed = subprocess.run(
        [sys.executable, "-m", "ddtree", *TRAIN_TARGET, "--steps", str(step + 1), "--resume"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"{step + 1} steps" in resumed.stdout and _checkpoint_step(tmp_path / "tgt") == step + 1


@pytest.mark.slow
def test_train_drafter_keeps_a_checkpoint_of_the_last_finished_step(tmp_path):
    child = Child(
        ["train", "drafter", "--target", str(DEMO_DIR / "target"), "--out", "dr", "--steps",
         "5000", "--seqs-per-step", "2", "--anchors-per-step", "1", "--n-sequences", "4",
         "--new-tokens", "24", "--eval-prompts", "1", "--save-every", "1000", "--max-files",
         "3", "--no-progress"],
        tmp_path,
    )  # fmt: skip
    child.wait_until(lambda: any("drafter step 10/5000" in x for x in child.err), "step 10")
    code, line = child.stop(signal.SIGINT)
    assert code == 130, child.err
    step = _checkpoint_step(tmp_path / "dr")
    assert step >= 10
    assert line == (
        f"interrupted by SIGINT: kept the checkpoint of step {step} of 5000 (the same command "
        "with --resume continues from it) in dr/checkpoint"
    )
    assert _files(tmp_path) == {
        "dr/sequences.safetensors", "dr/checkpoint/state.json",
        "dr/checkpoint/model.safetensors", "dr/checkpoint/optimizer.safetensors",
    }  # fmt: skip
