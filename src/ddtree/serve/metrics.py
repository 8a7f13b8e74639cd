"""``GET /metrics``: the service's counters in Prometheus text format (``prometheus_client``).

Two sources, one registry per server (never the library's global one):

- the HTTP side (event-loop thread): requests by endpoint and outcome, errors by status,
  prompt and generated tokens, queue depth, latency histograms (queue wait, time to first
  token, whole request) with the library's default buckets;
- the engine side (engine thread): ``EngineTotals``, the sums over every finished request's
  steps, exported as counters (for ``rate()`` over a window) and as lifetime means (mean tau,
  engine tokens/s, seconds per step by stage), so a scrape answers without PromQL.

Engine totals count finished requests only (a cancelled request's steps end in an exception,
not a ``GenerationResult``); its streamed tokens are in ``ddtree_generation_tokens_total``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ddtree.vocab import STEP_STAGES, Stage


@dataclass
class EngineTotals:
    """Sums over the finished requests' decode steps; updated by the engine thread."""

    requests: int = 0
    steps: int = 0
    step_tokens: int = 0  # sum of tau
    decode_s: float = 0.0  # sum of step times
    prefill_s: float = 0.0
    stage_s: dict[Stage, float] = field(default_factory=lambda: dict.fromkeys(STEP_STAGES, 0.0))
    cancelled: int = 0
    cancel_s: float = 0.0  # sum over cancelled decodes: seconds from cancel to the stop
    # engine steps as the engine ran them (a batched step once, whatever its rows)
    engine_steps: int = 0
    engine_s: float = 0.0  # wall seconds of those steps
    engine_tokens: int = 0  # tokens they gave all their rows
    row_steps: int = 0  # sum over engine steps of the rows in each (mean batch = / steps)
    by_rows: dict[int, list[float]] = field(default_factory=dict)  # rows -> [steps, s, tokens]
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_result(self, result) -> None:
        """One finished ``GenerationResult``."""
        with self._lock:
            self.requests += 1
            self.steps += len(result.steps)
            self.step_tokens += sum(result.taus)
            self.decode_s += result.decode_s
            self.prefill_s += result.prefill_s
            for step in result.steps:
                for stage in STEP_STAGES:
                    self.stage_s[stage] += step.stage_s[stage]

    def add_batch_step(self, rows: int, seconds: float, tokens: int, steps: int = 1) -> None:
        """``steps`` engine steps of ``rows`` requests each, ``seconds`` of wall time in all,
        that gave ``tokens`` tokens."""
        with self._lock:
            self.engine_steps += steps
            self.engine_s += seconds
            self.engine_tokens += tokens
            self.row_steps += rows * steps
            sums = self.by_rows.setdefault(rows, [0, 0.0, 0])
            sums[0] += steps
            sums[1] += seconds
            sums[2] += tokens

    def add_cancel(self, seconds: float) -> None:
        with self._lock:
            self.cancelled += 1
            self.cancel_s += seconds

    def snapshot(self) -> EngineTotals:
        with self._lock:
            return EngineTotals(
                self.requests,
                self.steps,
                self.step_tokens,
                self.decode_s,
                self.prefill_s,
                dict(self.stage_s),
                self.cancelled,
                self.cancel_s,
                self.engine_steps,
                self.engine_s,
                self.engine_tokens,
                self.row_steps,
                {rows: list(sums) for rows, sums in self.by_rows.items()},
            )

    @property
    def mean_tau(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens the engine's steps gave all their rows per second of those steps."""
        return self.engine_tokens / self.engine_s if self.engine_s else 0.0


class _EngineCollector:
    """Exports one consistent snapshot of ``EngineTotals`` per scrape."""

    def __init__(self, totals: EngineTotals) -> None:
        self.totals = totals

    def collect(self):
        t = self.totals.snapshot()
        counters = (
            ("ddtree_decoded_requests", "requests the engine finished", t.requests),
            ("ddtree_steps", "decode steps of finished requests", t.steps),
            ("ddtree_step_tokens", "tokens those steps committed (sum of tau)", t.step_tokens),
            ("ddtree_decode_seconds", "seconds spent in those steps", t.decode_s),
            ("ddtree_prefill_seconds", "seconds spent in prompt prefills", t.prefill_s),
            ("ddtree_cancelled_decodes", "decodes stopped because the client left", t.cancelled),
            (
                "ddtree_cancel_seconds",
                "seconds from a cancel (the client left) to the engine stopping that decode",
                t.cancel_s,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        stage = CounterMetricFamily(
            "ddtree_stage_seconds",
            "seconds spent in each stage of the decode steps",
            labels=["stage"],
        )
        mean_stage = GaugeMetricFamily(
            "ddtree_step_stage_seconds_mean",
            "mean seconds per decode step in each stage, over all finished requests",
            labels=["stage"],
        )
        for name, seconds in t.stage_s.items():
            stage.add_metric([name.value], seconds)
            mean_stage.add_metric([name.value], seconds / t.steps if t.steps else 0.0)
        yield stage
        yield mean_stage
        yield GaugeMetricFamily(
            "ddtree_mean_tau", "tokens per decode step (acceptance length), lifetime", t.mean_tau
        )
        yield GaugeMetricFamily(
            "ddtree_tokens_per_second",
            "engine tokens/s over all rows (tokens its steps gave / their wall seconds; a "
            "batched step counted once), lifetime",
            t.tokens_per_s,
        )
        yield GaugeMetricFamily(
            "ddtree_batch_rows_mean",
            "requests per engine step (the batch size), mean over the engine's steps",
            t.row_steps / t.engine_steps if t.engine_steps else 0.0,
        )
        by_rows = {
            "ddtree_batch_steps": ("engine steps, by the requests in each", 0),
            "ddtree_batch_seconds": ("wall seconds of those steps, by batch size", 1),
            "ddtree_batch_tokens": ("tokens those steps gave, by batch size", 2),
        }
        for name, (doc, column) in by_rows.items():
            family = CounterMetricFamily(name, doc, labels=["rows"])
            for rows, sums in sorted(t.by_rows.items()):
                family.add_metric([str(rows)], sums[column])
            yield family
        step_s = t.decode_s / t.steps if t.steps else 0.0
        yield GaugeMetricFamily("ddtree_step_seconds_mean", "mean seconds per decode step", step_s)


class ServeMetrics:
    """Every metric of one server. ``queue_depth`` and ``running`` are read at scrape time."""

    def __init__(
        self, totals: EngineTotals, queue_depth: Callable[[], int], running: Callable[[], int]
    ):
        self.registry = CollectorRegistry()
        self.totals = totals
        r = self.registry
        r.register(_EngineCollector(totals))
        self.requests = Counter(
            "ddtree_requests",
            "requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.errors = Counter(
            "ddtree_errors", "error answers by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "ddtree_generation_tokens",
            "tokens sent to clients (cancelled requests too)",
            registry=r,
        )
        self.queue_wait = Histogram(
            "ddtree_queue_wait_seconds", "seconds a request waited for the engine", registry=r
        )
        self.first_token = Histogram(
            "ddtree_time_to_first_token_seconds",
            "seconds from arrival to the first token",
            registry=r,
        )
        self.request_seconds = Histogram(
            "ddtree_request_seconds", "seconds from arrival to the last token", registry=r
        )
        Gauge("ddtree_queue_depth", "requests waiting for the engine", registry=r).set_function(
            queue_depth
        )
        Gauge(
            "ddtree_running_requests", "requests decoding now (up to --max-batch)", registry=r
        ).set_function(running)

    def render(self) -> bytes:
        return generate_latest(self.registry)
