"""`ddtree serve` under load (slow: CI runs them): 16 clients at once, the queue's limit, and
the load benchmark. One server for the module, on the bundled pair as it ships."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.serve.helpers import running_server, scrape, wait_for

from ddtree.cli import main
from ddtree.commands._decode import demo_prompts

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

MODEL = "ddtree-demo"
CLIENTS = 16
MAX_QUEUE = CLIENTS - 1  # 16 clients at once: one decoding, 15 waiting, none refused


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve"), "--max-queue", str(MAX_QUEUE)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _complete(client, request: dict) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of one completion, streamed or not."""
    if not request.get("stream"):
        r = client.completions.create(model=MODEL, **request)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(
        client.completions.create(model=MODEL, **request, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens


def test_sixteen_clients_at_once_each_get_their_own_output(client, server):
    prompts = demo_prompts()[:CLIENTS]
    requests = []
    for i, prompt in enumerate(prompts):  # greedy and seeded sampling, streamed and not
        sampling = {"temperature": 0.8, "seed": i} if i % 2 else {}
        requests.append({"prompt": prompt, "max_tokens": 16, "stream": i % 3 == 0, **sampling})
    alone = [_complete(client, r) for r in requests]
    before = scrape(server)
    start = threading.Barrier(CLIENTS)

    def together(request):
        start.wait()
        return _complete(client, request)

    with ThreadPoolExecutor(CLIENTS) as pool:
        at_once = list(pool.map(together, requests))
    assert at_once == alone
    assert len({text for text, _, _ in alone}) == CLIENTS  # 16 different outputs to mix up
    after = scrape(server)
    finished = 'ddtree_requests_total{endpoint="completions",outcome="finished"}'
    assert after[finished] - before[finished] == CLIENTS
    assert 'ddtree_errors_total{status="503"}' not in after


def _post(server, body: dict):
    return httpx.post(f"{server.base_url}/completions", json=body, timeout=120)


def test_past_the_queue_limit_requests_get_503_with_retry_after(server):
    short = {"model": MODEL, "prompt": "def f(", "max_tokens": 8}
    hold = {**short, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=hold, timeout=120) as held:
        lines = held.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it is decoding
        with ThreadPoolExecutor(MAX_QUEUE) as pool:
            waiting = [pool.submit(_post, server, short) for _ in range(MAX_QUEUE)]
            wait_for(lambda: scrape(server)["ddtree_queue_depth"] == MAX_QUEUE, "a full queue")
            refused = _post(server, short)
            assert refused.status_code == 503
            assert int(refused.headers["Retry-After"]) >= 1
            error = refused.json()["error"]
            assert error["code"] == "queue_full" and f"--max-queue {MAX_QUEUE}" in error["message"]
            held.close()  # the long request goes; the queue drains
            assert [f.result().status_code for f in waiting] == [200] * MAX_QUEUE
    assert _post(server, short).status_code == 200


def test_chat_on_a_checkpoint_without_a_template_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


COMMON = ["--requests", "2", "--repeats", "2", "--max-new-tokens", "16", "--threads", "1"]


def _bench(capsys, *argv: str) -> dict:
    """``bench serve --json``: stdout is one JSON document and nothing else."""
    capsys.readouterr()
    assert main(["bench", "serve", *COMMON, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _check_bench(result: dict) -> None:
    http = result["http"]
    assert http["requests"] == 4 and http["errors"] == 0
    assert result["same_steps"]  # the server did the same work as the in-process passes
    assert 0 < http["ttft_s"]["p50"] <= http["ttft_s"]["p99"]
    assert http["server_mean_tau"] > 1 and http["server_engine_tokens_per_s"] > 0
    assert result["in_process"]["engine_tokens_per_s"] > 0
    pooled = result["overhead_pooled"]
    # derived from the makespans: (http - in-process) / tokens, and its two shares
    tokens = http["requests"] * result["max_tokens"]
    gap = http["makespan_s"] - result["in_process"]["makespan_s"]
    assert pooled["overhead_per_token_s"] == pytest.approx(gap / tokens)
    assert pooled["share_of_step"] == pytest.approx(
        pooled["overhead_per_token_s"] / result["in_process"]["step_s_mean"]
    )


def test_bench_serve_against_a_running_server(server, capsys):
    _check_bench(_bench(capsys, "--url", server.url, "--concurrency", "2"))
    # without --json: the summary lines, and no JSON among them
    assert main(["bench", "serve", *COMMON, "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert "HTTP overhead per token" in out and "TTFT p50/p90/p99" in out
    assert "1 thread (--threads)" in out and "{" not in out


def test_bench_serve_starts_its_own_server(capsys):
    _check_bench(_bench(capsys, "--policy", "chain"))


def test_bench_serve_flood_compares_the_step_time_idle_and_under_a_flood(server, capsys):
    argv = ["bench", "serve", "--flood", "--url", server.url, "--repeats", "1"]
    argv += ["--max-new-tokens", "16", "--flood-clients", "1", "--flood-bytes", "200000"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bench"] == "serve --flood" and result["step_ms_idle_median"] > 0
    assert result["ratio"] == pytest.approx(
        result["step_ms_flood_median"] / result["step_ms_idle_median"]
    )
    # every flooding prompt is too long for the context: refused, none decoded
    assert set(result["flood_statuses"]) <= {"400"}
