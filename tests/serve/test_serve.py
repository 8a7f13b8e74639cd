"""`ddtree serve` against the real `openai` client (and raw HTTP for what a client would not
send): one server for the module, on the bundled pair with a chat template added."""

from __future__ import annotations

import json

import pytest
from tests.serve.helpers import chat_checkpoint, running_server, scrape, wait_for

from ddtree.cli import main
from ddtree.commands._decode import DEMO_DIR
from ddtree.records import read_records
from ddtree.vocab import STEP_STAGES

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "test-key"
MODEL = "demo-chat"
MAX_BODY = 65536
PROMPTS = ["def parse(", "class Reader:\n    def __init__(self"]
N_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("chat-target"))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return tmp_path_factory.mktemp("records") / "served.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint, records):
    args = ["--target", str(checkpoint), "--drafter", str(DEMO_DIR / "drafter")]
    args += ["--model-name", MODEL, "--api-key", KEY, "--max-body-bytes", str(MAX_BODY)]
    args += ["--records", str(records)]
    with running_server(tmp_path_factory.mktemp("serve"), *args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


def generate_cli(capsys, checkpoint, prompt: str, *extra: str) -> str:
    """What `ddtree generate` prints after the prompt (greedy, the server's defaults)."""
    argv = ["generate", "--target", str(checkpoint), "--drafter", str(DEMO_DIR / "drafter")]
    capsys.readouterr()
    assert main([*argv, "--prompt", prompt, "--threads", "1", *extra]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and out.endswith("\n")
    return out[len(prompt) : -1]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_ddtree_generate(client, checkpoint, capsys, prompt):
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS)
    expected = generate_cli(capsys, checkpoint, prompt, "--max-new-tokens", str(N_TOKENS))
    (choice,) = resp.choices
    assert choice.text == expected
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == N_TOKENS
    assert resp.model == MODEL and resp.object == "text_completion"


def test_usage_and_the_ddtree_extension_agree(client, server):
    from ddtree.commands._decode import TextCodec

    prompt = PROMPTS[0]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS)
    prompt_tokens = len(TextCodec(DEMO_DIR / "target").encode(prompt))
    u = resp.usage
    assert (u.prompt_tokens, u.total_tokens) == (prompt_tokens, prompt_tokens + N_TOKENS)
    ext = resp.ddtree  # the extension field (the client keeps unknown fields)
    # the prefill picks the first token; the steps commit the rest, tau at a time
    assert ext["mean_tau"] * ext["steps"] == pytest.approx(N_TOKENS - 1)
    assert 1 <= ext["mean_tau"] <= 8  # at most the block (B = 8)
    assert ext["tokens_per_s"] == pytest.approx(ext["mean_tau"] / ext["step_s_mean"])
    assert ext["policy"] == "ddtree" and ext["engine_mode"] == "eager"
    assert ext["stop_reason"] == "max_new_tokens"


def test_token_id_prompt_equals_the_text_prompt(client):
    from ddtree.commands._decode import TextCodec

    ids = TextCodec(DEMO_DIR / "target").encode(PROMPTS[1])
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def _streamed(stream) -> tuple[str, list, object]:
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks, chunks[-1]


@pytest.mark.parametrize("stop", [None, ["):"], ["\n", "self"]])
def test_streamed_completion_deltas_concatenate_to_the_whole_text(client, stop):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, stop=stop)
    whole = client.completions.create(**kwargs)
    text, chunks, last = _streamed(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert text == whole.choices[0].text
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    final = chunks[-2].choices[0]
    assert final.finish_reason == whole.choices[0].finish_reason
    if stop:  # OpenAI's semantics: the text ends before the stop string
        assert final.finish_reason == "stop"
        plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS)
        assert plain.choices[0].text.startswith(text)
        assert not any(s in text for s in stop)
        assert any(plain.choices[0].text[len(text) :].startswith(s) for s in stop)


