"""A benchmark's result as its record holds it: the record kind, the configuration, the
summary and the measured points (dataclasses: the record's rows). Each harness builds one from
its points (all of them, or those measured before an interrupt); ``ddtree.commands._bench``
prints, records and emits it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BenchResult:
    kind: str  # a record kind (ddtree.records.RECORD_KINDS), e.g. "bench_attention"
    config: dict
    summary: dict
    points: list  # dataclasses, one per measured point
    document: dict | None = None  # the --json line where a bench has its own layout

    @property
    def rows(self) -> list[dict]:
        return [asdict(p) for p in self.points]

    def json_document(self) -> dict:
        """The one ``--json`` line: ``document``, else config, summary and points."""
        if self.document is not None:
            return self.document
        return {"config": self.config, "summary": self.summary, "points": self.rows}
