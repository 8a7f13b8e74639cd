"""The HTTP side of ``ddtree serve``: a Starlette app on the engine thread (``worker.py``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers
server-sent events, ``data: {chunk}`` lines ending with ``data: [DONE]``), ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /health``, ``GET /metrics``. With an API key set, every
``/v1`` route needs ``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open for
probes and scrapers.

A request is checked before it is queued, each failure an OpenAI error object: the key (401),
the body's size (413) and JSON (400), its fields (400, naming the parameter), the model
(404), the prompt's tokens (400), the context (400, naming the lengths). Then admission: at
most ``max_queue`` requests wait behind the ones decoding (``--max-batch``); past that, 503 with a
``Retry-After`` derived from the mean request time so far. A client that disconnects cancels
its job: dropped if queued, stopped at the next step if decoding.

Per request, what the API does not fix comes from the server's configuration (``defaults``):
``max_tokens`` (``--max-new-tokens``), ``temperature``, ``top_p``, ``top_k``; a request
without ``seed`` gets one drawn from a generator seeded by ``--seed`` (and returned in the
``ddtree`` extension, so it can be replayed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ddtree.serve.chat import ChatTemplate, ChatTemplateError
from ddtree.serve.metrics import ServeMetrics
from ddtree.serve.protocol import (
    CHAT,
    COMPLETION,
    FINISH_REASONS,
    MAX_SEED,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    model_card,
    now_s,
    parse_request,
    usage,
)
from ddtree.serve.text import CompletionText
from ddtree.serve.worker import (
    EngineWorker,
    Failed,
    Finished,
    Job,
    RequestCancelled,
    Started,
    Tokens,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    defaults: object  # DecodeConfig: policy, block, budget, engine mode, sampling defaults
    max_queue: int  # requests that may wait behind the ones decoding
    max_body_bytes: int
    api_key: str | None = None
    seed: int = 0  # seeds the seeds of requests that give none
    body_timeout_s: float = 30.0  # a body not received in this long: 408 (slow uploads)


@dataclass
class _Endpoint:
    name: str  # metrics label and record field: "completions" | "chat"
    request: type
    shape: ResponseShape


COMPLETIONS = _Endpoint("completions", CompletionRequest, COMPLETION)
CHAT_COMPLETIONS = _Endpoint("chat", ChatCompletionRequest, CHAT)


class Service:
    """What the handlers share; used from the event loop thread only."""

    def __init__(self, settings: ServeSettings, worker: EngineWorker, chat: ChatTemplate) -> None:
        self.settings, self.worker, self.chat = settings, worker, chat
        self.models = worker.models
        self.in_flight = 0  # admitted requests the engine has not finished
        self.draining = False  # a stop signal came: no new request is admitted
        self.created = now_s()
        self._seeds = random.Random(settings.seed)
        self.max_token_chars = _max_token_chars(self.models.codec)
        # prompts are tokenized one at a time, off the event loop: a flood of them takes one
        # core at most from the engine, never a thread pool's worth
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(1, "ddtree-tokenize")
        self.metrics = ServeMetrics(worker.totals, self.queue_depth, self.running)
        self.pace = Pacer(lambda: bool(self.worker.running))

    def running(self) -> int:
        return len(self.worker.running)

    def queue_depth(self) -> int:
        return max(self.in_flight - self.running(), 0)

    # --- checks, in the order a request meets them

    def check_open(self) -> None:
        if self.draining:
            raise APIError(
                503, "the server is shutting down; retry on another replica or later",
                type="server_error", code="shutting_down", headers={"Connection": "close"},
            )  # fmt: skip

    def stop_now(self) -> None:
        """A second stop signal: every request ends now (the running one at its next step)."""
        self.draining = True
        self.worker.drop_queued()
        self.worker.cancel_running()

    async def drain(self, timeout_s: float) -> None:
        """After a stop signal: admit nothing more, end every queued request at once (each
        answered 503, a stream with an error event and ``[DONE]``), give the running one
        ``timeout_s`` to finish, then cancel it; returns when no request is left."""
        self.draining = True
        self.worker.drop_queued()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.worker.cancel_running()
        self.worker.drop_queued()  # one the engine had not yet taken when the clock ran out
        deadline = loop.time() + 1.0  # the cancel lands at the next step
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        # RFC 7235: the scheme is case-insensitive ("bearer KEY" is as good as "Bearer KEY")
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        given = given.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, key.encode()):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )

    async def read_json(self, request: Request):
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit {limit}")
        body = bytearray()
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        except TimeoutError:
            raise APIError(
                408, f"request body not received within {self.settings.body_timeout_s:g} s "
                f"({len(body)} bytes came)", headers={"Connection": "close"},
            ) from None  # fmt: skip
        try:
            return json.loads(body)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "request body is nested too deeply to be a request") from None

    def check_prompt_size(self, req) -> None:
        """Refuse a prompt that cannot fit the context before tokenizing it: no token is
        longer than ``max_token_chars`` characters, so a text of more characters than that
        times the context (or a token-id list longer than the context) cannot fit. A flood of
        huge prompts then costs no tokenizer time beside the engine's."""
        limit = self.models.target.info.max_position
        if isinstance(req, ChatCompletionRequest):
            chars, param = sum(len(m.for_template()["content"]) for m in req.messages), "messages"
        elif isinstance(req.prompt, str):
            chars, param = len(req.prompt), "prompt"
        else:
            if len(req.prompt) >= limit:
                raise APIError(
                    400, f"the prompt has {len(req.prompt)} tokens; the context holds "
                    f"max_position {limit}", param="prompt", code="context_length_exceeded",
                )  # fmt: skip
            return
        if chars > limit * self.max_token_chars:
            raise APIError(
                400, f"the prompt has {chars} characters, more than the {limit} tokens of the "
                f"context (max_position {limit}) can hold", param=param,
                code="context_length_exceeded",
            )  # fmt: skip

    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist here; this server serves "
                f"{self.settings.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def prompt_ids(self, req) -> list[int]:
        """Tokens of the request's prompt (runs in a worker thread: templates, tokenizer)."""
        if isinstance(req, ChatCompletionRequest):
            try:
                ids = self.chat.prompt_ids([m.for_template() for m in req.messages])
            except ChatTemplateError as e:
                raise APIError(400, str(e), param="messages") from None
        elif isinstance(req.prompt, str):
            ids = self.models.codec.encode(req.prompt)
        else:
            ids = req.prompt
            vocab = self.models.target.info.vocab_size
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise APIError(
                    400, f"prompt: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}",
                    param="prompt",
                )  # fmt: skip
        if not ids:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        return ids

    def decode_config(self, req, prompt_tokens: int):
        from ddtree.engine import ContextLengthError, check_context

        defaults = self.settings.defaults
        asked = req.max_new_tokens()
        overrides = {
            "max_new_tokens": asked or defaults.max_new_tokens,
            "stop_strings": req.stop,
            "seed": self._seeds.randint(0, MAX_SEED) if req.seed is None else req.seed,
        }
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                overrides[name] = getattr(req, name)
        if req.ignore_eos:
            overrides["eos_token_ids"] = ()
        try:
            config = replace(defaults, **overrides)
            check_context(self.models.target, prompt_tokens, config)
        except ContextLengthError as e:
            hint = "" if asked else " (max_tokens not given: the server's default)"
            raise APIError(
                400, f"{e}{hint}", param="max_tokens", code="context_length_exceeded"
            ) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return config

    def admit(self, prompt_ids: list[int], config, endpoint: _Endpoint, arrived_s: float) -> Job:
        limit = self.settings.max_queue
        if self.in_flight >= limit + self.worker.max_batch:
            raise APIError(
                503,
                f"the server is busy: {self.queue_depth()} requests are waiting for the engine "
                f"(--max-queue {limit}); retry later",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s())},
            )

        def ended(job: Job, event) -> None:
            self.in_flight -= 1
            outcome = "finished" if isinstance(event, Finished) else "failed"
            if isinstance(event, Failed) and isinstance(event.error, RequestCancelled):
                outcome = "cancelled"
            self.metrics.requests.labels(endpoint.name, outcome).inc()
            self.metrics.request_seconds.observe(time.perf_counter() - arrived_s)

        loop = asyncio.get_running_loop()
        job = Job(prompt_ids, config, loop, on_end=ended, record_extra={"endpoint": endpoint.name})
        self.in_flight += 1
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self.worker.submit(job)
        return job

    def retry_after_s(self) -> int:
        """Seconds until a queue slot is likely free: the mean request's engine time so far
        times the requests ahead (whole seconds, as the header takes; at least 1)."""
        t = self.worker.totals.snapshot()
        mean_s = (t.decode_s + t.prefill_s) / t.requests if t.requests else 0.0
        return max(1, math.ceil(mean_s * self.in_flight))

    # --- answering

    async def events(self, job: Job, text: CompletionText, arrived_s: float) -> AsyncIterator:
        """The text deltas of a job as the engine commits them, then its ``Finished`` event.
        A failed decode raises ``APIError``. Steps that queued up while this side was busy
        go out as one delta (one chunk, one send)."""
        first, held = True, None
        while True:
            event, held = held or await job.events.get(), None
            if isinstance(event, Started):
                self.metrics.queue_wait.observe(event.queue_s)
            elif isinstance(event, Finished):
                yield event
                return
            elif isinstance(event, Failed):
                raise _engine_error(event.error)
            else:  # Tokens
                if first:
                    self.metrics.first_token.observe(time.perf_counter() - arrived_s)
                    first = False
                ids = event.ids
                while held is None and not job.events.empty():
                    more = job.events.get_nowait()
                    if isinstance(more, Tokens):
                        ids = ids + more.ids
                    else:
                        held = more
                self.metrics.generation_tokens.inc(len(ids))
                delta = text.push(ids)
                if delta:
                    yield delta

    def completion_text(self, config) -> CompletionText:
        eos = self.models.target.info.eos_token_ids
        return CompletionText(self.models.codec, frozenset(eos), config.stop_strings)

    def extension(self, job: Job, result) -> dict:
        """The ``ddtree`` field of a response: this request's engine figures."""
        steps = len(result.steps)
        return {
            "mean_tau": result.mean_tau,
            "tokens_per_s": sum(result.taus) / result.decode_s if result.decode_s else 0.0,
            "steps": steps,
            "step_s_mean": result.decode_s / steps if steps else 0.0,
            "decode_s": result.decode_s,
            "prefill_s": result.prefill_s,
            "queue_s": job.queue_s,
            "stop_reason": result.stop_reason,
            "seed": job.config.seed,
            "policy": job.config.policy,
            "engine_mode": job.config.engine_mode,
        }


