"""Graceful shutdown of a real ``ddtree serve`` process: the first SIGTERM/SIGINT stops
admission, answers the queued requests with a JSON 503 at once (a queued stream with an error
event and ``[DONE]``), gives the running one ``--shutdown-timeout`` before ending it with an
error event and ``[DONE]``, writes the records made, says so, and exits 143 / 130; a second
signal stops at once. Timings are printed (``-s``), never asserted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.serve.helpers import STARTUP_S, wait_for

from ddtree.commands._decode import DEMO_DIR
from ddtree.records import read_records
from ddtree.serve.loadgen import URL_LINE, _first_line

httpx = pytest.importorskip("httpx")

LONG = {"model": "ddtree-demo", "prompt": "def parse(", "max_tokens": 1900, "ignore_eos": True}
SHORT = {"model": "ddtree-demo", "prompt": "def parse(", "max_tokens": 8}


def _start(tmp: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DDTREE_DEBUG", None)
    log = tmp / "serve.stderr"
    argv = [sys.executable, "-m", "ddtree", "serve", "--port", "0", "--threads", "1", *args]
    argv += ["--drafter", str(DEMO_DIR / "drafter")]
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    line = _first_line(proc, STARTUP_S)
    if not line.startswith(URL_LINE):
        proc.kill()
        pytest.fail(f"ddtree serve did not start:\n{log.read_text()}")
    return proc, line.split()[2].removesuffix("/v1"), log


class Call(threading.Thread):
    """One request in a thread: status, the JSON body or the stream's data lines, and when
    it ended (perf_counter)."""

    def __init__(self, url: str, body: dict, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.stream = url, {**body, "stream": stream}, stream
        self.status, self.json, self.lines, self.ended = None, None, [], None
        self.first_data = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body,
                              timeout=120) as r:  # fmt: skip
                self.status = r.status_code
                if self.stream and r.status_code == 200:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            self.lines.append(line)
                            self.first_data.set()
                else:
                    self.json = json.loads(r.read())
        except httpx.HTTPError as e:
            self.status = repr(e)
        finally:
            self.ended = time.perf_counter()
            self.first_data.set()


def _queue_depth(url: str) -> int:
    return httpx.get(f"{url}/health").json()["queue_depth"]


def _is_error_then_done(lines: list[str]) -> bool:
    return (
        len(lines) >= 2
        and lines[-1] == "data: [DONE]"
        and json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    )


def test_sigterm_answers_queued_503_ends_the_running_stream_and_exits_143(tmp_path):
    records = tmp_path / "served.jsonl"
    proc, url, log = _start(
        tmp_path, "--records", str(records), "--shutdown-timeout", "1", "--max-queue", "8"
    )
    try:
        assert httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60).status_code == 200
        wait_for(lambda: records.exists() and read_records(records), "the first record")
        running = Call(url, LONG, stream=True)
        running.start()
        assert running.first_data.wait(60) and running.status == 200
        queued = [Call(url, LONG, stream=i % 2 == 1) for i in range(6)]
        for call in queued:
            call.start()
        wait_for(lambda: _queue_depth(url) == 6, "six queued requests")
        sent = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        exited = time.perf_counter()
    finally:
        if proc.poll() is None:
            proc.kill()
    for call in [running, *queued]:
        call.join(30)
    err = log.read_text()
    print(f"\nSIGTERM -> queued answered in {max(c.ended for c in queued) - sent:.3f} s, "
          f"running ended in {running.ended - sent:.3f} s, exit in {exited - sent:.3f} s")  # fmt: skip
    assert code == 143, err
    assert "Traceback" not in err, err
    for call in queued:
        if call.stream:
            assert call.status == 200 and _is_error_then_done(call.lines), call.lines
        else:
            assert call.status == 503, call.status
            assert call.json["error"]["code"] == "shutting_down"
    assert running.status == 200 and _is_error_then_done(running.lines), running.lines[-3:]
    assert len(running.lines) > 3  # it streamed tokens before it was cut
    last = err.strip().splitlines()[-1]
    assert last == f"interrupted by SIGTERM: kept 1 engine_run records in {records}", err
    assert len(read_records(records)) == 1


def test_a_second_sigint_stops_at_once_and_exits_130(tmp_path):
    proc, url, log = _start(tmp_path, "--shutdown-timeout", "600")
    try:
        running = Call(url, LONG, stream=True)
        running.start()
        assert running.first_data.wait(60)
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "stopping" in log.read_text(), "the first signal's line")
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)  # not the 600 s drain
        print(f"\nsecond SIGINT -> exit in {time.perf_counter() - sent:.3f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert code == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("interrupted by SIGINT")


def test_sigint_on_an_idle_server_exits_130_at_once(tmp_path):
    proc, url, log = _start(tmp_path)
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert code == 130 and "Traceback" not in err, err
