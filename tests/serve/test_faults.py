"""Faults a client can cause, against a real ``ddtree serve`` (the bundled pair, with
``--access-log``): malformed JSON answered 400 and counted, prompts that cannot fit refused
before tokenizing, a client that leaves mid-upload or while queued costs nothing (no
traceback, its queue slot free at once)."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from tests.serve.helpers import scrape, wait_for
from tests.serve.test_shutdown import LONG, Call, _queue_depth, _start

httpx = pytest.importorskip("httpx")

OK = {"model": "ddtree-demo", "prompt": "def f(", "max_tokens": 4}
DEEP = b'{"model": "ddtree-demo", "prompt": "a", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
SURROGATE_KEY = b'{"model": "ddtree-demo", "prompt": "a", "\\udcff": 1}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    proc, url, log = _start(tmp, "--access-log", "--max-queue", "1")
    yield url, log
    proc.terminate()
    proc.wait(timeout=60)


def _scrape(url: str) -> dict:
    return scrape(type("Server", (), {"url": url}))


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


def _post(url: str, raw: bytes, timeout: float = 60):
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{url}/v1/completions", content=raw, headers=headers, timeout=timeout)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (DEEP, "nested too deeply"),
        (SURROGATE_KEY, "surrogate"),
        (b'{"model": "ddtree-demo", "prompt": "' + b"x" * 500_000 + b'"}', "characters"),
        (b'{"model": "ddtree-demo", "prompt": [' + b"5," * 5000 + b"5]}", "tokens"),
    ],
    ids=["1000 deep", "lone surrogate key", "500k characters", "5000 token ids"],
)
def test_malformed_or_hopeless_bodies_get_a_counted_json_400(server, raw, words):
    url, log = server
    before = _scrape(url).get('ddtree_errors_total{status="400"}', 0)
    r = _post(url, raw)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert words in r.json()["error"]["message"]
    after = _scrape(url)['ddtree_errors_total{status="400"}']
    assert after == before + 1
    assert _post(url, _json(OK)).status_code == 200
    assert "Traceback" not in log.read_text()


def test_a_client_that_leaves_mid_upload_leaves_no_traceback(server):
    url, log = server
    host, port = url.removeprefix("http://").rsplit(":", 1)
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 10000\r\n\r\n{\"model\": ")  # fmt: skip
    assert _post(url, _json(OK)).status_code == 200
    assert "Traceback" not in log.read_text()


def test_a_queued_client_that_leaves_frees_its_slot_at_once(server):
    url, _ = server
    running = Call(url, LONG, stream=True)
    running.start()
    assert running.first_data.wait(60)
    gave_up = threading.Thread(
        target=lambda: pytest.raises(httpx.ReadTimeout, _post, url,
                                     _json(LONG), 1.0),
        daemon=True,
    )  # fmt: skip
    gave_up.start()
    wait_for(lambda: _queue_depth(url) == 1, "the request to queue")
    gave_up.join()
    # freed while the running decode goes on, not when the engine reaches the job
    wait_for(lambda: _queue_depth(url) == 0, "its slot to be freed", timeout_s=5)
    assert _scrape(url)["ddtree_running_requests"] == 1
    running.join(120)


def test_access_log_logs_every_request(server):
    url, log = server
    httpx.get(f"{url}/health")
    wait_for(lambda: '"GET /health HTTP/1.1" 200' in log.read_text(), "an access log line", 10)
