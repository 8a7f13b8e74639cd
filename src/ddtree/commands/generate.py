"""`ddtree generate`: stream a completion from a local target (and drafter)."""

from __future__ import annotations

import argparse
import sys

from ddtree.commands._args import output_file
from ddtree.commands._decode import (
    add_decode_arguments,
    add_model_arguments,
    check_engine_modes,
    decode_config,
    load_models,
)
from ddtree.records import EngineMode


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, default_demo=True)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--policy", default="ddtree", choices=("ar", "chain", "ddtree"))
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print tau and tokens/s to stderr")
    p.add_argument(
        "--records",
        type=output_file,
        help="append an engine_run measurement record to this JSONL file",
    )
    p.add_argument(
        "--engine-mode",
        default="eager",
        choices=[m.value for m in EngineMode],
        help="eager, or compiled (torch.compile at static shapes: compiles first, then faster "
        "steps; MLA+MoE targets) (default: %(default)s)",
    )
    add_decode_arguments(p, max_new_tokens=128)


def run(args: argparse.Namespace) -> int:
    from ddtree.engine import generate
    from ddtree.engine.stop import IncrementalText

    config = decode_config(
        args, args.policy, stop_strings=tuple(args.stop), engine_mode=args.engine_mode
    )
    models = load_models(args, need_drafter=args.policy != "ar", default_demo=True)
    check_engine_modes(models, [args.engine_mode])
    codec = models.codec
    prompt_ids = codec.encode(args.prompt)
    # print what each step adds, decoded incrementally after the prompt's tokens, so pieces
    # that merge across the boundary (spaces, multi-byte characters) come out right
    text = IncrementalText(codec)
    for token in prompt_ids:
        text.push(token)

    def stream(new_tokens: list[int]) -> None:  # the step's tokens, after any stop
        sys.stdout.write("".join(text.push(t) for t in new_tokens))
        sys.stdout.flush()

    sys.stdout.write(args.prompt)
    result = generate(models.target, models.drafter, prompt_ids, config, codec, on_commit=stream)
    sys.stdout.write("\n")
    if args.records and result.steps:
        from ddtree.engine import engine_run_record
        from ddtree.records import write_records

        drafter = models.drafter if args.policy != "ar" else None
        record = engine_run_record(
            [result],
            config,
            models.target.info,
            models.target_path,
            None if drafter is None else drafter.info,
            models.drafter_path,
            device=args.device,
            prompt_lens=[len(prompt_ids)],
        )
        write_records(args.records, [record])
    if args.stats:
        steps = len(result.steps)
        tok_s = sum(result.taus) / result.decode_s if result.decode_s else 0.0
        compiled = f", compile {result.compile_s:.1f} s" if args.engine_mode != "eager" else ""
        print(
            f"[{args.policy}, {args.engine_mode}] {len(result.tokens)} tokens, {steps} steps, "
            f"mean tau {result.mean_tau:.2f}, {tok_s:.1f} tok/s, stop: {result.stop_reason}"
            f"{compiled}",
            file=sys.stderr,
        )
    return 0
