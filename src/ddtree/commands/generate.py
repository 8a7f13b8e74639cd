"""`ddtree generate`: stream a completion from a local target (and drafter).

The prompt is text (``--prompt``, ``--prompt-file FILE``, ``--prompt-file -`` for stdin),
echoed before the completion; or a chat (``--chat`` sends that text as one user message,
``--messages FILE`` a JSON list of messages), rendered by the checkpoint's own chat template
with the generation prompt (``ddtree.serve.chat.ChatTemplate``), and then only the reply is
printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from ddtree.commands._args import records_file, threads_label
from ddtree.commands._decode import (
    PROMPT_FILE_LIMIT,
    add_decode_arguments,
    add_model_arguments,
    add_policy_arguments,
    decode_config,
    load_models,
    model_paths,
)
from ddtree.files import read_input_bytes
from ddtree.utf8 import check_text, decode_text

STDIN = "-"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument(
        "--prompt-file", metavar="FILE", help="read the prompt text from FILE ('-': stdin)"
    )
    source.add_argument(
        "--messages",
        metavar="FILE",
        help='chat messages from FILE (\'-\': stdin): a JSON list of {"role", "content"} '
        'objects (or a chat request body with "messages"), rendered by the chat template',
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as one user message through the checkpoint's chat template "
        "(chat_template in tokenizer_config.json, or chat_template.jinja) and print only the "
        "reply",
    )
    add_policy_arguments(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print tau and tokens/s to stderr")
    p.add_argument(
        "--records",
        type=records_file,
        help="append an engine_run measurement record to this JSONL file",
    )
    add_decode_arguments(p, max_new_tokens=128)


def _read(path: str, what: str) -> str:
    """The text of ``path`` ('-': stdin), or a one-line error naming it."""
    if path == STDIN:
        try:
            data, name = sys.stdin.buffer.read(PROMPT_FILE_LIMIT + 1), "stdin"
        except OSError as e:  # closed (`<&-`, ddtree.streams) or unreadable
            raise ValueError(f"{what} -: cannot read stdin: {e.strerror or e}") from None
        if len(data) > PROMPT_FILE_LIMIT:
            raise ValueError(f"{what} -: stdin holds more than {PROMPT_FILE_LIMIT:,} bytes")
    else:
        try:  # a regular file only, checked before it is opened (a FIFO would block, a
            # device such as /dev/zero never ends), and never more than the limit read
            data, name = read_input_bytes(path, "a regular text file", PROMPT_FILE_LIMIT), path
        except FileNotFoundError:
            raise ValueError(f"{what} {path}: No such file or directory") from None
        except OSError as e:
            raise ValueError(f"{what} {path}: {e.strerror or e}") from None
    text = decode_text(data, f"{what} {name}")
    if not text:
        raise ValueError(f"{what} {name}: empty; expected a prompt")
    return text


def read_messages(text: str, name: str) -> list[dict[str, str]]:
    """Chat messages from JSON: a list of messages, or an object with ``"messages"`` (a chat
    request body); each checked as ``ddtree serve`` checks a request's messages."""
    from pydantic import ValidationError

    from ddtree.serve.protocol import ChatMessage

    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--messages {name}: not JSON ({e})") from None
    messages = doc.get("messages") if isinstance(doc, dict) else doc
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"--messages {name}: expected a non-empty JSON list of messages "
            '[{"role": "user", "content": "..."}] or an object with "messages"'
        )
    out = []
    for i, message in enumerate(messages):
        try:
            out.append(ChatMessage.model_validate(message).for_template())
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(x) for x in error["loc"]) or "message"
            raise ValueError(f"--messages {name}: message {i}: {where}: {error['msg']}") from None
        for key, value in out[-1].items():  # a JSON "\udcff" escape is a lone surrogate
            check_text(value, f"--messages {name}: message {i}: {key}")
    return out


def prompt_text(args: argparse.Namespace) -> str:
    if args.prompt is None:
        return _read(args.prompt_file, "--prompt-file")
    if not args.prompt:
        raise ValueError("--prompt: empty; expected a prompt")
    return check_text(args.prompt, "--prompt")  # undecodable bytes arrive as lone surrogates


