"""Anchors from the project's measurement records (``ddtree.records``).

- ``bench_bandwidth`` -> the ``this-machine`` hardware entry (measured bytes/s);
- ``engine_run`` -> a step anchor: the record's own target shape (its ``config_json``),
  drafter size, policy, block size, budget, measured tau and step time, on the hardware it
  ran on, in the engine profile of its ``engine_mode`` (``PROFILE_OF_MODE``: eager -> eager,
  compiled -> graphs); plus one stage anchor per measured ``Stage`` the policy's cost has
  components for (``stage_s_mean``: draft, top-k, build, layout, verify, accept, commit,
  other) and one for the prefill (``prefill_s_mean``: the target forward over the mean
  prompt length, no context), so calibration fits each component to its own timing, not only
  their sum;
- ``bench_moe`` -> one MoE-layer anchor per measured M (with the measured experts-touched
  curve when the points carry it);
- ``bench_allreduce`` -> the measured all-reduce latency and link (bus) bandwidth of the
  hardware it ran on: this machine (CPU, gloo), or the catalog GPU it names (NCCL), newest
  record first; engine runs at ``tp`` > 1 on that hardware are costed with them.

``this-machine`` is one machine: the one its newest ``bench_bandwidth`` record ran on
(``one_machine``). A record costed on ``this-machine`` (bandwidth, and engine runs, MoE and
all-reduce timings not on a catalog GPU) from another machine is left out with a note, never
fitted into the same profile; a catalog GPU's records and acceptance records (a replayed tau
is the same on any hardware) are kept whatever machine wrote them.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from ddtree.perf.cost.step import DEPLOYMENTS, Drafter, Point, default_params, params_at, step_cost
from ddtree.perf.hardware.catalog import Hardware, match_gpu, this_machine, with_measured_allreduce
from ddtree.perf.inputs.scenario import MoeAnchor, ScenarioError, StageAnchor, StepAnchor
from ddtree.perf.shapes.model import ModelError, ModelShape, shape_from_config
from ddtree.records import BenchAllreduce, BenchBandwidth, BenchMoe, EngineRun, HardwareInfo, Record
from ddtree.vocab import EngineMode, Stage, get_policy

PROFILE_OF_MODE = {EngineMode.EAGER: "eager", EngineMode.COMPILED: "graphs"}
"""The estimator's engine profile for an engine_run's ``engine_mode``: a torch.compile run
(inductor C++ on a CPU, CUDA graphs on a GPU) removes the per-op Python dispatch, as graph
replay does."""

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


def _catalog_gpu(record: Record) -> Hardware | None:
    """The catalog entry of the GPU a CUDA record ran on (None: a CPU record, or unknown)."""
    gpu = record.hardware.gpu_name or ""
    if str(record.config.get("device", "cpu")).startswith("cuda") and gpu:
        return match_gpu(gpu)
    return None


def _same_machine(a: HardwareInfo, b: HardwareInfo) -> bool:
    """Same CPU model and core count, and the same host name when both records have one
    (schema-1 records and older writers may not)."""
    hosts = a.hostname and b.hostname
    return (a.cpu_model, a.cpu_cores) == (b.cpu_model, b.cpu_cores) and (
        not hosts or a.hostname == b.hostname
    )


def _machine(hw: HardwareInfo) -> str:
    return (
        f"{'host ' + hw.hostname + ': ' if hw.hostname else ''}{hw.cpu_model}, {hw.cpu_cores} cores"
    )


def one_machine(records: list[Record]) -> tuple[list[Record], str | None]:
    """The records ``this-machine`` may be fitted to, and a note naming the ones left out.

    ``this-machine`` is the machine of the newest ``bench_bandwidth`` record; the records
    costed on it (bandwidth; engine_run, bench_moe, bench_allreduce not on a catalog GPU) that
    ran elsewhere are left out. Without a bandwidth record nothing is costed on it and all
    are kept."""
    bandwidth = [r for r in records if isinstance(r, BenchBandwidth)]
    if not bandwidth:
        return list(records), None
    here = max(bandwidth, key=lambda r: r.created_utc).hardware
    kept, left = [], []
    for r in records:
        costed_here = isinstance(r, BenchBandwidth) or (
            isinstance(r, (EngineRun, BenchMoe, BenchAllreduce)) and _catalog_gpu(r) is None
        )
        (left if costed_here and not _same_machine(r.hardware, here) else kept).append(r)
    if not left:
        return kept, None
    kinds = {k: sum(1 for r in left if r.kind == k) for k in dict.fromkeys(r.kind for r in left)}
    machines = sorted({_machine(r.hardware) for r in left})
    return kept, (
        f"records: left out {', '.join(f'{n} {k}' for k, n in kinds.items())} record(s) of "
        f"another machine ({'; '.join(machines)}): this-machine is {_machine(here)} (its newest "
        "bench_bandwidth record), and one profile is fitted to one machine; pass the other "
        "machine's records alone to estimate it"
    )


def measured_links(records: list[Record]) -> dict[str, Hardware]:
    """Catalog GPUs with the all-reduce figures of their ``bench_allreduce`` records (the
    newest per GPU); CPU records go to this machine (``anchors_from_records``)."""
    out = {}
    for r in sorted((r for r in records if isinstance(r, BenchAllreduce)),
                    key=lambda r: r.created_utc):  # fmt: skip
        hw = _catalog_gpu(r)
        if hw is not None:
            out[hw.key] = with_measured_allreduce(hw, r)
    return out


def hardware_for(
    record: Record, machine: Hardware | None, links: dict[str, Hardware] | None = None
) -> Hardware:
    """The catalog GPU a CUDA record ran on (with measured all-reduce figures from ``links``),
    else this machine (from bench_bandwidth)."""
    gpu = record.hardware.gpu_name or ""
    if str(record.config.get("device", "cpu")).startswith("cuda") and gpu:
        hw = match_gpu(gpu)
        if hw is not None:
            return (links or {}).get(hw.key, hw)
        if machine is None:
            raise ScenarioError(
                f"records: a {record.kind} record ran on GPU {gpu!r}, which is not in the "
                "hardware catalog, and no bench_bandwidth record of it gives its bandwidth"
            )
        return machine
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
        shape = shape_from_config(cfg, name=str(record.target.get("name") or "target"), where=where)
    except ModelError as exc:
        raise ScenarioError(str(exc)) from None
    prec = _PREC.get(record.dtype.replace("torch.", ""), "fp32")
    return ModelShape(**{**shape.__dict__, "precision": {c: prec for c in shape.precision}})


def _drafter_of(record: EngineRun) -> Drafter | None:
    d = record.drafter
    if not isinstance(d, dict):
        return None
    dtype = _PREC.get(str(d.get("dtype") or "float32").replace("torch.", ""), "fp32")
    # a draft vocabulary (--draft-vocab K): its own K-row copy of the target's LM head
    draft_vocab = int(d.get("draft_vocab") or 0)
    return Drafter(
        params=float(d.get("n_params") or 0),
        layers=int(d.get("num_layers") or 1),
        precision=dtype,
        shares_target_lm_head=not draft_vocab,
        source="engine_run record",
        lm_head_vocab=draft_vocab,
    )


STAGE_NOISE = 0.02  # relative run-to-run noise of a stage's mean time (assumed)
STAGE_NOISE_FLOOR_S = 5e-6  # and an absolute floor: timer reads and jitter (assumed)


def stage_noise(seconds: float) -> float:
    """Relative 1-sigma noise of a measured stage mean: 2%, or 5 µs when that is more (a
    0.1 ms stage is known to about 5%, a 5 ms one to 2%)."""
    return float(np.hypot(STAGE_NOISE, STAGE_NOISE_FLOOR_S / seconds))


def _stage_anchors(step: StepAnchor, r: EngineRun) -> list[StageAnchor]:
    """One anchor per measured stage the step's cost has components for, and the prefill."""
    src = f"measured: engine_run {r.created_utc}"
    defaults = params_at(default_params())
    modelled = {c.stage for c in step_cost(step.model, step.point, defaults, step.tau).components}
    out = [
        StageAnchor(f"{step.name}:{stage}", step.name, stage, step.model, step.point, step.tau,
                    secs, src, noise=stage_noise(secs))
        for stage, secs in r.stage_s_mean.items()
        if secs > 0 and stage in modelled
    ]  # fmt: skip
    lens = r.prompt_lengths
    prompt = sum(lens) / len(lens) if lens else 0.0
    if r.prefill_s_mean and prompt >= 1:
        out.append(
            StageAnchor(f"{step.name}:prefill", step.name, Stage.PREFILL, step.model, step.point,
                        step.tau, r.prefill_s_mean, src, prompt_tokens=prompt)
        )  # fmt: skip
    return out


