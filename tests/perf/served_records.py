"""Records as ``ddtree serve --records`` writes them, many at once, without a server: one
``engine_run`` per request (one prompt each, its own length and max_tokens, every step a
point with its context length), all of one configuration, plus the bandwidth record of the
machine they ran on. Built from the bundled demo-pair CPU runs.

    python tests/perf/served_records.py N OUT.jsonl   # N served records (and one bandwidth)
"""

from __future__ import annotations

import json
import random
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

RUNS = Path(__file__).parent / "data" / "demo_pair_cpu_runs.jsonl"


def served_records(n: int, seed: int = 0) -> list[dict]:
    lines = [json.loads(line) for line in RUNS.read_text(encoding="utf-8").splitlines() if line]
    run = next(r for r in lines if r["kind"] == "engine_run")
    bandwidth = next(r for r in lines if r["kind"] == "bench_bandwidth")
    rng = random.Random(seed)
    start = datetime(2026, 12, 3, tzinfo=UTC)
    out = [{**bandwidth, "schema": 2, "created_utc": start.isoformat()}]
    stage_mean = run["summary"]["stage_s_mean"]
    for i in range(n):
        prompt = rng.randint(8, 200)
        max_new = rng.choice([16, 32, 64, 128, 256])
        points, context, made = [], prompt, 1
        while made < max_new:
            tau = min(rng.randint(1, 6), max_new - made)
            scale = rng.uniform(0.9, 1.2)
            stage_s = {k: v * scale for k, v in stage_mean.items()}
            points.append({"tau": tau, "step_s": sum(stage_s.values()), "stage_s": stage_s,
                           "context_len": context})  # fmt: skip
            context += tau
            made += tau
        step_s = sorted(p["step_s"] for p in points)
        total = sum(step_s)
        summary = {
            **run["summary"],
            "mean_tau": sum(p["tau"] for p in points) / len(points),
            "tokens_per_s": sum(p["tau"] for p in points) / total,
            "step_s_mean": total / len(points),
            "step_s_p50": step_s[len(step_s) // 2],
            "step_s_p90": step_s[int(0.9 * (len(step_s) - 1))],
            "stage_s_mean": {
                k: sum(p["stage_s"][k] for p in points) / len(points) for k in stage_mean
            },
            "steps": len(points),
            "new_tokens": max_new,
            "prefill_s_mean": run["summary"]["prefill_s_mean"] * rng.uniform(0.8, 1.3),
            "prompts": 1,
        }
        config = {**run["config"], "max_new_tokens": max_new, "seed": rng.randint(0, 2**31),
                  "prompts": {"count": 1, "lengths": [prompt]}, "engine_mode": "eager",
                  "endpoint": "completions", "queue_s": rng.uniform(0, 0.5)}  # fmt: skip
        out.append({
            "schema": 2, "kind": "engine_run", "hardware": run["hardware"],
            "provenance": {"producer": "ddtree serve", "command": "ddtree serve --records r.jsonl",
                           "version": "", "commit": None},
            "created_utc": (start + timedelta(seconds=i + 1)).isoformat(),
            "config": config, "summary": summary, "points": points,
        })  # fmt: skip
    return out


def write_served_records(n: int, path: Path, seed: int = 0) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in served_records(n, seed))
    path.write_text(text, encoding="utf-8")
    return path


if __name__ == "__main__":
    write_served_records(int(sys.argv[1]), Path(sys.argv[2]))