def run(args: argparse.Namespace) -> int:
    from ddtree.commands._output import note

    config = decode_config(
        args, args.policy, stop_strings=tuple(args.stop), engine_mode=args.engine_mode
    )
    prompt = _Prompt.read(args, config.rules.needs_drafter)  # before the models load
    models = load_models(
        args,
        need_drafter=config.rules.needs_drafter,
        engine_modes=(args.engine_mode,),
        draft_vocab=args.draft_vocab,
    )
    prompt_ids = prompt.token_ids(models.codec)
    result = _stream(args, models, prompt_ids, prompt.echo, config)
    if args.records and result.steps:
        from ddtree.records import write_records

        chat = prompt.messages is not None
        write_records(args.records, [_record(args, models, config, result, prompt_ids, chat)])
    if args.stats:
        note(_stats(args, result))
    return 0


@dataclass(frozen=True)
class _Prompt:
    """The prompt as given: text, echoed before the completion; or chat messages (``--chat``,
    ``--messages``) rendered to token ids by the checkpoint's chat template, with nothing
    echoed (only the reply is printed)."""

    echo: str
    messages: list[dict[str, str]] | None = None
    ids: list[int] | None = None  # the chat's, rendered before the models load

    @staticmethod
    def read(args: argparse.Namespace, needs_drafter: bool) -> _Prompt:
        """From --prompt, --prompt-file or --messages; a missing or failing template fails
        here, before the models load."""
        if args.messages is not None:
            name = "stdin" if args.messages == STDIN else args.messages
            messages = read_messages(_read(args.messages, "--messages"), name)
        else:
            text = prompt_text(args)
            if not args.chat:
                return _Prompt(text)
            messages = [{"role": "user", "content": text}]
        from ddtree.serve.chat import ChatTemplate

        target_path, _ = model_paths(args, needs_drafter)
        return _Prompt("", messages, ChatTemplate.load(target_path).prompt_ids(messages))

    def token_ids(self, codec) -> list[int]:
        """The prompt's token ids (text: encoded by ``codec``); a ValueError where none."""
        ids = self.ids if self.ids is not None else codec.encode(self.echo)
        if not ids:
            raise ValueError("the prompt encodes to no tokens; give some text")
        return ids


def _stream(args: argparse.Namespace, models, prompt_ids: list[int], echo: str, config):
    """Generate, writing ``echo`` and then what each step adds to stdout: decoded
    incrementally after the prompt's tokens, so pieces that merge across the boundary
    (spaces, multi-byte characters) come out right."""
    from ddtree.commands._output import note
    from ddtree.engine import generate
    from ddtree.engine.stop import IncrementalText

    if args.engine_mode != "eager":
        note(
            "compiling the engine's graphs first (tens of seconds per width on a small CPU; "
            "cached on disk for later runs) ..."
        )
    text = IncrementalText(models.codec)
    for token in prompt_ids:
        text.push(token)

    def stream(new_tokens: list[int]) -> None:  # the step's tokens, after any stop
        sys.stdout.write("".join(text.push(t) for t in new_tokens))
        sys.stdout.flush()

    sys.stdout.write(echo)
    result = generate(
        models.target, models.drafter, prompt_ids, config, models.codec, on_commit=stream
    )
    sys.stdout.write("\n")
    return result


def _record(args: argparse.Namespace, models, config, result, prompt_ids: list[int], chat: bool):
    """The run's engine_run record (the drafter only where the policy drafts)."""
    from ddtree.engine import engine_run_record

    drafter = models.drafter if config.rules.needs_drafter else None
    return engine_run_record(
        [result],
        config,
        models.target.info,
        models.target_path,
        None if drafter is None else drafter.info,
        models.drafter_path,
        device=args.device,
        prompt_lens=[len(prompt_ids)],
        extra={"chat": chat},
    )


def _stats(args: argparse.Namespace, result) -> str:
    """--stats: tokens, steps, tau, tokens/s and why it stopped, in one line."""
    tok_s = sum(result.taus) / result.decode_s if result.decode_s else 0.0
    compiled = f", compile {result.compile_s:.1f} s" if args.engine_mode != "eager" else ""
    return (
        f"[{args.policy}, {args.engine_mode}, {threads_label(args)}] {len(result.tokens)} "
        f"tokens, {len(result.steps)} steps, mean tau {result.mean_tau:.2f}, {tok_s:.1f} tok/s, "
        f"stop: {result.stop_reason}{compiled}"
    )
