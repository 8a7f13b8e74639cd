"""A benchmark's result as its record holds it: the record kind, the configuration, the
summary and the measured points (dataclasses: the record's rows). Each harness builds one from
its points (all of them, or those measured before an interrupt); ``ddtree.commands._bench``
prints, records and emits it. A run that writes several records (one per method, say) holds
them as ``parts``."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BenchResult:
    kind: str  # a record kind (ddtree.records.RECORD_KINDS), e.g. "bench_attention"
    config: dict
    summary: dict
    points: list  # dataclasses, one per measured point
    document: dict | None = None  # the --json line where a bench has its own layout
    parts: list | None = None  # BenchResults, one record each, where a run writes several

    @property
    def records(self) -> list[BenchResult]:
        """What ``--records`` appends, one record each: ``parts``, else this result."""
        return [self] if self.parts is None else self.parts

    @property
    def what(self) -> str:
        """Its records in words: "a bench_x record", or "N bench_x records" with ``parts``."""
        if self.parts is None:
            return f"a {self.kind} record"
        return f"{len(self.parts)} {self.kind} records"

    @property
    def rows(self) -> list[dict]:
        return [asdict(p) for p in self.points]

    def json_document(self) -> dict:
        """The one ``--json`` line: ``document``, else config, summary and points."""
        if self.document is not None:
            return self.document
        return {"config": self.config, "summary": self.summary, "points": self.rows}
