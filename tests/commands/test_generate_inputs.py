"""`ddtree generate`'s prompt inputs: --prompt-file, stdin, and chats through the checkpoint's
template (--chat, --messages), on the bundled pair."""

from __future__ import annotations

import io
import json
import sys

import pytest
from tests.serve.helpers import chat_checkpoint

from ddtree.cli import main
from ddtree.commands._decode import DEMO_DIR

DRAFTER = str(DEMO_DIR / "drafter")
PROMPT = "def parse(line):\n    "
DECODE = ["--max-new-tokens", "12", "--threads", "1", "--budget", "8"]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("chat") / "target")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(["generate", *argv, *DECODE])
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_prompt_file_and_stdin_give_what_the_prompt_gives(tmp_path, capsys, monkeypatch):
    code, expected, _ = _run(capsys, "--prompt", PROMPT)
    assert code == 0 and expected.startswith(PROMPT) and len(expected) > len(PROMPT) + 1
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT)
    assert _run(capsys, "--prompt-file", str(path))[:2] == (0, expected)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(PROMPT.encode())))
    assert _run(capsys, "--prompt-file", "-")[:2] == (0, expected)


def _library_reply(target_dir, messages) -> str:
    """The reply the engine gives to the template's ids: what --chat must print."""
    from ddtree.commands._decode import TextCodec
    from ddtree.engine import DecodeConfig, generate
    from ddtree.models import load_drafter, load_target
    from ddtree.serve.chat import ChatTemplate

    ids = ChatTemplate.load(target_dir).prompt_ids(messages)
    target = load_target(target_dir)
    drafter = load_drafter(DEMO_DIR / "drafter", target)
    cfg = DecodeConfig("ddtree", block_size=8, budget=8, max_new_tokens=12)
    return generate(target, drafter, ids, cfg, TextCodec(target_dir)).text


def test_chat_renders_the_template_and_prints_only_the_reply(chat_target, tmp_path, capsys):
    question = "parse a config file"
    code, out, _ = _run(
        capsys, "--target", str(chat_target), "--drafter", DRAFTER, "--chat", "--prompt", question
    )
    reply = _library_reply(chat_target, [{"role": "user", "content": question}])
    assert code == 0 and out == reply + "\n" and question not in out
    messages = [
        {"role": "system", "content": "answer in Python"},
        {"role": "user", "content": question},
    ]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"model": "any", "messages": messages}))  # a request body
    code, out, _ = _run(capsys, "--target", str(chat_target), "--drafter", DRAFTER,
                        "--messages", str(path))  # fmt: skip
    assert code == 0 and out == _library_reply(chat_target, messages) + "\n"


def test_a_chat_without_a_template_fails_before_the_models_load(capsys, monkeypatch):
    import ddtree.commands.generate as generate_command

    def no_load(*args, **kwargs):
        raise AssertionError("the models loaded before the template was checked")

    monkeypatch.setattr(generate_command, "load_models", no_load)
    code, out, err = _run(capsys, "--chat", "--prompt", "hi")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "has no chat template" in err and "generate without --chat" in err


@pytest.mark.parametrize(
    "content,expected",
    [
        ("not json", "--messages {path}: not JSON"),
        ("[]", "expected a non-empty JSON list of messages"),
        ('{"prompt": "x"}', "expected a non-empty JSON list of messages"),
        ('[{"role": "user", "content": "a"}, {"role": "bot"}]', "message 1: role: Input should"),
        ('[{"role": "user", "content": 3}]', "message 0: content: "),
        ('[{"role": "user", "content": "a", "extra": 1}]', "message 0: extra: "),
    ],
)
def test_bad_messages_are_one_line_naming_the_file_and_message(tmp_path, capsys, content, expected):
    path = tmp_path / "m.json"
    path.write_text(content)
    code, out, err = _run(capsys, "--messages", str(path))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert expected.format(path=path) in err


def test_bad_prompt_inputs_are_one_line_errors(tmp_path, capsys, monkeypatch):
    folder, empty, binary = tmp_path / "d", tmp_path / "empty.txt", tmp_path / "bin.txt"
    folder.mkdir()
    empty.write_text("")
    binary.write_bytes(b"def \xff\xfe(")
    for argv, expected in (
        (["--prompt-file", str(tmp_path / "missing.txt")], "missing.txt: No such file"),
        (["--prompt-file", str(folder)], "is a folder; expected a regular text file"),
        (["--prompt-file", str(empty)], "empty; expected a prompt"),
        (["--prompt-file", str(binary)], "not UTF-8 text (invalid start byte at byte 4)"),
        (["--prompt", ""], "--prompt: empty"),
        (["--prompt", "a\udcff"], "--prompt: not valid UTF-8 text"),
        (["--prompt", "a", "--prompt-file", str(empty)], "not allowed with argument"),
    ):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1, (argv, err)
        assert expected in err, (argv, err)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    code, _, err = _run(capsys, "--messages", "-")
    assert code == 2 and "--messages stdin: empty" in err
