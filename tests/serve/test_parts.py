"""The pieces of the server that need no server: streamed text with stop strings, the chat
template helper, the listening socket."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.serve.helpers import chat_checkpoint

from ddtree.commands._decode import DEMO_DIR, TextCodec
from ddtree.serve.app import Pacer
from ddtree.serve.chat import ChatTemplate, ChatTemplateError
from ddtree.serve.server import bind, url_of
from ddtree.serve.text import CompletionText

EOS = 0


class Pieces:
    """A tokenizer whose token i decodes to ``PIECES[i]`` (EOS to a marker)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_worked_example_of_the_docstring():
    text = CompletionText(Pieces(["<eos>", "x", "a", "bz"]), frozenset({EOS}), ("ab",))
    assert [text.push([1]), text.push([2]), text.push([3])] == ["", "x", ""]
    assert text.finish() == "" and text.text == "x"


def test_eos_text_is_left_out_and_held_text_comes_at_the_end():
    text = CompletionText(Pieces(["<eos>", "ab", "cd"]), frozenset({EOS}), ("zzz",))
    assert text.push([1, 2]) == "ab"  # 2 characters held back for a 3-character stop
    assert text.push([EOS]) == ""
    assert text.finish() == "cd" and text.text == "abcd"


PIECE = st.text(alphabet="ab\n", min_size=0, max_size=3)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(PIECE, min_size=1, max_size=12),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), max_size=3),
    split=st.integers(1, 4),
)
def test_streamed_text_is_the_text_before_the_first_stop(pieces, stops, split):
    # the engine's side: tokens up to the one whose text completes a stop string
    tokens, so_far = [], ""
    for i, piece in enumerate(pieces, start=1):
        tokens.append(i)
        so_far += piece
        if any(s in so_far for s in stops):
            break
    starts = [so_far.find(s) for s in stops if s in so_far]
    expected = so_far[: min(starts)] if starts else so_far
    # the server's side: the tokens arrive in steps of `split`
    text = CompletionText(Pieces(["<eos>", *pieces]), frozenset({EOS}), tuple(stops))
    sent = [text.push(tokens[j : j + split]) for j in range(0, len(tokens), split)]
    sent.append(text.finish())
    assert "".join(sent) == expected == text.text
    # nothing sent is ever part of a stop string
    assert not any(s in "".join(sent) for s in stops)


def test_a_checkpoint_without_a_template_says_so():
    template = ChatTemplate.load(DEMO_DIR / "target")
    assert not template.available
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        template.prompt_ids([{"role": "user", "content": "hi"}])


def test_prompt_ids_are_the_rendered_template_tokenized(tmp_path):
    template = ChatTemplate.load(chat_checkpoint(tmp_path / "ckpt"))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = template.prompt_ids(messages)
    codec = TextCodec(DEMO_DIR / "target")
    assert ids == codec.encode("# system: be brief\n# user: hi\n# assistant:\n")


def test_a_template_that_refuses_the_messages_is_a_chat_template_error(tmp_path):
    folder = chat_checkpoint(tmp_path / "ckpt")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.load(folder)
    assert template.prompt_ids([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="first must be user"):
        template.prompt_ids([{"role": "assistant", "content": "hi"}])


def test_the_socket_is_tcp_so_asyncio_turns_nagle_off():
    # asyncio sets TCP_NODELAY on accepted sockets only when the listener's proto is TCP;
    # with proto 0 every kept-alive response waited for the client's delayed ACK
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP and sock.type == socket.SOCK_STREAM
        host, port = sock.getsockname()
        assert port > 0 and url_of(sock) == f"http://127.0.0.1:{port}"
    finally:
        sock.close()


def test_an_address_in_use_is_one_error_naming_it():
    taken = bind("127.0.0.1", 0)
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"--host/--port 127.0.0.1:{port}: cannot listen"):
            bind("127.0.0.1", port).listen(1)
    finally:
        taken.close()


def _refuse_to_load(*args, **kwargs):  # serve got past its checks: stop before loading
    raise ValueError("stopped before loading")


@pytest.mark.parametrize(
    ("host", "key", "warned"),
    [("0.0.0.0", None, True), ("::", None, True), ("0.0.0.0", "k3y", False),
     ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False)],
)  # fmt: skip
def test_a_bind_beyond_this_machine_without_a_key_warns(host, key, warned, capsys, monkeypatch):
    from ddtree.cli import main

    monkeypatch.delenv("DDTREE_API_KEY", raising=False)
    monkeypatch.setattr("ddtree.commands.serve.load_models", _refuse_to_load)
    argv = ["serve", "--port", "0", "--host", host, "--policy", "ar"]
    assert main(argv + ([] if key is None else ["--api-key", key])) == 2
    err = capsys.readouterr().err
    assert ("warning: --host" in err and "no --api-key" in err) == warned, err


def test_secret_flag_values_are_redacted_from_the_command_line():
    from ddtree.provenance import redact_argv

    argv = ["ddtree", "serve", "--api-key", "s3cret", "--hf-token=tok", "--max-new-tokens", "32"]
    argv += ["--client-secret", "x", "--token", "y", "--prompt", "key"]
    assert redact_argv(argv) == [
        "ddtree", "serve", "--api-key", "***", "--hf-token=***", "--max-new-tokens", "32",
        "--client-secret", "***", "--token", "***", "--prompt", "key",
    ]  # fmt: skip


class Clocks:
    wall = cpu = 0.0


def _pacer(busy: list[bool]) -> tuple[Pacer, Clocks]:
    c = Clocks()
    pacer = Pacer(lambda: busy[0], share=0.1, window_s=0.25, max_wait_s=0.05,
                  wall=lambda: c.wall, cpu=lambda: c.cpu)  # fmt: skip
    return pacer, c


def test_the_pacer_holds_requests_back_only_while_the_engine_runs():
    busy = [False]
    pacer, c = _pacer(busy)
    c.cpu, c.wall = 1.0, 1.0  # the loop used all its time: nothing decodes, nothing waits
    assert pacer.wait_s() == 0.0
    busy[0] = True
    assert pacer.wait_s() == 0.0  # the window starts
    c.wall, c.cpu = 1.1, 1.005  # 5 ms of loop CPU in 100 ms: under 10%
    assert pacer.wait_s() == 0.0
    c.wall, c.cpu = 1.12, 1.012  # 12 ms in 120 ms: 10%, the share exactly
    assert pacer.wait_s() == pytest.approx(0.0)
    c.wall, c.cpu = 1.13, 1.015  # 15 ms in 130 ms: due 150 ms, so 20 ms to wait
    assert pacer.wait_s() == pytest.approx(0.02)
    c.cpu = 1.1  # 100 ms of CPU: 1 s due, but one wait is at most max_wait_s
    assert pacer.wait_s() == pytest.approx(0.05)
    c.wall = 1.3  # past the window: a new one starts, the debt is forgotten
    assert pacer.wait_s() == 0.0
    busy[0] = False
    c.cpu += 1.0
    assert pacer.wait_s() == 0.0


def test_a_paced_request_sleeps_on_the_event_loop_and_the_wait_is_counted():
    import asyncio

    pacer, c = _pacer([True])
    assert pacer.wait_s() == 0.0
    c.wall, c.cpu = 0.01, 0.01  # 10 ms CPU in 10 ms: 90 ms due, 50 ms at most
    asyncio.run(pacer())
    assert pacer.waited_s == pytest.approx(0.05)