def _context(r: EngineRun) -> float:
    """The mean context a run's steps saw: its mean prompt plus half its new tokens."""
    lens = r.prompt_lengths or [0]
    return sum(lens) / len(lens) + 0.5 * r.max_new_tokens


def _same_setup(i: int, r: EngineRun) -> tuple:
    """What makes two engine runs' step anchors interchangeable: the machine, the models, the
    configuration, and the context to within a factor of 2 (its octave)."""
    return (
        _machine(r.hardware), r.hardware.gpu_name, str(r.config.get("device", "cpu")),
        json.dumps(r.target, sort_keys=True, default=str),
        json.dumps(r.drafter, sort_keys=True, default=str),
        r.policy, r.block_size, r.budget, r.engine_mode, r.tp, r.concurrency, r.dtype,
        int(np.floor(np.log2(max(_context(r), 1.0)))),
    )  # fmt: skip


def merge_runs(runs: list[EngineRun]) -> EngineRun:
    """One engine run standing for several of one setup (``_same_setup``): its steps are all
    of theirs, so step and stage means and tau are weighted by steps, the prefill by prompts,
    and its context is theirs weighted by steps. ``ddtree serve --records`` writes one record
    per request; a thousand requests of one server become a few anchors, not ten thousand."""
    if len(runs) == 1:
        return runs[0]
    steps = np.array([max(r.steps, 1) for r in runs], dtype=float)
    w = steps / steps.sum()
    stages = list(dict.fromkeys(k for r in runs for k in r.stage_s_mean))
    prompts = [n for r in runs for n in (r.prompt_lengths or [0])]
    # the context each run saw, reproduced by _context from the merged prompt and new tokens
    ctx = float(np.dot(w, [_context(r) for r in runs]))
    mean_prompt = sum(prompts) / len(prompts)
    prefills = [(r.prefill_s_mean, len(r.prompt_lengths or [0])) for r in runs if r.prefill_s_mean]
    prefill = sum(p * n for p, n in prefills) / sum(n for _, n in prefills) if prefills else None
    step_s = float(np.dot(w, [r.step_s_mean for r in runs]))
    tau = float(np.dot(w, [r.mean_tau for r in runs]))
    return dataclasses.replace(
        runs[-1],
        mean_tau=tau,
        step_s_mean=step_s,
        tokens_per_s=tau / step_s,
        stage_s_mean={k: float(np.dot(w, [r.stage_s_mean.get(k, 0.0) for r in runs])) for k in stages},
        steps=int(steps.sum()),
        new_tokens=sum(r.new_tokens for r in runs),
        prefill_s_mean=prefill,
        prompts=len(prompts),
        prompt_set={"count": len(prompts), "lengths": [round(mean_prompt)] * len(prompts)},
        max_new_tokens=max(0, round(2 * (ctx - round(mean_prompt)))),
        points=[],
    )  # fmt: skip


