"""Rerun issue 30's probe classes against real ``ddtree serve`` processes and CLI runs.

Each try is one pass/fail with its class and what was expected. HTTP classes run against
``serve`` (one request at a time) and ``serve --max-batch 4`` (the batched engine); CLI classes
once. Prints a table per class, the failures, then one JSON line; exits 1 on any failure.

    PYTHONPATH=src python scripts/probe_round3.py [--only CLASS,...] [--servers 1,4]

Standard library + httpx; every server and command is a child process (``python -m ddtree``).
Nothing runs in parallel with the timing probe (``starve``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))
from ddtree.commands._decode import DEMO_DIR  # noqa: E402

MODEL = "ddtree-demo"
SEED = ROOT / "examples" / "seed_kimi_b300.toml"
HEADER_TIMEOUT_S = 10.0  # serve/server.py
TRIES: list[dict] = []


def check(cls: str, what: str, ok: bool, expected: str, got: object = "") -> bool:
    TRIES.append({"class": cls, "what": what, "ok": bool(ok), "expected": expected,
                  "got": "" if ok else str(got)[:300]})  # fmt: skip
    if not ok:
        print(f"  FAIL {cls}: {what}: expected {expected}; got {str(got)[:300]}", flush=True)
    return bool(ok)


def env(**extra) -> dict:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC), **extra}
    e.pop("DDTREE_DEBUG", None)
    return e


def ddtree(argv: list[str], redirect: str = "", timeout: float = 180, stdin=None, **extra):
    cmd = [sys.executable, "-m", "ddtree", *argv]
    if redirect:
        cmd = ["bash", "-c", f'exec "$@" {redirect}', "ddtree", *cmd]
    try:
        return subprocess.run(cmd, env=env(**extra), capture_output=True, timeout=timeout,
                              stdin=stdin if stdin is not None else subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired:
        return None


class Server:
    def __init__(self, tmp: Path, *args: str, name: str = "serve") -> None:
        self.log = tmp / f"{name}.stderr"
        argv = [sys.executable, "-m", "ddtree", "serve", "--port", "0", "--threads", "1", *args]
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=env())  # fmt: skip
        line = self.proc.stdout.readline()
        if not line.startswith("ddtree serve: "):
            self.proc.kill()
            raise RuntimeError(f"serve did not start: {self.log.read_text()}")
        self.url = line.split()[2].removesuffix("/v1")
        self.host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return self.proc.returncode


@contextmanager
def serving(tmp: Path, *args: str, name: str = "serve"):
    s = Server(tmp, *args, name=name)
    try:
        yield s
    finally:
        s.stop()


def post(url: str, raw: bytes, headers: dict | None = None, timeout: float = 60):
    h = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{url}/v1/completions", content=raw, headers=h, timeout=timeout)


def is_json_error(r, status: int | None = None) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    ok = r.headers.get("content-type", "").startswith("application/json") and "error" in body
    return ok and (r.status_code == status if status else 400 <= r.status_code < 500)


class Call(threading.Thread):
    """One request in a thread: status, JSON body or stream data lines."""

    def __init__(self, url, body, stream, headers=None, timeout=120) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.stream = url, {**body, "stream": stream}, stream
        self.headers, self.timeout = headers or {}, timeout
        self.status, self.json, self.lines, self.ended = None, None, [], None
        self.first = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body,
                              headers=self.headers, timeout=self.timeout) as r:  # fmt: skip
                self.status = r.status_code
                if self.stream and r.status_code == 200:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            self.lines.append(line)
                            self.first.set()
                else:
                    self.json = json.loads(r.read())
        except (httpx.HTTPError, ValueError) as e:
            self.status = repr(e)
        finally:
            self.ended = time.perf_counter()
            self.first.set()


def error_then_done(lines: list[str]) -> bool:
    try:
        return lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:])
    except (IndexError, ValueError):
        return False


def wait_for(cond, timeout_s=10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def depth(url):
    return httpx.get(f"{url}/health").json()["queue_depth"]


LONG = {"model": MODEL, "prompt": "def parse(", "max_tokens": 1900, "ignore_eos": True}
OK = {"model": MODEL, "prompt": "def f(", "max_tokens": 4}


# ---------------------------------------------------------------- HTTP classes


def malformed_bodies() -> list[tuple[str, bytes]]:
    m = b'"model": "ddtree-demo"'
    return [
        ("1000-deep JSON", b"{" + m + b', "prompt": "a", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"),
        ("100k-deep JSON", b"[" * 100_000 + b"]" * 100_000),
        ("lone surrogate key", b"{" + m + b', "prompt": "a", "\\udcff": 1}'),
        ("lone surrogate prompt", b"{" + m + b', "prompt": "a\\ud800b"}'),
        ("not JSON", b"{" + m + b", prompt: }"),
        ("not UTF-8", b"{" + m + b', "prompt": "\xff\xfe"}'),
        ("array body", b"[1, 2, 3]"),
        ("string body", b'"hello"'),
        ("empty body", b""),
        ("NaN temperature", b"{" + m + b', "prompt": "a", "temperature": NaN}'),
        ("string max_tokens", b"{" + m + b', "prompt": "a", "max_tokens": "5"}'),
        ("unknown parameter", b"{" + m + b', "prompt": "a", "frobnicate": 1}'),
        ("n=2", b"{" + m + b', "prompt": "a", "n": 2}'),
        ("token id past vocab", b"{" + m + b', "prompt": [99999999]}'),
        ("empty prompt", b"{" + m + b', "prompt": ""}'),
        ("500k characters", b"{" + m + b', "prompt": "' + b"x" * 500_000 + b'"}'),
        ("5000 token ids", b"{" + m + b', "prompt": [' + b"5," * 5000 + b"5]}"),
        ("wrong model", b'{"model": "gpt-4", "prompt": "a"}'),
        ("negative max_tokens", b"{" + m + b', "prompt": "a", "max_tokens": -1}'),
        ("huge seed", b"{" + m + b', "prompt": "a", "seed": ' + b"9" * 40 + b"}"),
        ("5 stop strings", b"{" + m + b', "prompt": "a", "stop": ["a","b","c","d","e"]}'),
        ("max_tokens past context", b"{" + m + b', "prompt": "a", "max_tokens": 100000}'),
    ]


def probe_malformed(s: Server, label: str, repeats: int) -> None:
    cls = f"malformed [{label}]"
    for _ in range(repeats):
        for name, raw in malformed_bodies():
            try:
                r = post(s.url, raw)
                check(cls, name, is_json_error(r), "a JSON 4xx error object",
                      f"{r.status_code} {r.headers.get('content-type')} {r.text[:120]}")  # fmt: skip
            except httpx.HTTPError as e:
                check(cls, name, False, "a JSON 4xx error object", repr(e))
    r = post(s.url, json.dumps(OK).encode())
    check(cls, "a good request after them", r.status_code == 200, "200", r.status_code)
    check(cls, "no traceback in the log", "Traceback" not in s.text(), "none", s.text()[-500:])


def probe_starve(s: Server, label: str, floods: int) -> None:
    """A decode's text and step time with and without one client flooding 100 KB prompts."""
    cls = f"starve [{label}]"
    body = {"model": MODEL, "prompt": "def parse(", "max_tokens": 64, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    alone = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120).json()
    big = json.dumps({"model": MODEL, "prompt": "x" * 100_000, "max_tokens": 1}).encode()
    stop, answers = threading.Event(), []

    def flood() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                try:
                    r = c.post(f"{s.url}/v1/completions", content=big,
                               headers={"Content-Type": "application/json"})  # fmt: skip
                    answers.append((r.status_code, r.headers.get("content-type", "")))
                except httpx.HTTPError as e:
                    answers.append((repr(e), ""))

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    under = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120).json()
    took = time.perf_counter() - t0
    stop.set()
    t.join(60)
    check(cls, "the same text under the flood", under["choices"][0]["text"]
          == alone["choices"][0]["text"], "equal to the idle decode", under["choices"][0])  # fmt: skip
    a, b = alone["ddtree"]["step_s_mean"], under["ddtree"]["step_s_mean"]
    check(cls, f"step time under flood ({b * 1e3:.1f} ms vs {a * 1e3:.1f} ms idle)",
          b <= 3 * a, "within 3x of idle (not starved; 1.5x is bench serve --flood's goal)",
          f"{b / a:.2f}x, decode took {took:.2f} s")  # fmt: skip
    for code, ctype in answers[:floods]:
        check(cls, "flood request refused", code == 400 and ctype.startswith("application/json"),
              "JSON 400", (code, ctype))  # fmt: skip
    if len(answers) < floods:  # a flood that got fewer answers in: more, idle
        for _ in range(floods - len(answers)):
            r = post(s.url, big)
            check(cls, "flood request refused", is_json_error(r, 400), "JSON 400", r.status_code)


