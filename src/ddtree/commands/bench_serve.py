"""`ddtree bench serve`: load a ddtree server; requests/s, latencies, and the HTTP layer's
overhead per token against the same requests decoded in this process.

Each repeat runs two passes over the same requests, in turns so that load drift on a shared
machine hits both alike: ``in-process`` (``generate`` on this process's copy of the models,
one request after another: encode, decode, text) and ``HTTP`` (streamed requests to the
server, ``--concurrency`` in flight). Then, with K the completion tokens of a pass,

    overhead per token = (HTTP makespan - in-process makespan) / K      (derived)

reported as a share of the in-process step time (the goal: < 5% on the bundled pair, eager)
and of the in-process time per token (= HTTP makespan / in-process makespan - 1, stricter
by a factor tau). Requests ignore EOS, so both passes decode exactly ``--max-new-tokens``
tokens per request; with greedy decoding they also take the same steps (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ddtree.commands._args import add_json_argument, chosen_threads, positive_int, threads_label
from ddtree.commands._decode import (
    add_decode_arguments,
    add_model_arguments,
    add_policy_arguments,
    decode_config,
    demo_prompts,
    load_models,
    set_threads,
)

PAIR_PERCENTILES = (10, 50, 90)  # the spread of the per-pair overheads that is printed


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_policy_arguments(p)
    add_decode_arguments(p, max_new_tokens=128)
    p.add_argument(
        "--url",
        help="a running ddtree serve, http://HOST:PORT, with the same models and options "
        "(default: start one here with this command's model and decode options)",
    )
    p.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY"), help="for --url's server")
    p.add_argument(
        "--requests",
        type=positive_int,
        default=1,
        help="requests per pass: short passes in turns keep load drift out of the comparison "
        "(default: %(default)s)",
    )
    p.add_argument("--concurrency", type=positive_int, default=1, help="requests in flight")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=32,
        help="in-process + HTTP pass pairs, each over the next --requests prompts "
        "(default: %(default)s)",
    )
    p.add_argument("--prompts", type=Path, help="JSON list of prompts, cycled (default: demo's)")
    p.add_argument(
        "--flood",
        action="store_true",
        help="instead: a decoding request's step time idle and under a flood of prompts too "
        "long for the context (refused), in turns (goal: within 1.5x of idle)",
    )
    p.add_argument(
        "--flood-clients", type=positive_int, default=2, help="with --flood: flooding clients"
    )
    p.add_argument(
        "--flood-bytes",
        type=positive_int,
        default=100_000,
        help="with --flood: characters per flooding prompt (default: %(default)s)",
    )
    add_json_argument(p)


@dataclass
class DirectPass:
    results: list  # GenerationResult per request
    makespan_s: float

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def steps(self) -> int:
        return sum(len(r.steps) for r in self.results)

    @property
    def step_s_mean(self) -> float:
        return sum(r.decode_s for r in self.results) / self.steps

    @property
    def tokens_per_s(self) -> float:
        return sum(sum(r.taus) for r in self.results) / sum(r.decode_s for r in self.results)


def _direct_pass(models, prompts: list[str], configs: list) -> DirectPass:
    from ddtree.engine import generate

    results = []
    t0 = time.perf_counter()
    for prompt, config in zip(prompts, configs, strict=True):
        ids = models.codec.encode(prompt)  # as the server does, inside the timed pass
        results.append(generate(models.target, models.drafter, ids, config, models.codec))
    return DirectPass(results, time.perf_counter() - t0)


@contextmanager
def _server(args, prefix: str):
    """The server under load: ``--url``'s (nothing started), or a ``ddtree serve`` started
    here, its log in a temporary folder that lives while it runs (a start that fails quotes
    it in the error). Yields (its base URL, the API key to send, the served model's id)."""
    from ddtree.serve.loadgen import server_process

    with ExitStack() as stack:
        server = None
        if not args.url:
            print("starting ddtree serve ...", file=sys.stderr, flush=True)
            logs = stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix))
            server = stack.enter_context(
                server_process(_server_args(args), Path(logs) / "serve.log")
            )
        base_url = _base_url(args, server)
        api_key = args.api_key if args.url else None
        yield base_url, api_key, _model_id(base_url, api_key)


