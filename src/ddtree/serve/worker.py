"""The engine thread: the one place the models run.

Requests wait in a queue and one thread decodes them: one at a time with
``ddtree.engine.generate`` (``max_batch`` 1), or up to ``max_batch`` together with
``ddtree.engine.batch.BatchEngine`` (continuous batching: a request joins at the next step
after a row frees, first come first served). Each request is a ``Job``: the HTTP side (the asyncio
event loop) submits it and reads its events (``Started``, ``Tokens`` per step, then
``Finished`` or ``Failed``) from an ``asyncio.Queue`` the engine thread feeds through
``call_soon_threadsafe``, so a step costs the engine one hand-off; decoding text, JSON and
sockets happen on the event loop while the next step runs.

Cancel: ``Job.cancel()`` (a client went away) sets a flag that ``on_commit`` checks after
every step: it raises ``RequestCancelled``, which ends ``generate`` at once (the engine
resets its caches at the next request); batched, the flag drops the job's row before the next
step and the other rows go on. A job cancelled while queued is dropped unstarted.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ddtree.serve.metrics import EngineTotals


class RequestCancelled(Exception):
    """Raised from ``on_commit`` to stop a decode whose client went away."""


@dataclass
class Started:
    queue_s: float  # seconds from submission to the engine taking the job


@dataclass
class Tokens:
    ids: list[int]  # one step's new tokens (the prefill's first token alone)


@dataclass
class Finished:
    result: object  # GenerationResult


@dataclass
class Failed:
    error: BaseException  # RequestCancelled when the client left


Event = Started | Tokens | Finished | Failed


class Job:
    """One request between the event loop and the engine thread."""

    def __init__(
        self,
        prompt_ids: list[int],
        config,  # DecodeConfig
        loop: asyncio.AbstractEventLoop,
        on_end: Callable[[Job, Event], None] | None = None,
        record_extra: dict | None = None,
    ) -> None:
        self.prompt_ids, self.config, self.loop = prompt_ids, config, loop
        self.record_extra = dict(record_extra or {})  # what its engine_run record carries
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.submitted_s = time.perf_counter()
        self.queue_s = 0.0  # set when the engine takes it
        self.cancel_s: float | None = None  # perf_counter when cancel() was called
        self._cancel = threading.Event()
        self._lock = threading.Lock()  # between cancel() and the engine taking the job
        self._started = False
        self._ended = False
        self._on_end = on_end

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop at the next step (any thread; harmless once it has ended). A job the engine
        has not taken yet ends at once (``Failed(RequestCancelled)``): its queue slot is free
        now, not when the engine reaches it."""
        with self._lock:
            if self._cancel.is_set():
                return
            self.cancel_s = time.perf_counter()
            self._cancel.set()
            queued = not self._started
        if queued:
            self.post(Failed(RequestCancelled()))

    def claim(self) -> bool:
        """The engine takes the job (engine thread): False when it was cancelled first."""
        with self._lock:
            if self._cancel.is_set():
                return False
            self._started = True
            return True

    def on_commit(self, tokens: list[int]) -> None:  # engine thread, after every step
        if self._cancel.is_set():
            raise RequestCancelled
        self.post(Tokens(list(tokens)))

    def on_row_commit(self, tokens: list[int]) -> None:  # engine thread, batched
        """As ``on_commit``, for a row of a batch: never raises (that would end every row's
        step); a cancelled job's row is dropped by the worker before the next step."""
        if not self._cancel.is_set():
            self.post(Tokens(list(tokens)))

    def post(self, event: Event) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _deliver(self, event: Event) -> None:  # event loop
        if self._ended:  # one end per job (a cancel while queued ends it before the engine)
            return
        self.events.put_nowait(event)
        if isinstance(event, Finished | Failed):
            self._ended = True
            if self._on_end is not None:
                self._on_end(self, event)