def probe_disconnects(s: Server, label: str, n: int) -> None:
    cls = f"mid-upload disconnect [{label}]"
    for i in range(n):
        with socket.create_connection((s.host, s.port)) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 10000\r\n\r\n{\"model\": ")  # fmt: skip
            if i % 2:
                time.sleep(0.05)
    time.sleep(0.3)
    ok = post(s.url, json.dumps(OK).encode()).status_code == 200
    tb = "Traceback" in s.text()
    for i in range(n):
        check(cls, f"client {i} left mid-upload", ok and not tb,
              "no traceback, the server answers the next request", s.text()[-400:])  # fmt: skip


def probe_slowloris(s: Server, label: str, n: int) -> None:
    cls = f"slowloris [{label}]"
    conns = []
    for _ in range(n):
        c = socket.create_connection((s.host, s.port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        conns.append(c)
    end = time.monotonic() + HEADER_TIMEOUT_S + 3
    while time.monotonic() < end:  # a header byte a second: never completes
        for c in conns:
            try:
                c.sendall(b"X")
            except OSError:
                pass
        time.sleep(1)
    r = httpx.get(f"{s.url}/health", timeout=10)
    for i, c in enumerate(conns):
        c.settimeout(2)
        try:
            closed = c.recv(1024) == b""
        except ConnectionResetError:
            closed = True
        except (TimeoutError, OSError):
            closed = False
        c.close()
        check(cls, f"header trickle {i}", closed and r.status_code == 200,
              f"closed after the {HEADER_TIMEOUT_S:g} s header deadline", "still open")  # fmt: skip


def probe_queue_slots(s: Server, label: str, batch: int, n: int) -> None:
    """--max-queue 1: a queued client that leaves frees its slot at once, and the next live
    client is queued (not 503)."""
    cls = f"queue slots [{label}]"
    running: list[Call] = []
    for i in range(n):
        if not running or any(c.ended is not None for c in running):
            running = [Call(s.url, LONG, stream=True) for _ in range(batch)]
            for c in running:
                c.start()
            for c in running:
                c.first.wait(60)
        gone = threading.Thread(target=_gives_up, args=(s.url,), daemon=True)
        gone.start()
        queued = wait_for(lambda: depth(s.url) == 1, 20)
        gone.join()
        freed = wait_for(lambda: depth(s.url) == 0, 5)
        check(cls, f"departed client {i} freed its slot", queued and freed,
              "queue depth 1 then 0 within 5 s while the decode runs", (queued, freed))  # fmt: skip
        status = _gives_up(s.url)
        check(cls, f"a live client after {i} is admitted", status == "waiting",
              "queued (still waiting after 1 s), not 503", status)  # fmt: skip
        wait_for(lambda: depth(s.url) == 0, 5)
    for c in running:
        c.join(180)


def _gives_up(url) -> str:
    try:
        return str(post(url, json.dumps(LONG).encode(), timeout=1.0).status_code)
    except httpx.ReadTimeout:
        return "waiting"
    except httpx.HTTPError as e:
        return repr(e)


PROMPTS = [
    "def parse(",
    "class Tree:",
    "import os\n",
    "x = [",
    "for i in",
    "# a",
    "if x:",
    "return",
]


def _body(i: int) -> dict:
    """Mixed requests: greedy, stop strings, seeded sampling, lengths."""
    b = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12 + 5 * (i % 4)}
    if i % 3 == 1:
        b["stop"] = ["\n\n", ")"]
    if i % 3 == 2:
        b |= {"temperature": 0.8, "seed": 100 + i}
    return b


def _complete(url: str, body: dict, stream: bool) -> tuple:
    """(text, finish_reason) of one request, streamed or not; a 503 (queue full: the main
    server has --max-queue 1) is retried, as the openai client does."""
    for _ in range(600):
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": stream},
                          timeout=120) as r:  # fmt: skip
            if r.status_code == 503:
                time.sleep(0.1)
                continue
            if r.status_code != 200:  # the same error from every server
                return r.status_code, json.loads(r.read())["error"]["message"]
            if not stream:
                c = json.loads(r.read())["choices"][0]
                return c["text"], c["finish_reason"]
            text, reason = "", None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        text += chunk["choices"][0]["text"]
                        reason = chunk["choices"][0]["finish_reason"] or reason
            return text, reason
    return "503 for a minute", None