class Pacer:
    """Keeps the event loop's share of the GIL small while a request decodes.

    The engine thread and the event loop share one interpreter lock: every millisecond the
    loop spends in Python (HTTP parsing, JSON, validation, error bodies) is a millisecond a
    decode step waits, plus the hand-offs of the lock between the two threads. A client that
    floods the server with requests it must refuse would otherwise slow every decode by as
    much as it costs. So, while the engine runs, a new request waits before its body is read
    until the loop's CPU time over the current window is at most ``share`` (8%) of the window's
    wall time (each wait at most ``max_wait_s``; the window restarts every ``window_s``). With
    the engine idle nothing waits. The loop's own thread CPU time (``time.thread_time``) is the
    measure: whatever it spent, on whichever request, counts."""

    def __init__(
        self, busy: Callable[[], bool], share: float = 0.08, window_s: float = 0.25,
        max_wait_s: float = 0.05, wall=time.monotonic, cpu=time.thread_time,
    ) -> None:  # fmt: skip
        self.busy, self.share, self.window_s, self.max_wait_s = busy, share, window_s, max_wait_s
        self._wall, self._cpu = wall, cpu  # clocks (tests pass their own)
        self._wall0 = self._cpu0 = None
        self.waited_s = 0.0  # total

    def wait_s(self) -> float:
        """How long the next request waits (and the window's bookkeeping)."""
        wall, cpu = self._wall(), self._cpu()
        if not self.busy():
            self._wall0 = None
            return 0.0
        if self._wall0 is None or wall - self._wall0 > self.window_s:
            self._wall0, self._cpu0 = wall, cpu
            return 0.0
        over_s = (cpu - self._cpu0) / self.share - (wall - self._wall0)
        return min(max(over_s, 0.0), self.max_wait_s)

    async def __call__(self) -> None:
        """Called on the event loop thread (its CPU time is the one measured)."""
        wait_s = self.wait_s()
        if wait_s > 0:
            self.waited_s += wait_s
            await asyncio.sleep(wait_s)


