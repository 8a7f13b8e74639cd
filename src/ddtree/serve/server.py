"""Run the service: a listening socket, the engine thread, uvicorn.

Order, so that nothing answers before it can decode: bind the address (a port in use fails
at once, before minutes of loading), load and warm up (``EngineWorker.start``), then listen,
then serve; the URL line is printed when uvicorn has started the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path

from ddtree.serve.app import ServeSettings, Service, build_app
from ddtree.serve.chat import ChatTemplate
from ddtree.serve.metrics import EngineTotals
from ddtree.serve.recorder import RecordWriter
from ddtree.serve.worker import EngineWorker
from ddtree.signals import Interrupted, keep

SHUTDOWN_TIMEOUT_S = 5.0
"""After a stop signal (Ctrl-C, SIGTERM), the running request has this long to finish
(``--shutdown-timeout``); queued ones are answered 503 at once."""
CLOSE_S = 1.0  # then connections have this long to send their last bytes
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


HEADER_TIMEOUT_S = 10.0  # a request's headers must arrive within this (slowloris)
KEEP_ALIVE_S = 5.0  # an idle kept-alive connection is closed after this
MAX_HEADER_BYTES = 16 * 1024
LOOP_NICE = 10
"""The event loop thread's nice value (Linux, per thread): on a machine whose cores are all
busy, the engine thread (nice 0) is scheduled first and the HTTP side takes what is left; the
tokenizer thread, started from the loop, inherits it."""


def _favour_the_engine() -> None:
    """Lower the calling thread's scheduling priority (Linux: nice is per thread; elsewhere it
    would be the whole process's, engine included, so nothing is done)."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOOP_NICE)
    except OSError:  # a sandbox that forbids it: the pacing of Service still holds
        pass


def _header_deadline_protocol():
    """uvicorn's h11 protocol with a deadline on each request's headers: from the connection
    (or the previous response) to the end of the headers at most ``HEADER_TIMEOUT_S``, however
    slowly the bytes trickle in (uvicorn's keep-alive timeout restarts at every byte). A
    connection that misses it is closed."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._expired)

        def _expired(self) -> None:
            self._deadline = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._waiting_for_headers():
                self._arm()
            elif self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

    return Protocol


def _stopping_server(uvicorn, config, service: Service, shutdown_timeout_s: float):
    """uvicorn's server with ddtree's stop. The first SIGINT/SIGTERM drains
    (``Service.drain``: nothing admitted, queued requests answered 503 at once, the running
    one given ``shutdown_timeout_s``), then uvicorn closes the connections and the app; a
    second signal exits at once. The signal is kept in ``signum`` (the caller raises it as
    ``Interrupted``: exit 130 / 143), not re-raised by uvicorn."""

    class Server(uvicorn.Server):
        signum: int | None = None
        loop = None

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {
                s: signal.signal(s, self.handle_exit)
                for s in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(s) is not signal.SIG_IGN
            }
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig: int, frame) -> None:
            if self.loop is None:  # before the app started: nothing to drain
                self.signum = self.signum or sig
                self.should_exit = True
                return
            if self.signum is not None:  # a second signal: cut the running request now
                self.loop.call_soon_threadsafe(service.stop_now)
                self.should_exit = True
                return
            self.signum = sig
            name = signal.Signals(sig).name
            print(
                f"ddtree serve: {name}: stopping (queued requests answered 503, the running one "
                f"has {shutdown_timeout_s:g} s; {name} again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            self.loop.call_soon_threadsafe(self._drain)

        def _drain(self) -> None:
            task = self.loop.create_task(service.drain(shutdown_timeout_s))
            task.add_done_callback(lambda _: setattr(self, "should_exit", True))

    return Server(config)


def serve(
    models,
    settings: ServeSettings,
    sock: socket.socket,
    records: Path | None,
    device: str,
    access_log: bool = False,
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
    max_batch: int = 1,
) -> None:
    """Warm the engine up, then answer requests on ``sock`` until a stop signal (raised as
    ``Interrupted`` once the requests are answered and the records written)."""
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

    worker = EngineWorker(
        models, EngineTotals(), on_result=None if writer is None else recorded, max_batch=max_batch
    )
    defaults = settings.defaults
    # one full step after the prefill's token: every graph a request runs exists afterwards
    warm_s = worker.start(replace(defaults, max_new_tokens=defaults.block_size + 1), log)
    print(f"engine ready in {warm_s:.1f} s", file=log, flush=True)
    service = Service(settings, worker, chat)
    sock.listen(LISTEN_BACKLOG)
    url = url_of(sock)

    def ready() -> None:  # on the event loop thread
        _favour_the_engine()
        d = settings.defaults
        budget = d.tree_budget
        print(
            f"ddtree serve: {url}/v1 (model {settings.model_name!r}, policy {d.policy}, "
            f"block {d.block_size}, budget {budget}, {d.engine_mode}, max batch {max_batch})",
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
        timeout_graceful_shutdown=CLOSE_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        http=_header_deadline_protocol(),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    if access_log:  # log_level "warning" silenced uvicorn's access logger (it logs at INFO),
        access = logging.getLogger("uvicorn.access")  # and it wrote to stdout, not stderr
        access.setLevel(logging.INFO)
        for handler in access.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sys.stderr)
    server = _stopping_server(uvicorn, config, service, shutdown_timeout_s)
    try:
        server.run(sockets=[sock])
    finally:  # the app's shutdown ran unless uvicorn ended some other way
        shutdown()
    if server.signum is not None:
        if writer is not None and writer.written:
            keep(records, f"{writer.written} engine_run records")
        raise Interrupted(server.signum)
