"""`ddtree bench shapes`: step costs at the shapes users run, and the regime they put DDTree
in. A random-weight target of a published shape (``--preset``), its DFlash drafter's shape under
the synthetic oracle (which sets the acceptance: every table row and record says so), AR, chain
and DDTree at each budget, eager and compiled, in one sweep; each step's bytes, the measured
read bandwidth and the fraction of the memory roofline it reaches (``ddtree.bench.shapes``).

Run: ``ddtree bench shapes --preset qwen3-1.7b --budgets 8,32,128 --records runs/shapes.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from ddtree.commands._args import (
    AUTO,
    add_dtype_argument,
    add_json_argument,
    add_threads_argument,
    budget_list,
    device,
    int_list_upto,
    positive_int,
    records_file,
    set_threads,
    threads_label,
)
from ddtree.vocab import AUTO_MAX_BUDGET

DEFAULT_ORACLE = "oracle:p=0.65,spread=0.5,ranks=8"  # tau about 4 at B = 16, N = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ddtree.models.presets import preset_names

    p.add_argument(
        "--preset",
        default="qwen3-0.6b",
        choices=preset_names(),
        help="model shape (published config.json; see ddtree/assets/presets) (default %(default)s)",
    )
    add_dtype_argument(p, "bfloat16", "weights and activations")
    p.add_argument(
        "--device", type=device(), default="cpu", help="torch device (default %(default)s)"
    )
    p.add_argument(
        "--engine-modes",
        default="eager,compiled",
        type=_modes,
        help="comma-separated engine modes (default %(default)s)",
    )
    p.add_argument(
        "--compile-scope",
        default="layer",
        choices=("layer", "model"),
        help="compiled mode: each decoder layer (seconds to compile) or the whole forward "
        "(minutes at these depths) (default %(default)s)",
    )
    p.add_argument(
        "--budgets",
        type=budget_list,
        default=[8, 16, 32, 64, 128, 256],
        help="DDTree budgets N; 'auto' chooses each step (--budget auto)",
    )
    p.add_argument(
        "--oracle",
        default=DEFAULT_ORACLE,
        help="the synthetic drafter's accuracy (ddtree.models.oracle) (default %(default)s)",
    )
    p.add_argument(
        "--draft-vocab",
        type=positive_int,
        metavar="K",
        help="the drafter's LM head computes K rows, not V (its cost is measured; a random "
        "target has no corpus, so the K are its EOS and smallest ids, and the oracle's proposals "
        "stay synthetic over the full vocabulary) (default: the full vocabulary)",
    )
    p.add_argument(
        "--concurrency",
        type=int_list_upto(256),
        help="comma-separated request counts C decoded together (ddtree.engine.batch; each "
        "request its own oracle); tokens/s is then all rows' (default: one at a time)",
    )
    p.add_argument("--prompts", type=positive_int, default=2, help="random prompts (default 2)")
    p.add_argument("--context", type=positive_int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="(default 64)")
    add_threads_argument(p)
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and oracle (default 0)")
    p.add_argument(
        "--bandwidth-records",
        help="a records file with this machine's bench_bandwidth record (default: measure now)",
    )
    p.add_argument("--records", type=records_file, help="append engine_run + bandwidth records")
    add_json_argument(p)


def _modes(text: str) -> list[str]:
    from ddtree.commands._decode import engine_modes

    return engine_modes(text)


def run(args: argparse.Namespace) -> int:
    from ddtree.commands._output import note
    from ddtree.models.oracle import parse_oracle_spec
    from ddtree.records import write_records

    oracle_spec = parse_oracle_spec(args.oracle)
    set_threads(args)
    setup = _setup(args)  # the memory it needs checked before allocating
    bandwidth = _bandwidth(args, setup.device)
    kept = _keep_bandwidth(args, bandwidth[1])  # what --records holds from this run
    sweep = _Sweep.start(args, setup, oracle_spec, bandwidth)
    points = _decode(args, sweep, _configs(args, setup.block), kept)
    report = sweep.report(points)
    if args.records:
        records = sweep.records(report, points)
        write_records(args.records, records)
        runs = f"{len(records)} engine_run records"
        note(f"wrote {' and '.join([*kept, runs])} to {args.records}")
    return _show(args, report)


@dataclass(frozen=True)
class _Setup:
    preset: object  # Preset
    device: object  # torch.device
    dtype: object  # torch.dtype
    block: int  # the drafter's block size
    max_len: int  # prompt, new tokens and a block


def _setup(args: argparse.Namespace) -> _Setup:
    """The preset on --device in --dtype; a ValueError where its weights, caches and widest
    forward do not fit there, else a note of what they take."""
    import torch

    from ddtree.commands._output import note
    from ddtree.models.presets import Preset, check_fits, memory_plan

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    preset = Preset.load(args.preset)
    block = int(preset.drafter["block_size"])
    max_len = args.context + args.max_new_tokens + block
    widths = [1, block, *(_largest(n) + 1 for n in args.budgets)]
    rows = max(args.concurrency or [1])  # a forward carries every row's tree
    plan = memory_plan(preset, dtype, rows * (max_len + max(widths)) + 64, rows * max(widths))
    check_fits(plan, device, f"preset {preset.name} in {args.dtype}")
    note(f"preset {preset.name} ({args.dtype}, {device}, {threads_label(args)}): {plan.describe()}")
    return _Setup(preset, device, dtype, block, max_len)


def _keep_bandwidth(args: argparse.Namespace, record) -> list[str]:
    """The bench_bandwidth ``record`` (None: not measured) appended to --records now, so an
    interrupted sweep keeps it: what the file holds from this run, in words."""
    from ddtree.records import write_records
    from ddtree.signals import deferred, keep

    kept = []
    if args.records and record is not None:
        with deferred():  # no signal between the record landing and its being counted
            write_records(args.records, [record])
            kept.append("1 bench_bandwidth record")
            keep(args.records, kept[0])
    return kept


def _largest(budget: int | str) -> int:
    """The largest tree a --budgets entry builds: N, or AUTO_MAX_BUDGET for 'auto'."""
    return AUTO_MAX_BUDGET if budget == AUTO else int(budget)


def _configs(args: argparse.Namespace, block: int) -> list:
    """AR, chain and DDTree at each budget ('auto': chosen each step), in each engine mode."""
    from ddtree.engine import DecodeConfig

    return [
        DecodeConfig(
            policy,
            block_size=block,
            budget=_largest(budget),
            auto_budget=budget == AUTO,
            max_new_tokens=args.max_new_tokens,
            engine_mode=mode,
            compile_scope=args.compile_scope,
        )
        for mode in args.engine_modes
        for policy, budget in (("ar", 1), ("chain", block - 1))
        + tuple(("ddtree", n) for n in args.budgets)
    ]


@dataclass(frozen=True)
class _Sweep:
    """What the sweep decodes with: the random-weight target, the oracle over its random
    drafter, the prompts, and the read bandwidth the rooflines divide by."""

    args: argparse.Namespace
    preset: object  # Preset
    device: object  # torch.device
    target: object
    oracle: object  # OracleDrafter
    prompts: list[list[int]]
    bandwidth: tuple  # (read bytes/s, its bench_bandwidth record or None, its source)

    @staticmethod
    def start(args: argparse.Namespace, setup: _Setup, oracle_spec, bandwidth) -> _Sweep:
        """Random weights for the preset's target and drafter, and ``--prompts`` random
        prompts."""
        import torch

        from ddtree.commands._output import progress
        from ddtree.models.oracle import OracleDrafter
        from ddtree.models.presets import random_drafter, random_target

        preset = setup.preset
        n_tensors = sum(1 for _ in _tensor_names(preset))
        with progress(f"random weights for {preset.name}", total=n_tensors) as bar:
            tick = lambda n: bar.advance(f"{n / 1e6:.0f}M parameters")  # noqa: E731
            target = random_target(
                preset, setup.dtype, setup.device, setup.max_len + 64, args.seed, tick
            )
            base = random_drafter(preset, target, args.seed + 1, tick, args.draft_vocab)
            oracle = OracleDrafter(oracle_spec, base)
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [
            torch.randint(0, preset.target["vocab_size"], (args.context,), generator=gen).tolist()
            for _ in range(args.prompts)
        ]
        return _Sweep(args, preset, setup.device, target, oracle, prompts, bandwidth)

    def report(self, points, done: int | None = None) -> ShapesReport:
        """The table's rows over the first ``done`` prompts (None: all; ``points`` cover
        them)."""
        import torch

        oracle, bandwidth = self.oracle, self.bandwidth
        return ShapesReport(
            preset=self.preset,
            dtype=self.args.dtype,
            device=str(self.device),
            threads=torch.get_num_threads(),
            compile_scope=self.args.compile_scope,
            oracle=oracle.info.name,
            draft_vocab=oracle.info.draft_vocab,
            bandwidth_bytes_per_s=bandwidth[0],
            bandwidth_source=bandwidth[2],
            rows=_rows(points, self.target, oracle, self.prompts[:done], self.preset, bandwidth[0]),
        )

    def records(self, report: ShapesReport, points, done: int | None = None) -> list:
        """The engine_run records of ``report`` over the first ``done`` prompts (None: all;
        else each marked interrupted)."""
        prompts = self.prompts[:done]
        if done is None:
            return report.records(points, self.target, self.oracle, prompts)
        extra = {"interrupted": f"after {done} of {len(self.prompts)} prompts"}
        return report.records(points, self.target, self.oracle, prompts, extra)


def _decode(args: argparse.Namespace, sweep: _Sweep, configs: list, kept: list[str]) -> list:
    """Every config over every prompt (at every --concurrency), with progress: their points.
    Interrupted with --records, the points over the prompts every config finished are
    appended first (``kept``: what the file already holds from this run)."""
    from ddtree.commands._output import progress

    points = []  # over the prompts every config has finished so far
    levels = args.concurrency or [1]
    try:
        total = len(configs) * len(sweep.prompts) * len(levels)
        with progress("decoding", total=total) as bar:
            for finished in _rounds(args, sweep, configs, bar):
                points = finished
    except KeyboardInterrupt:
        if points and args.records:
            _keep_finished(args, sweep, points, kept)
        raise
    return points


def _rounds(args: argparse.Namespace, sweep: _Sweep, configs: list, bar):
    """The sweep's rounds (engine.sweep): each (C, config) over every prompt, a request per
    row, with --concurrency; else one prompt at a time."""
    from ddtree.bench.shapes import OracleRows, oracle_feeder
    from ddtree.engine.sweep import sweep_batched, sweep_rounds

    target, oracle, prompts = sweep.target, sweep.oracle, sweep.prompts
    batched = OracleRows(oracle, prompts)
    feed = batched.on_result if args.concurrency else oracle_feeder(oracle, prompts)

    def on_result(config, i, result):
        feed(config, i, result)
        bar.advance(f"{config.engine_mode} {config.policy} N={config.budget_label} prompt {i + 1}")

    def on_warmup(config):
        if config.engine_mode != "eager":
            bar.announce(
                f"warm-up of {config.policy} N={config.budget_label}: compiling its widths"
            )

    if args.concurrency:
        return sweep_batched(
            target, oracle, prompts, configs, args.concurrency, on_result=on_result,
            on_warmup=on_warmup, drafter_for=batched.drafter_for,
        )  # fmt: skip
    return sweep_rounds(target, oracle, prompts, configs, on_result=on_result, on_warmup=on_warmup)


def _keep_finished(args: argparse.Namespace, sweep: _Sweep, points, kept: list[str]) -> None:
    """The engine_run records over the prompts every config finished, appended and named
    (with ``kept``) for the interrupt's line."""
    from ddtree.records import write_records
    from ddtree.signals import keep

    done = len(points[0].results)
    records = sweep.records(sweep.report(points, done), points, done)
    write_records(args.records, records)
    runs = (
        f"{len(records)} engine_run records over the first {done} of {len(sweep.prompts)} prompts"
    )
    keep(args.records, " and ".join([*kept, runs]))