def _engine_anchors(
    i: int, r: EngineRun, machine: Hardware | None, links: dict, merged: int = 1
) -> list:
    where = f"record {i} ({r.kind}, {r.created_utc})"
    ctx = _context(r)
    policy = get_policy(r.policy)
    ep = int(r.target.get("ep") or 1)
    point = Point(
        hardware=hardware_for(r, machine, links),
        tp=r.tp,
        deployment=DEPLOYMENTS["tp-ep" if ep > 1 else "tp"],
        concurrency=r.concurrency,
        context_tokens=ctx,
        block_size=policy.block(r.block_size),
        budget=policy.budget(r.block_size, r.budget),
        engine=PROFILE_OF_MODE[r.engine_mode],
        drafter=_drafter_of(r) if policy.needs_drafter else None,
        policy=policy,
    )
    runs = f"run{i}" if merged == 1 else f"run{i}+{merged - 1}"
    source = (
        f"engine_run {r.created_utc}" if merged == 1 else f"{merged} engine_runs to {r.created_utc}"
    )
    step = StepAnchor(
        f"{runs}:{r.policy}:{r.engine_mode}:B{point.block_size}:N{point.budget}",
        _model_of(r, where),
        point,
        r.mean_tau,
        r.step_s_mean,
        f"measured: {source} ({r.provenance.producer})",
        from_records=True,
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
                  float(p["s_per_layer"]), f"measured: bench_moe {r.created_utc}", curve or None,
                  from_records=True)
        for p in r.points
    ]  # fmt: skip


def anchors_from_records(records: list[Record]) -> tuple[list, Hardware | None]:
    machine = this_machine(records)
    cpu_links = sorted(
        (r for r in records if isinstance(r, BenchAllreduce) and _catalog_gpu(r) is None),
        key=lambda r: r.created_utc,
    )
    if machine is not None and cpu_links:
        machine = with_measured_allreduce(machine, cpu_links[-1])
    links = measured_links(records)
    anchors: list = []
    groups: dict[tuple, list[tuple[int, EngineRun]]] = {}
    for i, r in enumerate(records):
        if isinstance(r, EngineRun):
            groups.setdefault(_same_setup(i, r), []).append((i, r))
        elif isinstance(r, BenchMoe):
            anchors.extend(_moe_anchors(i, r, machine))
    for group in sorted(groups.values(), key=lambda g: g[0][0]):
        first = group[0][0]
        merged = merge_runs([r for _, r in group])
        anchors.extend(_engine_anchors(first, merged, machine, links, merged=len(group)))
    return anchors, machine
