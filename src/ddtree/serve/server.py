"""Run the service: a listening socket, the engine thread, uvicorn.

Order, so that nothing answers before it can decode: bind the address (a port in use fails
at once, before minutes of loading), load and warm up (``EngineWorker.start``), then listen,
then serve; the URL line is printed when uvicorn has started the app.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import replace
from pathlib import Path

from ddtree.serve.app import ServeSettings, Service, build_app
from ddtree.serve.chat import ChatTemplate
from ddtree.serve.metrics import EngineTotals
from ddtree.serve.recorder import RecordWriter
from ddtree.serve.worker import EngineWorker
from ddtree.vocab import get_policy

GRACEFUL_SHUTDOWN_S = 10
"""After a stop signal (Ctrl-C, SIGTERM), requests still running this long are cut."""
LISTEN_BACKLOG = 128  # connections the kernel queues before uvicorn accepts them


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one), not listening yet. Its protocol
    is IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets, and without it a
    response's header and body writes wait out the client's delayed ACK (40 ms here) on every
    kept-alive connection."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise ValueError(
            f"--host/--port {host}:{port}: cannot listen there ({e.strerror or e})"
        ) from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    models,
    settings: ServeSettings,
    sock: socket.socket,
    records: Path | None,
    device: str,
    access_log: bool = False,
) -> None:
    """Warm the engine up, then answer requests on ``sock`` until a stop signal."""
    import uvicorn
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # no *_created series beside every counter (process-wide)

    log = sys.stderr
    chat = ChatTemplate.load(models.target_path)
    if not chat.available:
        print(
            f"note: {models.target_path} has no chat template: /v1/chat/completions answers 400",
            file=log,
        )
    writer = None if records is None else RecordWriter(records, models, device)

    def recorded(job, result) -> None:
        writer.add(
            result, job.config, len(job.prompt_ids), {**job.record_extra, "queue_s": job.queue_s}
        )

    worker = EngineWorker(models, EngineTotals(), on_result=None if writer is None else recorded)
    defaults = settings.defaults
    # one full step after the prefill's token: every graph a request runs exists afterwards
    warm_s = worker.start(replace(defaults, max_new_tokens=defaults.block_size + 1), log)
    print(f"engine ready in {warm_s:.1f} s", file=log, flush=True)
    service = Service(settings, worker, chat)
    sock.listen(LISTEN_BACKLOG)
    url = url_of(sock)

    def ready() -> None:
        d = settings.defaults
        budget = get_policy(d.policy).budget(d.block_size, d.budget)
        print(
            f"ddtree serve: {url}/v1 (model {settings.model_name!r}, policy {d.policy}, "
            f"block {d.block_size}, budget {budget}, {d.engine_mode})",
            flush=True,
        )

    def shutdown() -> None:
        worker.stop()
        if writer is not None:
            writer.close()

    config = uvicorn.Config(
        build_app(service, on_ready=ready, on_shutdown=shutdown),
        log_level="warning",
        access_log=access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:  # the app's shutdown ran unless uvicorn ended some other way
        shutdown()