def test_a_long_completion_streams_in_many_deltas(client):
    """Deltas go out as steps commit. Steps that queue up while the HTTP side waits (it runs at
    nice 10, below the engine) go out as one delta, so a short request on a saturated machine
    can arrive whole; 200 tokens take dozens of steps, long enough for the loop to send."""
    _, chunks, _ = _streamed(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=200, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1


def test_chat_renders_the_checkpoints_template(client, checkpoint, capsys):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "parse a config file"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N_TOKENS)
    rendered = AutoTokenizer.from_pretrained(str(checkpoint)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert rendered == "# user: parse a config file\n# assistant:\n"
    expected = generate_cli(capsys, checkpoint, rendered, "--max-new-tokens", str(N_TOKENS))
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert resp.object == "chat.completion" and resp.usage.completion_tokens == N_TOKENS


def test_streamed_chat_deltas_concatenate_to_the_whole_message(client):
    messages = [
        {"role": "system", "content": "you write Python"},
        {"role": "user", "content": [{"type": "text", "text": "read a file"}]},
    ]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N_TOKENS)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=N_TOKENS, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].object == "chat.completion.chunk"


def test_seeded_sampling_repeats_and_seeds_differ(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=1.0)
    a = client.completions.create(**kwargs, seed=1, extra_body={"top_k": 50})
    b = client.completions.create(**kwargs, seed=1, extra_body={"top_k": 50})
    c = client.completions.create(**kwargs, seed=2, extra_body={"top_k": 50})
    assert a.choices[0].text == b.choices[0].text
    assert a.ddtree["seed"] == 1 and c.ddtree["seed"] == 2
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS)
    # sampled at T = 1 from a small model: three identical 24-token texts would be a bug
    assert len({a.choices[0].text, c.choices[0].text, greedy.choices[0].text}) > 1


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS)
    m = scrape(server)
    assert m['ddtree_requests_total{endpoint="completions",outcome="finished"}'] >= 1
    assert m["ddtree_generation_tokens_total"] >= N_TOKENS
    assert m["ddtree_prompt_tokens_total"] >= 1
    assert 1 < m["ddtree_mean_tau"] <= 8
    assert m["ddtree_mean_tau"] == pytest.approx(
        m["ddtree_step_tokens_total"] / m["ddtree_steps_total"]
    )
    assert m["ddtree_tokens_per_second"] == pytest.approx(
        m["ddtree_step_tokens_total"] / m["ddtree_decode_seconds_total"]
    )
    stages = {k for k in m if k.startswith("ddtree_step_stage_seconds_mean")}
    assert stages == {f'ddtree_step_stage_seconds_mean{{stage="{s}"}}' for s in STEP_STAGES}
    assert sum(m[k] for k in stages) == pytest.approx(m["ddtree_step_seconds_mean"])
    assert m["ddtree_queue_depth"] == 0 and m["ddtree_running_requests"] == 0
    assert m["ddtree_time_to_first_token_seconds_count"] >= 1


def test_each_finished_request_appends_an_engine_run_record(client, records):
    before = len(read_records(records)) if records.exists() else 0
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N_TOKENS)
    new = wait_for(lambda: records.exists() and read_records(records)[before:], "its record")
    rec = new[-1]
    assert rec.kind == "engine_run" and rec.provenance.producer == "ddtree serve"
    assert rec.config["policy"] == "ddtree" and rec.config["endpoint"] == "completions"
    assert rec.summary["new_tokens"] == resp.usage.completion_tokens
    assert rec.summary["steps"] == resp.ddtree["steps"]
    assert rec.summary["mean_tau"] == pytest.approx(resp.ddtree["mean_tau"])
    # records are made to be shared: the API key is not in the provenance's command line
    assert KEY not in rec.provenance.command and "--api-key ***" in rec.provenance.command


