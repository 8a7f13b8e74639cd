"""`ddtree serve --max-batch 4` against the real `openai` client: requests decoded together
(one target forward per step for every running request) each answer exactly what the
request alone answers, a client that leaves drops its row while the others go on, and the
metrics count steps by batch size."""

from __future__ import annotations

import threading

import pytest
from tests.serve.helpers import running_server, scrape, wait_for

from ddtree.cli import main

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

PROMPTS = ["def parse(", "class Reader:\n", "import os\n", "for i in range(", "x = [", "# sum"]
N_TOKENS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve-batch"), "--max-batch", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _alone(capsys, prompt: str) -> str:
    """What `ddtree generate` prints after the prompt on the bundled pair (greedy)."""
    capsys.readouterr()
    argv = ["generate", "--prompt", prompt, "--max-new-tokens", str(N_TOKENS), "--threads", "1"]
    assert main(argv) == 0
    return capsys.readouterr().out[len(prompt) : -1]


def test_concurrent_requests_each_equal_the_request_alone(client, server, capsys):
    before = scrape(server)
    texts: dict[int, str] = {}

    def ask(i: int) -> None:
        resp = client.completions.create(
            model="ddtree-demo", prompt=PROMPTS[i], max_tokens=N_TOKENS, temperature=0
        )
        texts[i] = resp.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(PROMPTS):
        assert texts[i] == _alone(capsys, prompt), prompt
    after = scrape(server)
    batched = sum(
        after.get(f'ddtree_batch_steps_total{{rows="{r}"}}', 0)
        - before.get(f'ddtree_batch_steps_total{{rows="{r}"}}', 0)
        for r in (2, 3, 4)
    )
    assert batched > 0  # some steps decoded several requests together
    assert 'ddtree_batch_steps_total{rows="5"}' not in after  # never more than --max-batch
    assert after["ddtree_running_requests"] == 0


def test_a_client_that_leaves_drops_its_row_and_the_others_go_on(client, server):
    cancelled = 'ddtree_requests_total{endpoint="completions",outcome="cancelled"}'
    before = scrape(server).get(cancelled, 0)
    reference = client.completions.create(model="ddtree-demo", prompt=PROMPTS[1], max_tokens=60)
    done: dict[str, str] = {}

    def long_request() -> None:
        resp = client.completions.create(model="ddtree-demo", prompt=PROMPTS[1], max_tokens=60)
        done["text"] = resp.choices[0].text

    other = threading.Thread(target=long_request)
    other.start()
    body = {"model": "ddtree-demo", "prompt": PROMPTS[0], "max_tokens": 1500, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{server.base_url}/completions", json=body) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data:") for _ in range(6))
    wait_for(lambda: scrape(server).get(cancelled, 0) == before + 1, "the cancel")
    other.join(timeout=60)
    assert done["text"] == reference.choices[0].text
    wait_for(lambda: scrape(server)["ddtree_running_requests"] == 0, "the engine to empty")