def _base_url(args, server) -> str:
    return f"{args.url.rstrip('/')}/v1" if args.url else server.base_url


def _server_args(args: argparse.Namespace) -> list[str]:
    """This command's model and decode options, for the ``ddtree serve`` it starts."""
    out = ["--impl", args.impl, "--dtype", args.dtype, "--device", args.device]
    out += ["--threads", str(chosen_threads(args.threads)), "--tp", str(args.tp)]
    out += ["--ep", str(args.ep)]
    out += ["--policy", args.policy, "--engine-mode", args.engine_mode]
    out += ["--block", str(args.block), "--budget", str(args.budget)]
    out += ["--max-queue", str(args.concurrency), "--model-name", "bench"]
    if args.buckets:
        out += ["--buckets", ",".join(map(str, args.buckets))]
    for name in ("target", "drafter"):
        if getattr(args, name):
            out += [f"--{name}", str(Path(getattr(args, name)).resolve())]
    return out


def _model_id(base_url: str, api_key: str | None) -> str:
    """The served model's id (GET /v1/models), or a one-line error naming the URL."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base_url}/models", headers=headers)
        if r.status_code == 200:
            return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"--url: {base_url}/models: not a ddtree server here ({e})") from None
    raise ValueError(f"--url: GET {base_url}/models answered {r.status_code}: {r.text[:200]}")


def _overhead(direct: DirectPass, http) -> dict:
    """The HTTP layer's overhead per token of one pair of passes over the same requests."""
    overhead_s = (http.makespan_s - direct.makespan_s) / http.tokens
    return {
        "overhead_per_token_s": overhead_s,
        "share_of_step": overhead_s / direct.step_s_mean,
        "share_of_token_time": overhead_s / (direct.makespan_s / direct.tokens),
    }


def _ms(p: dict) -> str:
    return "/".join(f"{p[k] * 1e3:.1f}" for k in ("p50", "p90", "p99"))


def run(args: argparse.Namespace) -> int:
    from ddtree.extras import require_extra

    require_extra("serve", "ddtree bench serve")
    if args.flood:
        return _flood_run(args)
    prompts, configs = _requests(args)
    if args.url:  # a wrong URL fails now, before the models load
        _model_id(_base_url(args, None), args.api_key)
    threads = set_threads(args)
    print(
        f"loading the models for the in-process passes ({threads_label(args)}) ...",
        file=sys.stderr,
        flush=True,
    )
    need_drafter = configs[0].rules.needs_drafter
    models = load_models(
        args, need_drafter, engine_modes=(args.engine_mode,), draft_vocab=args.draft_vocab
    )
    _direct_pass(models, prompts[:1], configs[:1])  # warm-up (compiles in compiled mode)
    with _server(args, "ddtree-bench-serve-") as (base_url, api_key, model):
        bodies = _bodies(args, model, prompts, configs)
        directs, passes = _passes(args, models, prompts, configs, bodies, base_url, api_key)
    _report(args, directs, passes, threads)
    return 0


def _requests(args: argparse.Namespace) -> tuple[list[str], list]:
    """Each request's prompt and decode config: repeat r sends requests r*n .. r*n+n-1
    (n: --requests), cycling over the prompts, each with its own seed."""
    every = demo_prompts(args.prompts)
    prompts = [every[i % len(every)] for i in range(args.requests * args.repeats)]
    config = decode_config(args, args.policy, engine_mode=args.engine_mode, eos_token_ids=())
    return prompts, [replace(config, seed=args.seed + i) for i in range(len(prompts))]


def _bodies(args: argparse.Namespace, model: str, prompts: list[str], configs: list) -> list:
    """The completion requests' bodies: the in-process passes' prompts, seeds and sampling,
    ignoring EOS."""
    body = {"max_tokens": args.max_new_tokens, "temperature": args.temperature, "ignore_eos": True}
    body |= {"top_p": args.top_p, "top_k": args.top_k}
    return [
        {**body, "model": model, "prompt": p, "seed": c.seed}
        for p, c in zip(prompts, configs, strict=True)
    ]