def test_disconnect_mid_stream_stops_the_decode_and_frees_the_engine(client, server):
    long_tokens = 1500
    before = scrape(server)
    reference = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N_TOKENS)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": long_tokens, "stream": True}
    body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()
        data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
        assert data  # tokens were flowing when the client hung up
    cancelled = 'ddtree_requests_total{endpoint="completions",outcome="cancelled"}'
    after = wait_for(
        lambda: (m := scrape(server)).get(cancelled, 0) > before.get(cancelled, 0) and m,
        "the server to notice the disconnect",
    )
    assert after["ddtree_cancelled_decodes_total"] == before["ddtree_cancelled_decodes_total"] + 1
    sent = after["ddtree_generation_tokens_total"] - before["ddtree_generation_tokens_total"]
    assert sent - N_TOKENS < long_tokens / 4  # stopped long before its 1500 tokens
    assert after["ddtree_running_requests"] == 0
    # the engine is free and clean: the next request decodes exactly as before
    again = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N_TOKENS)
    assert again.choices[0].text == reference.choices[0].text


def test_a_non_streamed_client_that_gives_up_cancels_its_decode(server):
    cancelled = 'ddtree_requests_total{endpoint="completions",outcome="cancelled"}'
    before = scrape(server).get(cancelled, 0)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client leaves long before 1500 tokens
        _post(server, body, timeout=0.5)
    wait_for(lambda: scrape(server).get(cancelled, 0) == before + 1, "the cancel")
    assert scrape(server)["ddtree_running_requests"] == 0
    assert _post(server, OK).status_code == 200


def test_client_errors_come_as_the_openai_exceptions(server):
    bad_key = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.completions.create(model=MODEL, prompt="x", max_tokens=2)
    good = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        good.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        good.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="logprobs = 2 is not supported"):
        good.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs = true is not supported"):
        good.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True
        )


def _post(server, body, path="/v1/completions", auth=f"Bearer {KEY}", raw=None, timeout=60.0):
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=timeout)