class EngineWorker:
    """Owns the loaded models and the thread that runs them."""

    def __init__(self, models, totals: EngineTotals, on_result=None, max_batch: int = 1) -> None:
        self.models = models  # ddtree.commands._decode.LoadedModels
        self.totals = totals
        self.on_result = on_result  # (job, result) -> None, on the engine thread (records)
        self.max_batch = max_batch  # requests decoded together
        self.running: dict[int, Job] = {}  # the jobs decoding now, by engine request id
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._warm_up_error: BaseException | None = None

    def start(self, warm_up_config, progress=sys.stderr) -> float:
        """Start the engine thread and wait for its warm-up: one short request with the
        server's own configuration, so compiled graphs exist (and eager mode's first-call
        costs are paid) before the port opens. Returns the warm-up's seconds."""
        t0 = time.perf_counter()
        self._thread = threading.Thread(
            target=self._run, args=(warm_up_config, progress), name="ddtree-engine", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._warm_up_error is not None:
            raise self._warm_up_error
        return time.perf_counter() - t0

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def drop_queued(self) -> int:
        """Cancel every job still waiting (each ends at once); returns how many."""
        with self._jobs.mutex:
            waiting = [job for job in self._jobs.queue if job is not None]
        for job in waiting:
            job.cancel()
        return len(waiting)

    def stop(self, timeout_s: float | None = None) -> None:
        """Cancel the running job, drop the queued ones, end the thread (once; later calls
        return at once). ``timeout_s``: wait at most that long for the running step."""
        if self._thread is None or not self._thread.is_alive():
            return
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        self.cancel_running()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def running_jobs(self) -> list[Job]:
        return list(self.running.values())

    def cancel_running(self) -> None:
        """Cancel every job decoding now (each stops at its next step)."""
        for job in self.running_jobs():
            job.cancel()

    def _run(self, warm_up_config, progress) -> None:
        engine = None
        try:
            engine = self._warm_up(warm_up_config, progress)
        except BaseException as e:  # handed to start(), which raises it on the main thread
            self._warm_up_error = e
            return
        finally:
            self._ready.set()
        if engine is not None:
            self._run_batched(engine)
            return
        while (job := self._jobs.get()) is not None:
            if not job.claim():  # cancelled while queued: it has ended already
                continue
            self.running = {0: job}
            try:
                self._decode(job)
            finally:
                self.running = {}

    def _warm_up(self, config, progress):
        """One short request (batched: through the batch engine, which compiles its width
        buckets first); returns the batch engine, or None when decoding one at a time."""
        from ddtree.engine import generate
        from ddtree.engine.batch import BatchEngine, BatchRequest

        models = self.models
        prompt = models.codec.encode("warm up") or [0]  # any short prompt
        print(f"warming up the engine ({config.engine_mode}) ...", file=progress, flush=True)
        if self.max_batch == 1:
            result = generate(models.target, models.drafter, prompt, config)
            if result.compile_s:
                print(f"compiled in {result.compile_s:.1f} s", file=progress, flush=True)
            return None
        engine = BatchEngine(
            models.target,
            models.drafter if config.rules.needs_drafter else None,
            max_rows=self.max_batch,
            engine_mode=config.engine_mode,
            width=max(config.width_buckets()),
            compile_scope=config.compile_scope,
            tokenizer=models.codec,
            profile_stages=config.profile_stages,
            auto_budget=config.auto_budget,
        )
        results = engine.run([BatchRequest(prompt, config)] * min(2, self.max_batch))
        compile_s = engine.compile_s + sum(r.compile_s for r in results)
        if compile_s:
            print(f"compiled in {compile_s:.1f} s", file=progress, flush=True)
        return engine

    def _run_batched(self, engine) -> None:
        """The batched engine loop: take waiting jobs while rows are free (blocking only
        when nothing runs), drop the rows of cancelled jobs, step, hand out what finished."""
        from ddtree.engine.batch import BatchRequest

        stopping = False
        jobs: dict[int, Job] = {}  # engine request id -> its job; published as self.running
        while not (stopping and engine.idle):
            while not stopping and len(engine.running) + len(engine.waiting) < self.max_batch:
                try:
                    job = self._jobs.get(block=engine.idle)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                if not job.claim():
                    continue
                job.queue_s = time.perf_counter() - job.submitted_s
                job.post(Started(job.queue_s))
                try:
                    request = BatchRequest(job.prompt_ids, job.config, job.on_row_commit)
                    jobs[engine.submit(request)] = job
                except Exception as e:  # a request the batch cannot run: it alone fails
                    job.post(Failed(e))
            self.running = dict(jobs)  # a new dict: the event loop reads it without a lock
            for request_id, job in jobs.items():
                if job.cancelled:
                    engine.cancel(request_id)
            try:
                step = engine.step()
            except Exception as e:  # NaN logits, ...: this step's rows fail, the server goes on
                for job in jobs.values():
                    job.post(Failed(e))
                engine.abort()
                jobs.clear()
                self.running = {}
                continue
            if step.rows:
                self.totals.add_batch_step(step.rows, step.step_s, step.tokens)
            for request_id, result in step.finished:
                self._finish(jobs.pop(request_id), result)
            self.running = dict(jobs)

    def _finish(self, job: Job, result) -> None:
        if result.stop_reason == "cancelled":
            self.totals.add_cancel(time.perf_counter() - (job.cancel_s or time.perf_counter()))
            job.post(Failed(RequestCancelled()))
            return
        self.totals.add_result(result)
        if self.on_result is not None:
            self.on_result(job, result)
        job.post(Finished(result))

    def _decode(self, job: Job) -> None:
        from ddtree.engine import generate

        models = self.models
        job.queue_s = time.perf_counter() - job.submitted_s
        job.post(Started(job.queue_s))
        try:
            result = generate(
                models.target,
                models.drafter,
                job.prompt_ids,
                job.config,
                models.codec,
                on_commit=job.on_commit,
            )
        except RequestCancelled as e:
            self.totals.add_cancel(time.perf_counter() - job.cancel_s)
            job.post(Failed(e))
            return
        except Exception as e:  # NaN logits, a failed rank: this request fails, the server goes on
            job.post(Failed(e))
            return
        self.totals.add_batch_step(1, result.decode_s, sum(result.taus), steps=len(result.steps))
        self._finish(job, result)