def _show(args: argparse.Namespace, report: ShapesReport) -> int:
    """The warnings on stderr, then one JSON line (--json) or the table and its conclusions."""
    from ddtree.commands._output import console, note

    for line in report.warnings():
        note(line)
    if args.json:
        print(json.dumps(report.as_json()))
        return 0
    out = console()
    out.print(report.table())
    for line in report.conclusions():
        out.print(line, markup=False)
    return 0


def _tensor_names(preset):
    """The parameter tensors the random target and drafter have (for the progress total)."""
    import torch

    from ddtree.models.nn.decoder import DecoderModel
    from ddtree.models.nn.dflash import DFlashConfig, DFlashModel
    from ddtree.models.presets import random_target_config

    with torch.device("meta"):
        yield from DecoderModel(random_target_config(preset)).state_dict()
        yield from DFlashModel(DFlashConfig.from_dict(preset.drafter)).state_dict()


def _bandwidth(args, device):
    """(read bytes/s, its bench_bandwidth record or None, where the figure came from)."""
    import torch

    from ddtree.bench.bandwidth import measure, peak_from_records, to_records
    from ddtree.provenance import this_hardware
    from ddtree.records import read_records

    if args.bandwidth_records:
        records = read_records(args.bandwidth_records)
        peak = peak_from_records(records, device.type, args.bandwidth_records, args.threads)
        return peak.bytes_per_s, None, peak.source
    from ddtree.commands._output import note

    note("measuring read bandwidth (1 GiB, the threads of this run) ...")
    point = measure(device.type, "read", 1 << 30, repeats=5)
    extra = {"threads": torch.get_num_threads()}
    (record,) = to_records([point], this_hardware(), extra)
    source = f"measured now ({device.type}, read, {extra['threads']} threads)"
    return point.bytes_per_s, record, source


