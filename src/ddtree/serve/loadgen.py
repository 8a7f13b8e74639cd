"""The load client of ``ddtree bench serve``, and a ``ddtree serve`` child process to aim it at.

A pass sends a fixed list of streamed completion requests with ``concurrency`` of them in
flight at once (a closed loop: a client sends its next request when its last one ended) and
times, per request, the send, every content chunk and the end. From those:

- ``time to first token``: send -> first content chunk (queueing included);
- ``inter-chunk latency``: gaps between content chunks; the server sends one chunk per engine
  step, so each gap is one step's tau tokens (vLLM's ITL for multi-token steps);
- ``time per output token``: (last chunk - first chunk) / (completion tokens - 1), per request;
- ``requests/s`` and client ``tokens/s`` over the pass's makespan;
- the server's own figures per request (the ``ddtree`` extension: engine tokens/s, steps).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

URL_LINE = "ddtree serve: "
PERCENTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    sent_s: float
    chunk_s: list[float] = field(default_factory=list)  # content chunks' arrival
    done_s: float = 0.0
    completion_tokens: int = 0
    text: str = ""
    engine: dict = field(default_factory=dict)  # the response's ddtree extension
    error: str | None = None


@dataclass
class HttpPass:
    requests: list[RequestTiming]
    makespan_s: float
    concurrency: int

    @property
    def ok(self) -> list[RequestTiming]:
        return [r for r in self.requests if r.error is None]

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.ok)

    def summary(self) -> dict:
        ok = self.ok
        ttft = [r.chunk_s[0] - r.sent_s for r in ok if r.chunk_s]
        gaps = [b - a for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:], strict=False)]
        tpot = [
            (r.chunk_s[-1] - r.chunk_s[0]) / (r.completion_tokens - 1)
            for r in ok
            if len(r.chunk_s) > 1 and r.completion_tokens > 1
        ]
        steps = sum(r.engine.get("steps", 0) for r in ok)
        decode_s = sum(r.engine.get("decode_s", 0.0) for r in ok)
        step_tokens = sum(r.engine.get("mean_tau", 0.0) * r.engine.get("steps", 0) for r in ok)
        return {
            "requests": len(self.requests),
            "errors": len(self.requests) - len(ok),
            "concurrency": self.concurrency,
            "makespan_s": self.makespan_s,
            "requests_per_s": len(ok) / self.makespan_s,
            "tokens_per_s": self.tokens / self.makespan_s,
            "ttft_s": percentiles(ttft),
            "inter_chunk_s": percentiles(gaps),
            "tpot_s": percentiles(tpot),
            "server_engine_tokens_per_s": step_tokens / decode_s if decode_s else 0.0,
            "server_step_s_mean": decode_s / steps if steps else 0.0,
            "server_mean_tau": step_tokens / steps if steps else 0.0,
        }


def percentiles(values: list[float], qs: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} (numpy's linear interpolation); NaN when empty."""
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    points = np.percentile(np.asarray(values, dtype=np.float64), qs)
    return {f"p{q}": float(v) for q, v in zip(qs, points, strict=True)}


async def _one(client, body: dict, headers: dict) -> RequestTiming:
    timing = RequestTiming(sent_s=time.perf_counter())
    try:
        async with client.stream("POST", "/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                error = json.loads(await r.aread()).get("error", {})
                timing.error = f"{r.status_code}: {error.get('message', '')}"
                return timing
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    timing.error = chunk["error"].get("message", "stream error")
                    break
                if chunk.get("usage"):
                    timing.completion_tokens = chunk["usage"]["completion_tokens"]
                if "ddtree" in chunk:
                    timing.engine = chunk["ddtree"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    timing.chunk_s.append(time.perf_counter())
                    timing.text += chunk["choices"][0]["text"]
    except Exception as e:  # a refused or dropped connection: counted as this request's error
        timing.error = f"{type(e).__name__}: {e}"
    timing.done_s = time.perf_counter()
    return timing


class LoadClient:
    """Streamed completion requests to ``base_url`` (``http://host:port/v1``), ``concurrency``
    in flight; one event loop and one connection pool for every pass, so a pass pays no
    connection setup that a long-running client would not pay either."""

    def __init__(self, base_url: str, concurrency: int, api_key: str | None = None) -> None:
        import httpx

        self.concurrency = concurrency
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._runner = asyncio.Runner()
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._client = httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits)

    def __enter__(self) -> LoadClient:
        return self

    def __exit__(self, *exc) -> None:
        self._runner.run(self._client.aclose())
        self._runner.close()

    def run(self, bodies: list[dict]) -> HttpPass:
        """Send ``bodies`` (completion requests; streaming and usage are set here)."""
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        return self._runner.run(self._pass([{**b, **stream} for b in bodies]))

    async def _pass(self, bodies: list[dict]) -> HttpPass:
        results: list[RequestTiming | None] = [None] * len(bodies)
        todo = iter(range(len(bodies)))

        async def worker() -> None:
            for i in todo:
                results[i] = await _one(self._client, bodies[i], self._headers)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return HttpPass(list(results), time.perf_counter() - t0, self.concurrency)


@dataclass
class ServerProcess:
    url: str  # http://host:port
    process: subprocess.Popen

    @property
    def base_url(self) -> str:
        """Where the API is (``openai.OpenAI(base_url=...)``)."""
        return f"{self.url}/v1"


@contextmanager
def server_process(args: list[str], stderr: Path, env: dict | None = None, timeout_s=300.0):
    """``ddtree serve --port 0 ARGS`` as a child process until the block ends (then SIGINT,
    as Ctrl-C). Its stderr goes to ``stderr``; waits for the URL line at most ``timeout_s``."""
    import signal

    argv = [sys.executable, "-m", "ddtree", "serve", "--port", "0", *args]
    with stderr.open("w", encoding="utf-8") as err:
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, env=env, encoding="utf-8", errors="replace"
        )
    try:
        line = _first_line(process, timeout_s)
        if not line.startswith(URL_LINE):
            process.kill()
            log = stderr.read_text(encoding="utf-8", errors="replace")
            raise RuntimeError(f"ddtree serve did not start (see its log below):\n{log}")
        yield ServerProcess(line.split()[2].removesuffix("/v1"), process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _first_line(process: subprocess.Popen, timeout_s: float) -> str:
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return lines[0] if lines else ""