def _max_token_chars(codec) -> int:
    """The most characters one token of ``codec`` decodes to (at least 1; 64 when the
    tokenizer does not say): a byte-level vocabulary spells each byte as one character, so a
    token's vocabulary string is never shorter than its text."""
    try:
        vocab = codec.tokenizer.get_vocab(with_added_tokens=True)
    except AttributeError:
        return 64
    return max((len(t) for t in vocab), default=1) or 1


def _engine_error(error: BaseException) -> APIError:
    if isinstance(error, RequestCancelled):  # only a stop signal cancels a job someone reads
        return APIError(
            503, "the server is shutting down; retry on another replica or later",
            type="server_error", code="shutting_down",
        )  # fmt: skip
    return APIError(500, f"decoding failed: {error}", type="server_error")


def _json_error(error: APIError) -> Response:
    return Response(_json_bytes(error.body()), error.status, error.headers, "application/json")


def _json_bytes(body: dict) -> bytes:
    """``body`` as UTF-8 JSON; a lone surrogate a client sent (a key's ``\\udcff`` echoed in
    a message) goes out escaped, never as a failed encode (a 500)."""
    return json.dumps(body, separators=(",", ":")).encode()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(
    service: Service,
    on_ready: Callable[[], None] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> Starlette:
    """The app; ``on_ready`` runs once it serves, ``on_shutdown`` after its last request."""
    settings = service.settings

    def api(handler):
        """Authorize ``/v1`` requests and answer ``APIError`` as the error object."""

        async def wrapped(request: Request) -> Response:
            try:
                service.authorize(request)
                return await handler(request)
            except ClientDisconnect:  # left mid-upload: nobody to answer, nothing to log
                return Response(status_code=499)
            except RecursionError:  # a body nested past the parser's depth
                e = APIError(400, "request body is nested too deeply to be a request")
            except APIError as error:
                e = error
            service.metrics.errors.labels(str(e.status)).inc()
            return _json_error(e)

        return wrapped

    async def generate(request: Request, endpoint: _Endpoint) -> Response:
        arrived_s = time.perf_counter()
        service.check_open()
        await service.pace()  # before the body is read: a flood waits, not the engine
        req = parse_request(endpoint.request, await service.read_json(request))
        service.check_model(req.model)
        service.check_prompt_size(req)
        loop = asyncio.get_running_loop()
        prompt_ids = await loop.run_in_executor(service.tokenizing, service.prompt_ids, req)
        config = service.decode_config(req, len(prompt_ids))
        service.check_open()  # a stop signal may have come while the prompt was tokenized
        job = service.admit(prompt_ids, config, endpoint, arrived_s)
        text = service.completion_text(config)
        rid, created = endpoint.shape.new_id(), now_s()
        body = _Bodies(endpoint.shape, rid, created, settings.model_name, len(prompt_ids))
        events = service.events(job, text, arrived_s)
        if req.stream:
            stream = _sse(body, job, events, text, service, req.include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        collect = asyncio.ensure_future(_collect(events))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not collect.done():  # the client left: nobody reads the answer
            job.cancel()
            collect.cancel()
            return Response(status_code=499)
        result = collect.result()  # raises the decode's APIError
        text.finish()
        choice = endpoint.shape.choice(text.text, FINISH_REASONS[result.stop_reason])
        return JSONResponse(body.full([choice], len(result.tokens), service.extension(job, result)))

    @api
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS)

    @api
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT_COMPLETIONS)

    @api
    async def models(request: Request) -> Response:
        card = model_card(settings.model_name, service.created)
        return JSONResponse({"object": "list", "data": [card]})

    @api
    async def model(request: Request) -> Response:
        service.check_model(request.path_params["model"])
        return JSONResponse(model_card(settings.model_name, service.created))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "queue_depth": service.queue_depth()})

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        service.metrics.errors.labels(str(exc.status_code)).inc()
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _json_error(APIError(exc.status_code, message, code=None))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if on_ready is not None:
            on_ready()
        yield
        service.tokenizing.shutdown(wait=False, cancel_futures=True)
        if on_shutdown is not None:
            on_shutdown()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan
    )