def _rows(points, target, oracle, prompts, preset, bandwidth_bytes_per_s: float):
    from ddtree.bench.shapes import ShapeRow, mean_context, step_bytes
    from ddtree.engine.runrecord import verified_budget

    top_k = int(preset.target.get("num_experts_per_tok") or 0)
    lens = [len(p) for p in prompts]
    ar_tps = {(p.config.engine_mode, p.concurrency): p.summary["tokens_per_s"] for p in points
              if not p.config.rules.needs_drafter}  # fmt: skip
    rows = []
    for p in points:
        c = p.config
        context = mean_context(p.results, lens)
        budget = verified_budget(c, p.results, p.summary)
        total, parts = step_bytes(c, target, oracle, context, top_k, p.concurrency, budget + 1)
        rows.append(
            ShapeRow(
                mode=c.engine_mode,
                policy=c.policy,
                budget=budget,
                width=budget + 1,
                auto=c.auto_budget,
                summary=p.summary,
                identical_to_ar=p.identical_to_ar,
                step_bytes=total,
                bytes_parts=parts,
                roofline_fraction=total / bandwidth_bytes_per_s / p.summary["step_s_mean"],
                vs_ar=p.summary["tokens_per_s"] / ar_tps[(c.engine_mode, p.concurrency)],
                concurrency=p.concurrency,
            )
        )
    return rows


