"""`ddtree serve`: an OpenAI-compatible HTTP server on the DDTree engine."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ddtree.commands._args import (
    int_in,
    non_negative_float,
    non_negative_int,
    positive_int,
    records_file,
    set_threads,
    threads_label,
)
from ddtree.commands._decode import (
    add_decode_arguments,
    add_model_arguments,
    add_policy_arguments,
    decode_config,
    load_models,
)

DEMO_MODEL_NAME = "ddtree-demo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_policy_arguments(p)
    add_decode_arguments(p, max_new_tokens=256)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--port",
        type=int_in(0, 65535, what="a port (0: any free one)"),
        default=8000,
        help="TCP port, 0 for any free one (the URL line says which) (default: %(default)s)",
    )
    p.add_argument(
        "--model-name",
        help=f"the model id clients send (default: {DEMO_MODEL_NAME} for the bundled pair, "
        "else the target folder's name)",
    )
    p.add_argument(
        "--max-batch",
        type=int_in(1, 256, what="requests decoded together"),
        default=1,
        help="requests decoded together (continuous batching: one target forward verifies "
        "every running request's tree; our targets only, not --impl hf) (default: %(default)s)",
    )
    p.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=64,
        help="requests that may wait behind the ones decoding; past it, 503 with Retry-After "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=1 << 20,
        help="largest request body; larger ones get 413 (default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("DDTREE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $DDTREE_API_KEY; "
        "unset: no key)",
    )
    p.add_argument(
        "--records",
        type=records_file,
        help="append one engine_run measurement record per finished request to this JSONL file",
    )
    p.add_argument("--access-log", action="store_true", help="log every request to stderr")
    p.add_argument(
        "--profile-stages",
        action="store_true",
        help="time every stage of a step (on CUDA: a synchronisation per stage); off, the "
        "metrics charge the whole step to 'other' (benchmarks always time the stages)",
    )
    p.set_defaults(_quick_exit=True)  # see ddtree.cli.main
    p.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=5.0,
        help="after SIGTERM/Ctrl-C, seconds the running request has to finish before it is "
        "cut (queued ones get 503 at once; a second signal stops at once) (default: %(default)s)",
    )


def check_api_key(key: str | None) -> None:
    """A key is printable ASCII without spaces (what every HTTP client can send in a header);
    the message never echoes it."""
    if key is None:
        return
    if not key.strip():
        raise ValueError("--api-key: expected a non-empty key (or leave it unset)")
    if not all("!" <= ch <= "~" for ch in key):
        raise ValueError(
            "--api-key (or $DDTREE_API_KEY): the key holds a space, a control or a non-ASCII "
            "character; expected printable ASCII (33..126), which every HTTP client can send"
        )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _model_name(args: argparse.Namespace) -> str:
    if args.model_name is not None:
        if not args.model_name.strip():
            raise ValueError("--model-name: expected a non-empty name")
        return args.model_name
    return Path(args.target).resolve().name if args.target else DEMO_MODEL_NAME


def run(args: argparse.Namespace) -> int:
    import sys

    from ddtree.extras import require_extra

    require_extra("serve", "ddtree serve")
    from ddtree.serve.app import ServeSettings
    from ddtree.serve.server import bind, serve

    check_api_key(args.api_key)
    if args.api_key is None and not is_loopback(args.host):
        print(
            f"warning: --host {args.host} listens beyond this machine and no --api-key is set "
            "($DDTREE_API_KEY unset): anyone who can reach the port can use the model",
            file=sys.stderr,
            flush=True,
        )
    defaults = decode_config(
        args, args.policy, engine_mode=args.engine_mode, profile_stages=args.profile_stages
    )
    settings = ServeSettings(
        model_name=_model_name(args),
        defaults=defaults,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key,
        seed=args.seed,
    )
    sock = bind(args.host, args.port)  # a port in use fails now, not after loading
    set_threads(args)
    print(f"loading the models ({threads_label(args)}) ...", file=sys.stderr, flush=True)
    need_drafter = settings.defaults.rules.needs_drafter
    models = load_models(
        args, need_drafter, engine_modes=(args.engine_mode,), draft_vocab=args.draft_vocab
    )
    serve(
        models, settings, sock, args.records, args.device, access_log=args.access_log,
        shutdown_timeout_s=args.shutdown_timeout, max_batch=args.max_batch,
    )  # fmt: skip
    return 0