@dataclass
class _Bodies:
    """Response and chunk bodies of one request."""

    shape: ResponseShape
    rid: str
    created: int
    model: str
    prompt_tokens: int

    def full(self, choices: list, completion_tokens: int, extension: dict) -> dict:
        return self.shape.body(
            self.rid, self.created, self.model, choices, chunk=False,
            usage=usage(self.prompt_tokens, completion_tokens), ddtree=extension,
        )  # fmt: skip

    def chunk(self, choices: list, **extra) -> bytes:
        body = self.shape.body(self.rid, self.created, self.model, choices, chunk=True, **extra)
        return _event(body)


def _event(body: dict) -> bytes:
    """One server-sent event carrying a JSON body."""
    return b"data: " + _json_bytes(body) + b"\n\n"


async def _collect(events: AsyncIterator):
    """The result of a job whose text is gathered as it goes (``events`` ends on Finished)."""
    return [event async for event in events][-1].result


async def _sse(
    body: _Bodies,
    job: Job,
    events: AsyncIterator,
    text: CompletionText,
    service: Service,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """Server-sent events of one streamed request. Ending early (the client left: Starlette
    cancels this generator) cancels the job."""
    shape, first = body.shape, True
    try:
        async for event in events:
            if isinstance(event, str):
                yield body.chunk([shape.delta(event, None, first)])
                first = False
                continue
            result = event.result
            reason = FINISH_REASONS[result.stop_reason]
            ext = service.extension(job, result)
            yield body.chunk([shape.delta(text.finish(), reason, first)], ddtree=ext)
            if include_usage:
                yield body.chunk([], usage=usage(body.prompt_tokens, len(result.tokens)))
        yield b"data: [DONE]\n\n"
    except APIError as e:
        service.metrics.errors.labels(str(e.status)).inc()
        yield _event(e.body())
        yield b"data: [DONE]\n\n"  # the stream ends as every stream does
    finally:
        job.cancel()