def probe_equal(s: Server, label: str, n: int) -> None:
    """Each of n concurrent requests gets what it gets alone (batched rows equal one-at-a-time)."""
    cls = f"concurrent = alone [{label}]"
    alone = [_complete(s.url, _body(i), stream=False) for i in range(n)]
    out: list = [None] * n

    def one(i):
        try:
            out[i] = _complete(s.url, _body(i), stream=i % 2 == 0)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            out[i] = repr(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i in range(n):
        check(cls, f"request {i} ({'sampled' if i % 3 == 2 else 'greedy'})", out[i] == alone[i],
              f"{alone[i]!r}", out[i])  # fmt: skip


def probe_drops(s: Server, label: str, batch: int) -> None:
    """Clients leaving mid-decode (streams closed, non-stream timeouts) while others decode:
    the others finish with their own text; nothing stays running; no traceback."""
    cls = f"dropped clients [{label}]"
    keep = [_body(3 * i) for i in range(2)]  # greedy
    alone = [_complete(s.url, b, stream=True) for b in keep]
    got: dict = {}

    def stay(i):
        got[i] = _complete(s.url, keep[i], stream=True)

    def leave_stream():
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "stream": True},
                          timeout=120) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token: then the client closes

    threads = [threading.Thread(target=leave_stream) for _ in range(2)]
    threads += [threading.Thread(target=_gives_up, args=(s.url,))]
    threads += [threading.Thread(target=stay, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i in range(2):
        check(cls, f"a staying client {i} gets its own text", got.get(i) == alone[i],
              repr(alone[i]), got.get(i))  # fmt: skip
    idle = wait_for(lambda: _metric(s.url, "ddtree_running_requests") == 0
                    and depth(s.url) == 0, 20)  # fmt: skip
    check(cls, "nothing left running or queued", idle, "0 running, 0 queued",
          (_metric(s.url, "ddtree_running_requests"), depth(s.url)))  # fmt: skip
    r = post(s.url, json.dumps(OK).encode())
    check(cls, "the next request", r.status_code == 200, "200", r.status_code)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def probe_queue_full(s: Server, label: str, batch: int, n: int) -> None:
    """--max-queue 1: past the running rows and one queued, a 503 JSON with Retry-After."""
    cls = f"queue full [{label}]"
    running = [Call(s.url, LONG, stream=True) for _ in range(batch)]
    for c in running:
        c.start()
    for c in running:
        c.first.wait(60)
    queued = Call(s.url, {**OK, "max_tokens": 2}, stream=False)
    queued.start()
    wait_for(lambda: depth(s.url) == 1, 20)
    for i in range(n):
        r = post(s.url, json.dumps(OK).encode())
        retry = r.headers.get("retry-after", "")
        check(cls, f"request {i} past the queue", is_json_error_5xx(r, 503) and retry.isdigit()
              and int(retry) >= 1, "JSON 503 queue_full with Retry-After >= 1",
              f"{r.status_code} {retry!r} {r.text[:100]}")  # fmt: skip
    for c in running:
        c.join(180)
    queued.join(60)
    check(cls, "the queued request then decodes", queued.status == 200, "200", queued.status)


EDGE = {  # valid requests at the edges; the batched server must answer each as one-at-a-time
    "max_tokens 1": {"prompt": "def f(", "max_tokens": 1},
    "token-id prompt": {"prompt": [5, 17, 300, 9], "max_tokens": 10},
    "prompt filling the context": {"prompt": [7] * 2028, "max_tokens": 12, "ignore_eos": True},
    "top_k 1 sampled": {"prompt": "x = ", "max_tokens": 16, "temperature": 1.0, "top_k": 1,
                        "seed": 3},
    "top_p sampled": {"prompt": "import ", "max_tokens": 16, "temperature": 0.7, "top_p": 0.5,
                      "seed": 9},
    "stop at once": {"prompt": "def f(", "max_tokens": 16, "stop": ["a", "e", "(", ")", ]},
    "ignore_eos long": {"prompt": "# end", "max_tokens": 200, "ignore_eos": True},
    "unicode prompt": {"prompt": "d\u00e9f \u4e2d\u6587(", "max_tokens": 12},
}  # fmt: skip


def probe_batched_vs_single(tmp: Path) -> None:
    cls = "batched = one-at-a-time"
    with serving(tmp, "--max-batch", "1", name="edge1") as one:
        alone = {
            k: _complete(one.url, {"model": MODEL, **b}, stream=False) for k, b in EDGE.items()
        }
    with serving(tmp, "--max-batch", "4", "--max-queue", "16", name="edge4") as four:
        got: dict = {}

        def run(k, i):
            try:
                got[k] = _complete(four.url, {"model": MODEL, **EDGE[k]}, stream=i % 2 == 1)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                got[k] = repr(e)

        threads = [threading.Thread(target=run, args=(k, i)) for i, k in enumerate(EDGE)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for k in EDGE:
            check(cls, k, got.get(k) == alone[k], repr(alone[k])[:200], got.get(k))
        check(cls, "no traceback", "Traceback" not in four.text(), "none", four.text()[-600:])


def is_json_error_5xx(r, status: int) -> bool:
    try:
        return r.status_code == status and "error" in r.json()
    except ValueError:
        return False


def probe_access_log(s: Server, label: str, n: int) -> None:
    cls = f"access log [{label}]"
    for i in range(n):
        path = f"/health?probe={i}"
        httpx.get(f"{s.url}{path}")
        ok = wait_for(lambda p=path: f'"GET {p} HTTP/1.1" 200' in s.text(), 10)
        check(cls, f"GET {path} logged", ok, "one access line on stderr", s.text()[-300:])


def probe_auth(tmp: Path, args: list[str], label: str, repeats: int) -> None:
    cls = f"auth [{label}]"
    key = "s3cret-KEY"
    records = tmp / f"auth{label}.jsonl"
    with serving(tmp, *args, "--api-key", key, "--records", str(records), name=f"auth{label}") as s:
        cases = [
            ("Bearer KEY", {"Authorization": f"Bearer {key}"}, 200),
            ("bearer KEY", {"Authorization": f"bearer {key}"}, 200),
            ("BEARER KEY", {"Authorization": f"BEARER {key}"}, 200),
            ("wrong key", {"Authorization": "Bearer nope"}, 401),
            ("no header", {}, 401),
            ("Basic scheme", {"Authorization": f"Basic {key}"}, 401),
            ("non-ASCII header", {"Authorization": "Bearer k\u00e9y".encode("latin-1")}, 401),
            ("key prefix", {"Authorization": f"Bearer {key[:-1]}"}, 401),
        ]
        for _ in range(repeats):
            for name, headers, want in cases:
                try:
                    r = post(s.url, json.dumps({**OK, "max_tokens": 2}).encode(), headers)
                    good = r.status_code == want and (want == 200 or is_json_error(r, 401))
                    check(cls, name, good, f"{want}", f"{r.status_code} {r.text[:100]}")
                except httpx.HTTPError as e:
                    check(cls, name, False, f"{want}", repr(e))
        code = s.stop()
        text = records.read_text() if records.exists() else ""
        check(f"secrets [{label}]", "records written", bool(text), "served records", "none")
        check(f"secrets [{label}]", "--api-key value not in records", key not in text,
              "redacted", "the key is in the records")  # fmt: skip
        check(f"secrets [{label}]", "--api-key value not in the log", key not in s.text(),
              "absent", s.text()[-300:])  # fmt: skip
        check(f"shutdown [{label}]", "idle SIGTERM exit status", code == 143, "143", code)


def probe_shutdown(tmp: Path, args: list[str], label: str, batch: int) -> None:
    cls = f"shutdown [{label}]"
    records = tmp / f"shut{label}.jsonl"
    s = Server(tmp, *args, "--records", str(records), "--shutdown-timeout", "1",
               "--max-queue", "8", name=f"shut{label}")  # fmt: skip
    try:
        httpx.post(f"{s.url}/v1/completions", json={**OK, "max_tokens": 8}, timeout=60)
        running = [Call(s.url, LONG, stream=True) for _ in range(batch)]
        for c in running:
            c.start()
        for c in running:
            c.first.wait(60)
        queued = [Call(s.url, LONG, stream=i % 2 == 1) for i in range(6)]
        for c in queued:
            c.start()
        check(cls, "six queued", wait_for(lambda: depth(s.url) == 6, 30), "queue depth 6",
              depth(s.url))  # fmt: skip
        sent = time.perf_counter()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(60)
        exited = time.perf_counter() - sent
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    for c in [*running, *queued]:
        c.join(30)
    err = s.text()
    check(cls, "exit status", code == 143, "143", code)
    check(cls, "exit within drain + 1 s", exited <= 1 + 1 + 1.0, "<= 3 s", f"{exited:.2f} s")
    check(cls, "no traceback", "Traceback" not in err, "none", err[-600:])
    for i, c in enumerate(queued):
        if c.stream:
            check(cls, f"queued stream {i}", c.status == 200 and error_then_done(c.lines),
                  "error event then [DONE]", (c.status, c.lines[-2:]))  # fmt: skip
        else:
            good = (
                c.status == 503 and (c.json or {}).get("error", {}).get("code") == "shutting_down"
            )
            check(cls, f"queued request {i}", good, "JSON 503 shutting_down", (c.status, c.json))
            check(cls, f"queued request {i} answered within 1 s", c.ended - sent <= 1.0,
                  "<= 1 s", f"{c.ended - sent:.2f} s")  # fmt: skip
    for i, c in enumerate(running):
        check(cls, f"running stream {i}", c.status == 200 and error_then_done(c.lines),
              "error event then [DONE]", (c.status, c.lines[-2:]))  # fmt: skip
    n = len([x for x in records.read_text().splitlines() if x.strip()]) if records.exists() else 0
    last = err.strip().splitlines()[-1] if err.strip() else ""
    check(cls, "truthful last line", last == f"interrupted by SIGTERM: kept {n} engine_run "
          f"records in {records}", f"kept {n} records", last)  # fmt: skip
    # a second SIGINT stops at once, 130
    s = Server(tmp, *args, "--shutdown-timeout", "600", name=f"int{label}")
    try:
        c = Call(s.url, LONG, stream=True)
        c.start()
        c.first.wait(60)
        s.proc.send_signal(signal.SIGINT)
        wait_for(lambda: "stopping" in s.text(), 10)
        s.proc.send_signal(signal.SIGINT)
        try:
            code = s.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = "hung"
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    c.join(30)
    check(cls, "second SIGINT exit status", code == 130, "130 at once", code)
    check(cls, "second SIGINT: no traceback", "Traceback" not in s.text(), "none", s.text()[-500:])
    check(cls, "second SIGINT: stream ends with [DONE]", c.lines[-1:] == ["data: [DONE]"],
          "[DONE]", c.lines[-2:])  # fmt: skip


def probe_estimate_records(tmp: Path, args: list[str], label: str) -> None:
    cls = f"estimate --records [{label}]"
    records = tmp / f"est{label}.jsonl"
    bandwidth = ["bench", "bandwidth", "--device", "cpu", "--sizes-mib", "64", "--repeats", "3"]
    ddtree([*bandwidth, "--threads", "1", "--records", str(records)], timeout=120)
    with serving(tmp, *args, "--records", str(records), name=f"est{label}") as s:
        bodies = [{**OK, "max_tokens": 12, "prompt": p} for p in ("def a(", "class B:", "x = [")]
        for i in range(60):
            httpx.post(f"{s.url}/v1/completions", json=bodies[i % 3], timeout=60)
    t0 = time.perf_counter()
    run = ddtree(["estimate", "--records", str(records)], timeout=60)
    took = time.perf_counter() - t0
    check(cls, "estimate --records on served records", run is not None and run.returncode == 0
          and b"Traceback" not in run.stderr, "exit 0 within 60 s",
          "timeout" if run is None else run.stderr[-300:])  # fmt: skip
    check(cls, "finishes in seconds", took < 30, "< 30 s", f"{took:.1f} s")


# ---------------------------------------------------------------- CLI classes


def one_error_line(run, *words) -> tuple[bool, str]:
    if run is None:
        return False, "timed out"
    err = [x for x in run.stderr.decode("utf-8", "replace").splitlines()
           if x.strip() and not x.startswith(("note:", "warning:", "loading"))]  # fmt: skip
    ok = run.returncode == 2 and len(err) == 1 and all(w in err[0] for w in words)
    return ok, f"exit {run.returncode}: {err[-3:]}"


def probe_code(tmp: Path) -> None:
    cls = "checkpoint code"
    for file in ("config.json", "tokenizer_config.json"):
        ck = tmp / f"automap_{file.split('.')[0]}"
        shutil.copytree(DEMO_DIR / "target", ck)
        cfg = json.loads((ck / file).read_text())
        cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": ["evil.Tok", None]}
        (ck / file).write_text(json.dumps(cfg))
        (ck / "evil.py").write_text("open('PWNED', 'w').write('ran')\n")
        impl = ["--impl", "hf"] if file == "config.json" else []  # transformers reads it
        run = ddtree(["generate", "--prompt", "hi", "--policy", "ar", "--max-new-tokens", "2",
                      "--target", str(ck), *impl], timeout=120, stdin=subprocess.PIPE)  # fmt: skip
        ok, got = one_error_line(run, file, "auto_map")
        check(cls, f"auto_map in {file} refused", ok, "exit 2, one line naming the file", got)
        check(cls, f"auto_map in {file}: no code ran", not (ROOT / "PWNED").exists()
              and not (ck / "PWNED").exists(), "no PWNED file", "code ran")  # fmt: skip
    for name, shard in (("dotdot", "../escape.safetensors"), ("absolute", "/etc/passwd")):
        ck = tmp / f"index_{name}"
        shutil.copytree(DEMO_DIR / "target", ck)
        (ck / "model.safetensors").unlink()
        (ck / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.embed_tokens.weight": shard}})
        )
        run = ddtree(["generate", "--prompt", "hi", "--policy", "ar", "--max-new-tokens", "2",
                      "--target", str(ck)], timeout=120)  # fmt: skip
        ok, got = one_error_line(run)
        check(cls, f"index shard {shard} refused", ok, "exit 2, one line", got)


def probe_host_and_keys(tmp: Path) -> None:
    cls = "serve flags"
    s = Server(tmp, "--host", "0.0.0.0", name="anyhost")
    code = s.stop()
    check(cls, "--host 0.0.0.0 without a key warns", "warning" in s.text().lower(),
          "a warning on stderr", s.text()[-300:])  # fmt: skip
    check(cls, "--host 0.0.0.0 idle SIGTERM", code == 143, "143", code)
    for key in ("k\u00e9y", "tab\tkey", "new\nline"):
        run = ddtree(["serve", "--port", "0", "--api-key", key], timeout=120)
        ok, got = one_error_line(run, "--api-key")
        check(cls, f"--api-key {key!r} refused", ok, "exit 2, one line", got)


def probe_locale_streams() -> None:
    cls = "locale"
    gen = ["generate", "--prompt", "hi", "--max-new-tokens", "8"]
    for name, extra in (("C", {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}),
                        ("latin-1", {"PYTHONIOENCODING": "latin-1", "PYTHONUTF8": "0"})):  # fmt: skip
        for argv in (["estimate", str(SEED)], ["estimate", str(SEED), "--explain"], gen):
            run = ddtree(argv, **extra)
            ok = run is not None and run.returncode == 0 and b"Traceback" not in run.stderr
            check(cls, f"{name}: {' '.join(argv[:1] + argv[2:3])}", ok and b"codec" not in run.stderr,
                  "exit 0, whole answer", "timeout" if run is None else run.stderr[-300:])  # fmt: skip
    cls = "streams"
    for argv, redirect, want in (
        (["estimate", str(SEED)], ">&-", 2),
        (gen, ">&-", 2),
        (["generate", "--prompt-file", "-"], "<&-", 2),
    ):
        run = ddtree(argv, redirect)
        ok, got = one_error_line(run)
        check(cls, f"{argv[0]} {redirect}", ok, f"exit {want}, one line", got)
    for _ in range(3):
        cmd = (f'"{sys.executable}" -m ddtree generate --prompt hi --max-new-tokens 64 '
               "| head -c 5 >/dev/null")  # fmt: skip
        run = subprocess.run(["bash", "-c", cmd], env=env(), capture_output=True, timeout=180)
        err = run.stderr.decode(errors="replace")
        bad = [x for x in err.splitlines() if x.strip() and not x.startswith("note:")]
        check(cls, "generate | head -c 5", not bad, "nothing on stderr", bad[-3:])


def probe_files(tmp: Path) -> None:
    cls = "files"
    w = tmp / "files"
    w.mkdir()
    (w / "loop").symlink_to(w / "loop")
    os.mkfifo(w / "fifo")
    fifo_ck = w / "t_fifo"
    shutil.copytree(DEMO_DIR / "target", fifo_ck)
    (fifo_ck / "model.safetensors").unlink()
    os.mkfifo(fifo_ck / "model.safetensors")
    deep = w / "t_deep"
    shutil.copytree(DEMO_DIR / "target", deep)
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    (w / "kept.safetensors").write_bytes(b"keep me")
    gen = ["generate", "--prompt", "hi", "--policy", "ar", "--max-new-tokens", "2"]
    cases = [
        ("symlink loop as generate --records", [*gen, "--records", str(w / "loop")], ("loop",)),
        ("symlink loop as estimate --report",
         ["estimate", str(SEED), "--report", str(w / "loop")], ("loop",)),
        ("FIFO named model.safetensors", [*gen, "--target", str(fifo_ck)], ("FIFO",)),
        ("100k-deep config.json", [*gen, "--target", str(deep)], ("config.json",)),
        ("/dev/zero as --prompt-file", ["generate", "--prompt-file", "/dev/zero"], ("/dev/zero",)),
        ("FIFO as --prompt-file", ["generate", "--prompt-file", str(w / "fifo")], ("FIFO",)),
        ("replay record --out existing", ["replay", "record", "--out",
                                          str(w / "kept.safetensors")], ("exists",)),
    ]  # fmt: skip
    for name, argv, words in cases:
        run = ddtree(argv, timeout=120)
        ok, got = one_error_line(run, *words)
        check(cls, name, ok, "exit 2, one line naming the input", got)
    check(cls, "replay --out kept the existing file",
          (w / "kept.safetensors").read_bytes() == b"keep me", "unchanged", "replaced")  # fmt: skip


# ---------------------------------------------------------------- main


def http_classes(tmp: Path, batch: int, only) -> None:
    label = f"max-batch {batch}"
    args = ["--max-batch", str(batch)]
    want = lambda c: not only or c in only  # noqa: E731
    with serving(tmp, *args, "--access-log", "--max-queue", "1", name=f"main{batch}") as s:
        if want("starve"):
            probe_starve(s, label, floods=60)
        if want("malformed"):
            probe_malformed(s, label, repeats=6)
        if want("disconnect"):
            probe_disconnects(s, label, 10)
        if want("access"):
            probe_access_log(s, label, 5)
        if want("queue"):
            probe_queue_slots(s, label, batch, 3)
            probe_queue_full(s, label, batch, 5)
        if want("equal"):
            probe_equal(s, label, 8)
        if want("drops"):
            probe_drops(s, label, batch)
        if want("slowloris"):
            probe_slowloris(s, label, 20)
        check(f"log [{label}]", "no traceback in the whole run", "Traceback" not in s.text(),
              "none", s.text()[-800:])  # fmt: skip
    if want("auth"):
        probe_auth(tmp, args, label, repeats=3)
    if want("shutdown"):
        probe_shutdown(tmp, args, label, batch)
    if want("estimate"):
        probe_estimate_records(tmp, args, label)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", type=lambda s: set(s.split(",")), default=None)
    p.add_argument("--servers", default="1,4", help="--max-batch values for the HTTP classes")
    p.add_argument("--no-cli", action="store_true")
    args = p.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="probe-round3-") as d:
        tmp = Path(d)
        for batch in map(int, args.servers.split(",")):
            print(f"HTTP classes, serve --max-batch {batch} ...", flush=True)
            http_classes(tmp, batch, args.only)
        if not args.only or "edge" in args.only:
            probe_batched_vs_single(tmp)
        if not args.no_cli:
            print("CLI classes ...", flush=True)
            want = lambda c: not args.only or c in args.only  # noqa: E731
            if want("code"):
                probe_code(tmp)
            if want("flags"):
                probe_host_and_keys(tmp)
            if want("locale"):
                probe_locale_streams()
            if want("files"):
                probe_files(tmp)
    by = defaultdict(lambda: [0, 0])
    for t in TRIES:
        by[t["class"]][0 if t["ok"] else 1] += 1
    print(f"\n{'class':42} {'pass':>5} {'fail':>5}")
    for cls, (ok, bad) in by.items():
        print(f"{cls:42} {ok:5d} {bad:5d}")
    fails = [t for t in TRIES if not t["ok"]]
    print(f"{'total':42} {len(TRIES) - len(fails):5d} {len(fails):5d}")
    for t in fails:
        print(f"FAIL {t['class']}: {t['what']}: expected {t['expected']}; got {t['got']}")
    print(json.dumps({"probe": "round3", "tries": len(TRIES), "failures": len(fails),
                      "seconds": round(time.perf_counter() - t0, 1),
                      "classes": {c: {"pass": v[0], "fail": v[1]} for c, v in by.items()}}))  # fmt: skip
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