def _passes(args, models, prompts, configs, bodies, base_url, api_key) -> tuple[list, list]:
    """Each repeat's in-process pass, then its HTTP pass over the same requests (after one
    warm-up request): their DirectPasses and HttpPasses. A failed request is a ValueError."""
    from ddtree.serve.loadgen import LoadClient

    n = args.requests
    directs, passes = [], []
    with LoadClient(base_url, args.concurrency, api_key) as client:
        client.run(bodies[:1])  # warm-up: the connection, the first request
        for r in range(args.repeats):
            turn = slice(r * n, (r + 1) * n)
            directs.append(_direct_pass(models, prompts[turn], configs[turn]))
            passes.append(client.run(bodies[turn]))
            errors = [t.error for t in passes[-1].requests if t.error]
            if errors:
                raise ValueError(f"{len(errors)} of {n} requests failed: {errors[0]}")
            print(
                f"repeat {r + 1}/{args.repeats}: in-process {directs[-1].makespan_s:.2f} s, "
                f"HTTP {passes[-1].makespan_s:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    return directs, passes


def _report(args: argparse.Namespace, directs: list, passes: list, threads: int) -> None:
    from ddtree.provenance import this_hardware
    from ddtree.serve.loadgen import HttpPass, percentiles

    requests = [t for h in passes for t in h.requests]
    http = HttpPass(requests, sum(h.makespan_s for h in passes), args.concurrency)
    direct = DirectPass([r for d in directs for r in d.results], sum(d.makespan_s for d in directs))
    s = http.summary()
    pooled = _overhead(direct, http)
    pairs = [_overhead(d, h) for d, h in zip(directs, passes, strict=True)]
    spread = {k: percentiles([p[k] for p in pairs], PAIR_PERCENTILES) for k in pooled}
    same_steps = [t.engine.get("steps") for t in http.requests] == [
        len(r.steps) for r in direct.results
    ]
    load = os.getloadavg()[0]
    if args.json:
        print(
            json.dumps(
                {
                    "bench": "serve",
                    "hardware": this_hardware().label,
                    "load_average_1min": load,
                    "device": args.device,
                    "dtype": args.dtype,
                    "threads": threads,
                    "policy": args.policy,
                    "block_size": args.block,
                    "budget": args.budget,
                    "engine_mode": args.engine_mode,
                    "requests_per_pass": args.requests,
                    "repeats": args.repeats,
                    "max_tokens": args.max_new_tokens,
                    "concurrency": args.concurrency,
                    "warm_up": "one request per path before the repeats",
                    "http": s,
                    "in_process": {
                        "makespan_s": direct.makespan_s,
                        "engine_tokens_per_s": direct.tokens_per_s,
                        "step_s_mean": direct.step_s_mean,
                    },
                    "same_steps": same_steps,
                    "overhead_pooled": pooled,
                    "overhead_pairs": spread,
                }
            )
        )
        return
    print(
        f"ddtree bench serve: {args.repeats} x {args.requests} requests x {args.max_new_tokens} "
        f"tokens, concurrency {args.concurrency}, {args.policy} B={args.block} N={args.budget}, "
        f"{args.engine_mode}, {threads_label(args)}; load average {load:.2f}"
    )
    print(
        f"HTTP: {s['requests_per_s']:.2f} req/s, {s['tokens_per_s']:.0f} tok/s; TTFT "
        f"p50/p90/p99 {_ms(s['ttft_s'])} ms; inter-chunk (one step) {_ms(s['inter_chunk_s'])} "
        f"ms; TPOT {_ms(s['tpot_s'])} ms"
    )
    print(
        f"engine tok/s: {s['server_engine_tokens_per_s']:.0f} in the server (step "
        f"{s['server_step_s_mean'] * 1e3:.2f} ms, tau {s['server_mean_tau']:.2f}), "
        f"{direct.tokens_per_s:.0f} in-process (step {direct.step_s_mean * 1e3:.2f} ms)"
        + ("" if same_steps else "; the steps differ: does the server run other models?")
    )
    step, token = spread["share_of_step"], spread["share_of_token_time"]
    print(
        "HTTP overhead per token, derived: (HTTP makespan - in-process makespan) / tokens, "
        f"per pair of passes: median {spread['overhead_per_token_s']['p50'] * 1e6:.0f} us = "
        f"{step['p50']:.1%} of the step time (goal < 5%; pairs p10..p90 "
        f"{step['p10']:.1%}..{step['p90']:.1%}), {token['p50']:.1%} of the time per token; "
        "over all pairs "
        f"{pooled['share_of_step']:.1%} of the step time"
    )


def _flood_run(args: argparse.Namespace) -> int:
    """``--flood``: the step time of a decoding request with no other client (idle) and
    while ``--flood-clients`` clients post prompts of ``--flood-bytes`` characters that the
    server must refuse (too long for the context), in turns within one run, so load drift
    hits both alike. The server's own step time (its ``ddtree`` extension) is compared."""
    import statistics
    import threading

    import httpx

    log = sys.stderr
    prompt = demo_prompts(args.prompts)[0]
    with _server(args, "ddtree-bench-flood-") as (base_url, api_key, model):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_new_tokens,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        # encoded once: the flooding clients' own CPU is not what is measured
        big = json.dumps({"model": model, "prompt": "x" * args.flood_bytes, "max_tokens": 1})
        big_headers = {**headers, "Content-Type": "application/json"}
        flooding, stop = threading.Event(), threading.Event()
        statuses: dict[int, int] = {}

        def flood() -> None:
            with httpx.Client(base_url=base_url, headers=headers, timeout=60) as c:
                while not stop.is_set():
                    if not flooding.wait(0.05):
                        continue
                    try:
                        code = c.post("/completions", content=big, headers=big_headers).status_code
                    except httpx.HTTPError:
                        code = 0
                    statuses[code] = statuses.get(code, 0) + 1

        clients = [threading.Thread(target=flood, daemon=True) for _ in range(args.flood_clients)]
        for t in clients:
            t.start()
        idle, flooded = [], []
        flood_s = 0.0
        try:
            with httpx.Client(base_url=base_url, headers=headers, timeout=600) as c:
                c.post("/completions", json=body).raise_for_status()  # warm-up
                for r in range(args.repeats):
                    for under_flood in (False, True):
                        if under_flood:
                            flooding.set()
                            time.sleep(0.2)  # the flood is on before the decode starts
                        t0 = time.perf_counter()
                        resp = c.post("/completions", json=body)
                        if under_flood:
                            flood_s += time.perf_counter() - t0 + 0.2
                            flooding.clear()
                        resp.raise_for_status()
                        step = resp.json()["ddtree"]["step_s_mean"]
                        (flooded if under_flood else idle).append(step)
                    print(f"repeat {r + 1}/{args.repeats}: step idle {idle[-1] * 1e3:.2f} ms, "
                          f"under flood {flooded[-1] * 1e3:.2f} ms", file=log, flush=True)  # fmt: skip
        finally:
            stop.set()
            flooding.set()
            for t in clients:
                t.join(70)
    idle_ms, flood_ms = statistics.median(idle) * 1e3, statistics.median(flooded) * 1e3
    rejected = sum(n for code, n in statuses.items() if 400 <= code < 500)
    out = {
        "bench": "serve --flood",
        "flood_clients": args.flood_clients,
        "flood_prompt_chars": args.flood_bytes,
        "repeats": args.repeats,
        "max_tokens": args.max_new_tokens,
        "step_ms_idle_median": idle_ms,
        "step_ms_flood_median": flood_ms,
        "ratio": flood_ms / idle_ms,
        "flood_statuses": {str(k): v for k, v in sorted(statuses.items())},
        "flood_requests_per_s": sum(statuses.values()) / flood_s if flood_s else 0.0,
        "load_average_1min": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"ddtree bench serve --flood: {args.repeats} x ({args.max_new_tokens}-token decode idle, "
        f"then under {args.flood_clients} clients posting {args.flood_bytes:,}-character "
        f"prompts); load average {out['load_average_1min']:.2f}"
    )
    print(
        f"step time median: idle {idle_ms:.2f} ms, under flood {flood_ms:.2f} ms: "
        f"{out['ratio']:.2f}x (goal <= 1.5x); flood: {sum(statuses.values())} requests "
        f"({out['flood_requests_per_s']:.0f}/s), {rejected} refused, statuses "
        f"{out['flood_statuses']}"
    )
    return 0
