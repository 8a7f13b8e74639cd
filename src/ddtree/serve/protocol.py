"""The OpenAI API as the ``openai`` package speaks it: request bodies (validated), response and
stream-chunk bodies, and the error object.

Requests are pydantic models in strict mode: ``"5"`` is not a number, ``true`` is not an
integer, NaN and infinities are refused, and a parameter this server does not know is an
error naming it (as OpenAI's own API answers), never silently ignored. Parameters it knows but
cannot honour (``n`` > 1, ``logprobs``, ``echo``, penalties, ``logit_bias``) are refused with a
message saying so. Extensions: ``top_k`` and ``ignore_eos`` (vLLM's names), and the response's
``ddtree`` object (the request's tau, engine tokens/s, steps, stage times).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ddtree.utf8 import check_text
from ddtree.vocab import SAMPLING_FLOORS

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit integer
MAX_STOP_STRINGS = 4  # OpenAI's limit on ``stop``
REFUSED = (  # parameters accepted at their default only: one choice, no logprobs or biases
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
)


class APIError(Exception):
    """An error answered as OpenAI's error object: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension: 0 is off
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False  # extension: decode max_tokens tokens, past any EOS
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and unused, as an end-user id

    @field_validator("temperature", "top_p")
    @classmethod
    def _sampling_floor(cls, value: float | None, info) -> float | None:
        floor = SAMPLING_FLOORS[info.field_name]
        if value is not None and floor.refuses(value):
            raise ValueError(f"expected {floor.expected('at least')} ({floor.why})")
        return value

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value) -> tuple[str, ...]:
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("expected a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        return tuple(stops)

    @field_validator(*REFUSED, check_fields=False)
    @classmethod
    def _only_the_default(cls, value, info):
        """A parameter this server cannot honour is accepted at its default value only."""
        default = cls.model_fields[info.field_name].default
        if value != default and not (value == {} and default is None):
            name = info.field_name
            raise ValueError(
                f"{name} = {json.dumps(value)} is not supported by this server (only {name} = "
                f"{json.dumps(default)})"
            )
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt (text, or token ids)."""

    prompt: str | list[int]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = None
    echo: bool = False
    best_of: int = 1
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value) -> str | list[int]:
        # the API's four shapes: "text", ["text"], [ids], [[ids]]; one prompt per request
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(_is_int(t) and t >= 0 for t in value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            raise ValueError(f"one prompt per request is supported, got {len(value)}")
        raise ValueError("expected a non-empty string or a non-empty list of token ids")

    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = ""
    name: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _text(cls, value) -> str:
        # a string, or the list-of-parts form: only text parts, joined
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value
        ):
            return "".join(p["text"] for p in value)
        raise ValueError('expected a string or a list of {"type": "text", "text": ...} parts')

    def for_template(self) -> dict[str, str]:
        out = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: messages rendered by the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(cls: type[_Request], body: Any) -> _Request:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise APIError(
            400, f"expected a JSON object as the request body, got {type(body).__name__}"
        )
    for loc, text in _strings(body):
        try:
            check_text(text, _param(loc))
        except ValueError as e:
            raise APIError(400, str(e), param=_param(loc)) from None
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(first["loc"])
        if first["type"] == "extra_forbidden":
            message = f"{param}: unknown or unsupported parameter"
        else:
            message = f"{param}: {first['msg'].removeprefix('Value error, ')}"
        raise APIError(400, message, param=param) from None


def _strings(body: Any):
    """(location, text) of every string in a decoded JSON body, keys included (a JSON
    ``\\udcff`` escape decodes to a lone surrogate, which no tokenizer takes); a loop, not
    recursion, so a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[tuple, Any]] = [((), body)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            yield loc, value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield (*loc, key), key
                stack.append(((*loc, key), item))
        elif isinstance(value, list):
            stack.extend(((*loc, i), item) for i, item in enumerate(value))


def _param(loc: tuple) -> str:
    """pydantic's location as the API names it: ("messages", 0, "role") -> messages[0].role."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


FINISH_REASONS = {"max_new_tokens": "length", "eos": "stop", "stop_string": "stop"}
"""The engine's stop reason -> the API's ``finish_reason``."""


@dataclass(frozen=True)
class ResponseShape:
    """How one endpoint words its bodies: object names and a choice (whole or a delta)."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, text: str | None, finish_reason: str | None, first: bool) -> dict[str, Any]:
        if not self.chat:
            return {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def body(
        self, rid: str, created: int, model: str, choices: list, chunk: bool, **extra
    ) -> dict[str, Any]:
        out = {
            "id": rid,
            "object": self.chunk_object if chunk else self.object,
            "created": created,
            "model": model,
            "choices": choices,
        }
        out.update(extra)
        return out


COMPLETION = ResponseShape("cmpl", "text_completion", "text_completion", chat=False)
CHAT = ResponseShape("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "ddtree"}


def now_s() -> int:
    return int(time.time())