@dataclass
class ShapesReport:
    preset: object  # Preset
    dtype: str
    device: str
    threads: int
    compile_scope: str
    oracle: str  # the synthetic drafter's name (its spec and whose cost it pays)
    bandwidth_bytes_per_s: float
    bandwidth_source: str
    rows: list
    draft_vocab: int = 0  # rows of the drafter's LM head (--draft-vocab; 0: the full vocabulary)

    def _row(self, mode: str, policy: str, budget: int | None = None, concurrency: int = 1):
        for r in self.rows:
            if (r.mode, r.policy, r.concurrency) == (mode, policy, concurrency) and (
                budget is None or r.budget == budget
            ):
                return r
        return None

    @property
    def batched(self) -> bool:
        return any(r.concurrency > 1 for r in self.rows)

    def table(self):
        from rich.table import Table

        table = Table(
            title=f"ddtree bench shapes: random-weight {self.preset.name} ({self.dtype}, "
            f"{self.device}, {self.threads} threads, compile scope {self.compile_scope}); "
            f"drafter: {self.oracle} (SYNTHETIC acceptance){self._head_label()}",
            caption=f"GB/step: what a step must read (weights, experts touched, KV); roofline: "
            f"GB/step / {self.bandwidth_bytes_per_s / 1e9:.1f} GB/s ({self.bandwidth_source}) "
            f"/ step time. T(M)/T1: verify over the AR step's verify, same mode",
        )
        columns = ["mode", "policy", "N", "M", "tau", "tok/s", "vs AR", "same as AR",
                   "step ms", "draft ms", "verify ms", "T(M)/T1", "GB/step", "roofline"]  # fmt: skip
        if self.batched:  # tok/s: all C rows'; vs AR and T(M)/T1 against AR at the same C
            columns[1:1] = ["C"]
        for col in columns:
            table.add_column(col, justify="left" if col in ("mode", "policy") else "right")
        for r in self.rows:
            s = r.summary
            ar = self._row(r.mode, "ar", concurrency=r.concurrency)
            verify = s["stage_s_mean"]["verify"]
            table.add_row(
                r.mode,
                *([str(r.concurrency)] if self.batched else []),
                r.policy,
                r.budget_label,
                str(r.width),
                f"{s['mean_tau']:.2f}",
                f"{s['tokens_per_s']:.2f}",
                f"{r.vs_ar:.2f}x",
                {None: "-", True: "yes", False: "NO"}[r.identical_to_ar],
                f"{s['step_s_mean'] * 1e3:.1f}",
                f"{s['stage_s_mean']['draft'] * 1e3:.1f}",
                f"{verify * 1e3:.1f}",
                f"{verify / ar.summary['stage_s_mean']['verify']:.2f}",
                f"{r.step_bytes / 1e9:.2f}",
                f"{r.roofline_fraction:.0%}",
            )
        return table

    def _head_label(self) -> str:
        vocab = self.preset.target["vocab_size"]
        return f", its LM head {self.draft_vocab} of {vocab} rows" if self.draft_vocab else ""

    def conclusions(self) -> list[str]:
        """What the table says about the regime, in a few measured sentences per mode."""
        lines = []
        for mode, c in dict.fromkeys((r.mode, r.concurrency) for r in self.rows):
            ar, chain = (
                self._row(mode, "ar", concurrency=c),
                self._row(mode, "chain", concurrency=c),
            )
            here = [r for r in self.rows if (r.mode, r.concurrency) == (mode, c)]
            best = max(here, key=lambda r: r.vs_ar)
            at = f" at C={c}" if self.batched else ""
            lines.append(
                f"{mode}{at}: AR reads {ar.step_bytes / 1e9:.2f} GB a step at "
                f"{ar.roofline_fraction:.0%} of the memory roofline; best {best.policy}"
                f"{'' if best.policy == 'ar' else f' N={best.budget_label}'}: {best.vs_ar:.2f}x AR "
                f"tokens/s (tau {best.summary['mean_tau']:.2f}, step "
                f"{best.summary['step_s_mean'] / ar.summary['step_s_mean']:.2f}x AR's), "
                f"chain {chain.vs_ar:.2f}x; the tau is the synthetic oracle's"
            )
        return lines

    def warnings(self) -> list[str]:
        """A step cannot read memory faster than the machine can: a roofline past 100% means
        the bandwidth figure came out low (measured while another job ran, or another
        machine's), and every roofline of this run with it."""
        over = [r for r in self.rows if r.roofline_fraction > 1]
        if not over:
            return []
        worst = max(r.roofline_fraction for r in over)
        return [
            f"warning: {len(over)} of {len(self.rows)} rows read faster than the bandwidth "
            f"(up to {worst:.0%} of {self.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
            f"{self.bandwidth_source}): that figure is too low, so the roofline column is not "
            "to be trusted; measure again on a quiet machine or give --bandwidth-records"
        ]

    def as_json(self) -> dict:
        return {
            "warnings": self.warnings(),
            "preset": self.preset.name,
            "dtype": self.dtype,
            "device": self.device,
            "threads": self.threads,
            "compile_scope": self.compile_scope,
            "drafter": self.oracle,
            "synthetic_drafter": True,
            "draft_vocab": self.draft_vocab,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "bandwidth_source": self.bandwidth_source,
            "rows": [
                {
                    "mode": r.mode,
                    "concurrency": r.concurrency,
                    "policy": r.policy,
                    "budget": r.budget,
                    "auto_budget": r.auto,
                    "width": r.width,
                    "mean_tau": r.summary["mean_tau"],
                    "tokens_per_s": r.summary["tokens_per_s"],
                    "vs_ar": r.vs_ar,
                    "identical_to_ar": r.identical_to_ar,
                    "step_s_mean": r.summary["step_s_mean"],
                    "stage_s_mean": {str(k): v for k, v in r.summary["stage_s_mean"].items()},
                    "step_bytes": r.step_bytes,
                    "bytes_parts": r.bytes_parts,
                    "roofline_fraction": r.roofline_fraction,
                }
                for r in self.rows
            ],
        }

    def records(self, points, target, oracle, prompts, extra: dict | None = None) -> list:
        """One engine_run record per row (the shape, dtype, synthetic drafter and roofline in
        its config, and ``extra``); the bench_bandwidth record is written when measured."""
        from ddtree.engine import engine_run_record

        records = []
        for p, r in zip(points, self.rows, strict=True):
            config = {
                "preset": self.preset.name,
                "shape": self.preset.target,
                "shape_source": self.preset.sources,
                "random_weights": True,
                "synthetic_drafter": oracle.info.name,
                "draft_vocab": self.draft_vocab,
                "compile_scope": self.compile_scope,
                "threads": self.threads,
                "step_bytes": r.step_bytes,
                "bytes_parts": r.bytes_parts,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "bandwidth_source": self.bandwidth_source,
                "roofline_fraction": r.roofline_fraction,
                "auto_budget": r.auto,
                **(extra or {}),
            }
            record = engine_run_record(
                p.results,
                p.config,
                target.info,
                None,
                oracle.info,
                None,
                self.device,
                [len(x) for x in prompts],
                config,
                compile_s=p.summary["compile_s"],
                concurrency=p.concurrency,
                summary=p.summary,
            )
            # the shape that ran (untied, as random targets are), for the estimator to cost
            record.target["config_json"] = {**self.preset.target, "tie_word_embeddings": False}
            records.append(record)
        return records