OK = {"model": MODEL, "prompt": "def f(", "max_tokens": 4}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [
    # (case, body or raw bytes, path, status, param, words in the message)
    ("malformed JSON", b'{"model": "demo-chat", "prompt": ', None, 400, None, "not valid JSON"),
    ("not an object", b"[1, 2]", None, 400, None, "JSON object"),
    ("not UTF-8", b'{"prompt": "\xff"}', None, 400, None, "not valid JSON"),
    ("prompt a lone surrogate", b'{"model": "demo-chat", "prompt": "a\\udcff"}', None, 400, "prompt", "surrogate"),
    ("message a lone surrogate", b'{"model": "demo-chat", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "/v1/chat/completions", 400, "messages[0].content", "surrogate"),
    ("stop a lone surrogate", b'{"model": "demo-chat", "prompt": "a", "stop": "\\udcff"}', None, 400, "stop", "surrogate"),
    ("max_tokens a string", {**OK, "max_tokens": "ten"}, None, 400, "max_tokens", "integer"),
    ("max_tokens negative", {**OK, "max_tokens": -3}, None, 400, "max_tokens", "greater than or equal to 1"),
    ("max_tokens zero", {**OK, "max_tokens": 0}, None, 400, "max_tokens", "greater than or equal to 1"),
    ("max_tokens a bool", {**OK, "max_tokens": True}, None, 400, "max_tokens", "integer"),
    ("temperature NaN", b'{"model": "demo-chat", "prompt": "a", "temperature": NaN}', None,
     400, "temperature", "finite"),
    ("temperature inf", b'{"model": "demo-chat", "prompt": "a", "temperature": Infinity}', None,
     400, "temperature", "finite"),
    ("temperature negative", {**OK, "temperature": -0.5}, None, 400, "temperature", "greater than or equal to 0"),
    ("temperature a string", {**OK, "temperature": "hot"}, None, 400, "temperature", "number"),
    ("temperature underflows", {**OK, "temperature": 1e-45}, None, 400, "temperature", "at least 1e-30"),
    ("top_p underflows", {**OK, "top_p": 1e-300}, None, 400, "top_p", "at least 1e-30"),
    ("top_p zero", {**OK, "top_p": 0}, None, 400, "top_p", "greater than 0"),
    ("top_p above 1", {**OK, "top_p": 1.5}, None, 400, "top_p", "less than or equal to 1"),
    ("top_k negative", {**OK, "top_k": -1}, None, 400, "top_k", "greater than or equal to 0"),
    ("seed negative", {**OK, "seed": -1}, None, 400, "seed", "greater than or equal to 0"),
    ("seed too large", {**OK, "seed": 2**64}, None, 400, "seed", "less than or equal to"),
    ("stream a string", {**OK, "stream": "yes"}, None, 400, "stream", "boolean"),
    ("stop too many", {**OK, "stop": ["a", "b", "c", "d", "e"]}, None, 400, "stop", "at most 4"),
    ("stop empty", {**OK, "stop": [""]}, None, 400, "stop", "non-empty"),
    ("prompt a number", {**OK, "prompt": 5}, None, 400, "prompt", "string"),
    ("prompt empty", {**OK, "prompt": ""}, None, 400, "prompt", "non-empty"),
    ("two prompts", {**OK, "prompt": ["a", "b"]}, None, 400, "prompt", "one prompt"),
    ("token id past vocab", {**OK, "prompt": [1, 99999]}, None, 400, "prompt", "vocabulary"),
    ("missing model", {"prompt": "a"}, None, 400, "model", "required"),
    ("unknown parameter", {**OK, "max_token": 5}, None, 400, "max_token", "unknown"),
    ("n = 3", {**OK, "n": 3}, None, 400, "n", "n = 1"),
    ("echo", {**OK, "echo": True}, None, 400, "echo", "not supported"),
    ("best_of", {**OK, "best_of": 3}, None, 400, "best_of", "only best_of = 1"),
    ("logit_bias", {**OK, "logit_bias": {"5": 1.0}}, None, 400, "logit_bias", "not supported"),
    ("top_logprobs", {**CHAT_OK, "top_logprobs": 2}, "/v1/chat/completions", 400,
     "top_logprobs", "only top_logprobs = null"),
    ("penalty", {**OK, "presence_penalty": 0.5}, None, 400, "presence_penalty", "not supported"),
    ("context exceeded", {**OK, "max_tokens": 4000}, None, 400, "max_tokens", "max_position 2048"),
    ("messages not a list", {**CHAT_OK, "messages": "hi"}, "/v1/chat/completions", 400,
     "messages", "list"),
    ("no messages", {**CHAT_OK, "messages": []}, "/v1/chat/completions", 400, "messages",
     "at least 1"),
    ("bad role", {**CHAT_OK, "messages": [{"role": "robot", "content": "x"}]},
     "/v1/chat/completions", 400, "messages[0].role", "'user'"),
    ("image part", {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "/v1/chat/completions", 400, "messages[0].content", "text"),
    ("unknown model", {**OK, "model": "gpt-4"}, None, 404, "model", "does not exist"),
    ("huge body", {**OK, "prompt": "x" * (2 * MAX_BODY)}, None, 413, None, "exceeds the limit"),
    ("no route", OK, "/v1/nowhere", 404, None, "Not Found"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests_get_a_json_error_and_the_server_keeps_serving(server, case):
    _, body, path, status, param, words = case
    raw = body if isinstance(body, bytes) else None
    r = _post(server, None if raw else body, path or "/v1/completions", raw=raw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"]
    assert error["param"] == param
    assert _post(server, OK).status_code == 200


@pytest.mark.parametrize("auth", [None, "Bearer wrong", KEY, f"Bearer {KEY}x", f"Basic {KEY}"])
def test_a_missing_or_wrong_key_gets_401_on_v1_only(server, auth):
    for path, body in (("/v1/completions", OK), ("/v1/chat/completions", CHAT_OK)):
        r = _post(server, body, path, auth=auth)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    headers = {} if auth is None else {"Authorization": auth}
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{server.url}/metrics").status_code == 200


@pytest.mark.parametrize("auth", [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"])
def test_the_bearer_scheme_is_case_insensitive(server, auth):
    assert _post(server, OK, auth=auth).status_code == 200  # RFC 7235


def test_wrong_method_is_a_json_405(server):
    r = httpx.get(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "Method Not Allowed" in r.json()["error"]["message"]


def test_errors_are_counted_by_status(server):
    before = scrape(server).get('ddtree_errors_total{status="400"}', 0)
    assert _post(server, {**OK, "max_tokens": -1}).status_code == 400
    assert scrape(server)['ddtree_errors_total{status="400"}'] == before + 1
