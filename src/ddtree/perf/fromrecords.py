"""Anchors from the project's measurement records (``ddtree.records``).

- ``bench_bandwidth`` -> the ``this-machine`` hardware entry (measured bytes/s);
- ``engine_run`` -> a step anchor: the record's own target shape (its ``config_json``),
  drafter size, block size, budget, measured tau and step time, on this machine; plus one
  stage anchor per measured ``Stage`` (``stage_s_mean``: draft, top-k, build, layout, verify,
  accept, commit, other) and one for the prefill (``prefill_s_mean``: the target forward
  over the mean prompt length, no context), so calibration fits each component to its own
  timing, not only their sum;
- ``bench_moe`` -> one MoE-layer anchor per measured M (with the measured experts-touched
  curve when the points carry it).
"""

from __future__ import annotations

from ddtree.perf.catalog import Hardware, load_catalog, this_machine
from ddtree.perf.cost import Drafter, Point
from ddtree.perf.model import ModelError, ModelShape, shape_from_config
from ddtree.perf.scenario import MoeAnchor, ScenarioError, StageAnchor, StepAnchor
from ddtree.records import BenchMoe, EngineRun, Record, Stage

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


def _model_of(record: EngineRun, where: str) -> ModelShape:
    cfg = record.target.get("config_json")
    if not cfg:
        raise ScenarioError(f"{where}: engine_run record has no target.config_json to cost")
    try:
        shape = shape_from_config(cfg, name=str(record.target.get("name", "target")), where=where)
    except ModelError as exc:
        raise ScenarioError(str(exc)) from None
    prec = _PREC.get(record.dtype.replace("torch.", ""), "fp32")
    return ModelShape(**{**shape.__dict__, "precision": {c: prec for c in shape.precision}})


def _drafter_of(record: EngineRun) -> Drafter | None:
    d = record.drafter
    if not isinstance(d, dict):
        return None
    dtype = _PREC.get(str(d.get("dtype", "float32")).replace("torch.", ""), "fp32")
    return Drafter(
        params=float(d.get("n_params", 0)),
        layers=int(d.get("num_layers", 1)),
        precision=dtype,
        source="engine_run record",
    )


def _stage_anchors(step: StepAnchor, r: EngineRun) -> list[StageAnchor]:
    """One anchor per measured stage, and one for the prefill forward."""
    src = f"measured: engine_run {r.created_utc}"
    out = []
    for stage, secs in r.stage_s_mean.items():
        if secs <= 0 or (stage is Stage.DRAFT and step.point.drafter is None):
            continue
        out.append(StageAnchor(f"{step.name}:{stage}", step.name, stage, step.model,
                               step.point, step.tau, secs, src))  # fmt: skip
    lens = r.prompt_lengths
    prompt = sum(lens) / len(lens) if lens else 0.0
    if r.prefill_s_mean and prompt >= 1:
        out.append(
            StageAnchor(f"{step.name}:prefill", step.name, Stage.PREFILL, step.model, step.point,
                        step.tau, r.prefill_s_mean, src, prompt_tokens=prompt)
        )  # fmt: skip
    return out


def _engine_anchors(i: int, r: EngineRun, machine: Hardware | None) -> list:
    where = f"record {i} ({r.kind}, {r.created_utc})"
    lens = r.prompt_lengths or [0]
    ctx = sum(lens) / len(lens) + 0.5 * r.max_new_tokens
    point = Point(
        hardware=hardware_for(r, machine),
        tp=r.tp,
        concurrency=r.concurrency,
        context_tokens=ctx,
        block_size=r.block_size,
        budget=r.budget,
        engine="python",
        drafter=_drafter_of(r),
    )
    step = StepAnchor(
        f"run{i}:{r.policy}:B{point.block_size}:N{point.budget}",
        _model_of(r, where),
        point,
        r.mean_tau,
        r.step_s_mean,
        f"measured: engine_run {r.created_utc}",
    )
    return [step, *_stage_anchors(step, r)]


def _moe_anchors(i: int, r: BenchMoe, machine: Hardware | None) -> list[MoeAnchor]:
    model = ModelShape(
        name=f"moe H{r.hidden_size} I{r.moe_intermediate_size}",
        num_layers=1,
        first_k_dense=0,
        hidden_size=r.hidden_size,
        intermediate_size=0,
        vocab_size=1,
        attention="gqa",
        num_heads=1,
        num_kv_heads=1,
        moe_intermediate_size=r.moe_intermediate_size,
        n_routed_experts=r.n_routed_experts,
        top_k=r.top_k,
        precision={"routed_experts": _PREC.get(r.precision.lower(), "bf16")},
    )
    hw = hardware_for(r, machine)
    curve = tuple(
        (float(p["m"]), float(p["experts_touched"])) for p in r.points if "experts_touched" in p
    )
    return [
        MoeAnchor(f"moe{i}:{r.precision}:M{p['m']}", model, hw, int(p["m"]), 1,
                  float(p["s_per_layer"]), f"measured: bench_moe {r.created_utc}", curve or None)
        for p in r.points
    ]  # fmt: skip


def anchors_from_records(records: list[Record]) -> tuple[list, Hardware | None]:
    machine = this_machine(records)
    anchors: list = []
    for i, r in enumerate(records):
        if isinstance(r, EngineRun):
            if r.policy == "ar" or r.budget < 1:
                continue
            anchors.extend(_engine_anchors(i, r, machine))
        elif isinstance(r, BenchMoe):
            anchors.extend(_moe_anchors(i, r, machine))
    return anchors, machine
