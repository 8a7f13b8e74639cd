"""Anchors from the project's measurement records (``ddtree.records``).

- ``bench_bandwidth`` -> the ``this-machine`` hardware entry (measured bytes/s);
- ``engine_run`` -> a step anchor: the record's own target shape (its ``config_json``),
  drafter size, block size, budget, measured tau and step time, on this machine; plus one
  stage anchor per measured stage (``summary.stage_s_mean``: draft, top-k, tree build +
  layout, verify, accept, commit, other) and one for the prefill (``summary.prefill_s_mean``:
  the target forward over the mean prompt length, no context), so calibration fits each
  component to its own timing, not only their sum;
- ``bench_moe`` -> one MoE-layer anchor per measured M (with the measured experts-touched
  curve when the points carry it).
"""

from __future__ import annotations

from dataclasses import replace

from ddtree.perf.catalog import Hardware, load_catalog, this_machine
from ddtree.perf.cost import STAGE_COMPONENTS, TARGET_FORWARD, Drafter, Point
from ddtree.perf.model import ModelError, ModelShape, shape_from_config
from ddtree.perf.scenario import MoeAnchor, ScenarioError, StageAnchor, StepAnchor
from ddtree.records import Record

_PREC = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "fp32": "fp32",
    "int4": "int4-g32",
    "int4-g32": "int4-g32",
    "int4_g32": "int4-g32",
    "int4-g128": "int4-g128",
}


def hardware_for(record: Record, machine: Hardware | None) -> Hardware:
    """The catalog GPU the record ran on, else this machine (from bench_bandwidth)."""
    gpu = (record.hardware.gpu_name or "").lower()
    device = str(record.config.get("device", "cpu"))
    if device.startswith("cuda") and gpu:
        for key, hw in load_catalog().items():
            if all(tok in gpu for tok in key.split("-")[:1]):
                return hw
    if machine is None:
        raise ScenarioError(
            "records: an engine_run/bench_moe record ran on this machine but no "
            "bench_bandwidth record gives its bandwidth (run `ddtree bench bandwidth --records ...`)"
        )
    return machine


def _model_of(record: Record, where: str) -> ModelShape:
    target = record.config.get("target") or {}
    cfg = target.get("config_json") if isinstance(target, dict) else None
    if not cfg:
        raise ScenarioError(f"{where}: engine_run record has no target.config_json to cost")
    try:
        shape = shape_from_config(cfg, name=str(target.get("name", "target")), where=where)
    except ModelError as exc:
        raise ScenarioError(str(exc)) from None
    dtype = str(record.config.get("dtype", "float32"))
    prec = _PREC.get(dtype.replace("torch.", ""), "fp32")
    return ModelShape(**{**shape.__dict__, "precision": {c: prec for c in shape.precision}})


def _drafter_of(record: Record) -> Drafter | None:
    d = record.config.get("drafter")
    if not isinstance(d, dict):
        return None
    dtype = _PREC.get(str(d.get("dtype", "float32")).replace("torch.", ""), "fp32")
    return Drafter(
        params=float(d.get("n_params", 0)),
        layers=int(d.get("num_layers", 1)),
        precision=dtype,
        source="engine_run record",
    )


# a record's stage -> the cost-model stage it is part of (layout builds the tree's mask)
_STAGE_OF = {"layout": "build"}


def _stage_anchors(step: StepAnchor, r: Record, prompt_lengths: list) -> list[StageAnchor]:
    """One anchor per measured stage, and one for the prefill forward."""
    src = f"measured: engine_run {r.created_utc}"
    stages = r.summary.get("stage_s_mean") or {}
    total: dict[str, float] = {}
    for name, secs in stages.items():
        key = _STAGE_OF.get(name, name)
        if key in STAGE_COMPONENTS:
            total[key] = total.get(key, 0.0) + float(secs)
    out = []
    for stage, secs in total.items():
        if secs <= 0 or (stage == "draft" and step.point.drafter is None):
            continue
        out.append(
            StageAnchor(
                f"{step.name}:{stage}",
                step.name,
                stage,
                STAGE_COMPONENTS[stage],
                step.model,
                step.point,
                step.tau,
                secs,
                src,
            )  # fmt: skip
        )
    prefill_s = float(r.summary.get("prefill_s_mean") or 0.0)
    prompt = sum(prompt_lengths) / len(prompt_lengths)
    if prefill_s > 0 and prompt >= 1:
        # the prefill is one target forward over the prompt: width T, no cached context
        pt = replace(step.point, budget=max(round(prompt) - 1, 0), context_tokens=0.0)
        out.append(
            StageAnchor(
                f"{step.name}:prefill",
                step.name,
                "prefill",
                TARGET_FORWARD,
                step.model,
                pt,
                step.tau,
                prefill_s,
                src,
            )  # fmt: skip
        )
    return out


def anchors_from_records(records: list[Record]) -> tuple[list, Hardware | None]:
    machine = this_machine(records)
    anchors: list = []
    for i, r in enumerate(records):
        where = f"record {i} ({r.kind}, {r.created_utc})"
        if r.kind == "engine_run":
            if r.config.get("policy") == "ar" or r.config.get("budget", 0) < 1:
                continue
            lens = (r.config.get("prompts") or {}).get("lengths") or [0]
            ctx = sum(lens) / len(lens) + 0.5 * float(r.config.get("max_new_tokens", 0) or 0)
            point = Point(
                hardware=hardware_for(r, machine),
                tp=int(r.config.get("tp", 1)),
                concurrency=int(r.config.get("concurrency", 1)),
                context_tokens=ctx,
                block_size=int(r.config["block_size"]),
                budget=int(r.config["budget"]),
                engine="python",
                drafter=_drafter_of(r),
            )
            step = StepAnchor(
                f"run{i}:{r.config['policy']}:B{point.block_size}:N{point.budget}",
                _model_of(r, where),
                point,
                float(r.summary["mean_tau"]),
                float(r.summary["step_s_mean"]),
                f"measured: engine_run {r.created_utc}",
            )
            anchors.append(step)
            anchors.extend(_stage_anchors(step, r, lens))
        elif r.kind == "bench_moe":
            c = r.config
            model = ModelShape(
                name=f"moe H{c['hidden_size']} I{c['moe_intermediate_size']}",
                num_layers=1,
                first_k_dense=0,
                hidden_size=int(c["hidden_size"]),
                intermediate_size=0,
                vocab_size=1,
                attention="gqa",
                num_heads=1,
                num_kv_heads=1,
                moe_intermediate_size=int(c["moe_intermediate_size"]),
                n_routed_experts=int(c["n_routed_experts"]),
                top_k=int(c["top_k"]),
                precision={"routed_experts": _PREC.get(str(c["precision"]).lower(), "bf16")},
            )
            hw = hardware_for(r, machine)
            curve = tuple(
                (float(p["m"]), float(p["experts_touched"]))
                for p in r.points
                if "experts_touched" in p
            )
            for p in r.points:
                anchors.append(
                    MoeAnchor(
                        f"moe{i}:{c['precision']}:M{p['m']}",
                        model,
                        hw,
                        int(p["m"]),
                        1,
                        float(p["s_per_layer"]),
                        f"measured: bench_moe {r.created_utc}",
                        curve or None,
                    )
                )
    return anchors, machine
