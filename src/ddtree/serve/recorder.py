"""``--records FILE``: one ``engine_run`` record per finished request, appended off the engine
thread (``write_records`` waits for the file's lock and syncs it to disk, which should not
delay the next request). Records that arrive while a write runs go out together in the next write."""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
from pathlib import Path


class RecordWriter:
    def __init__(self, path: Path, models, device: str) -> None:
        self.path, self.models, self.device = path, models, device
        self._pending: queue.Queue = queue.Queue()
        self.written = 0  # records appended so far
        self._thread = threading.Thread(target=self._run, name="ddtree-records", daemon=True)
        self._thread.start()

    def add(self, result, config, prompt_tokens: int, extra: dict) -> None:
        """Queue one finished request (any thread). A request with no decode step (max_tokens
        1) has no step time to record and is skipped, as ``ddtree generate`` skips it."""
        if result.steps:
            self._pending.put((result, config, prompt_tokens, extra))

    def close(self) -> None:
        """Write what is queued, then stop (once; later calls return at once)."""
        if not self._thread.is_alive():
            return
        self._pending.put(None)
        self._thread.join()

    def _run(self) -> None:
        done = False
        while not done:
            batch = [self._pending.get()]
            while not self._pending.empty():
                batch.append(self._pending.get())
            done = batch[-1] is None
            items = [item for item in batch if item is not None]
            if items:
                self._write(items)

    def _record(self, result, config, prompt_tokens: int, extra: dict):
        from ddtree.engine import engine_run_record
        from ddtree.provenance import this_process

        m = self.models
        record = engine_run_record(
            [result],
            config,
            m.target.info,
            m.target_path,
            None if m.drafter is None else m.drafter.info,
            m.drafter_path,
            device=self.device,
            prompt_lens=[prompt_tokens],
            extra=extra,
        )
        return dataclasses.replace(record, provenance=this_process("ddtree serve"))

    def _write(self, items) -> None:
        from ddtree.records import write_records

        try:
            write_records(self.path, [self._record(*item) for item in items])
            self.written += len(items)
        except Exception as e:  # a full disk or a bad record must not stop the service
            print(f"warning: {self.path}: {len(items)} records not written ({e})", file=sys.stderr)
