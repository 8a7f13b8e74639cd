"""Issue 29's serve goal, measured: `ddtree serve --max-batch 4` (with the extra flags given on
the command line, e.g. `--budget auto`) against the one-at-a-time server, alternated 1, 4, 1, 4
on the bundled pair. Per server: a lone request's latency (fastest of 3), then 4 concurrent
requests through the real `openai` client (64 greedy tokens each, EOS ignored): their mean
latency and the aggregate tokens/s (best of 3). Every text must equal the one-at-a-time
server's. Run: `OMP_NUM_THREADS=1 python scripts/serve_batch_goal.py --budget auto`."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import openai

env = {**os.environ, "OMP_NUM_THREADS": "1"}
EXTRA = tuple(sys.argv[1:])
PROMPTS = ["def fibonacci(n):", "import os\n", "class Tree:", "for i in range(10):"]
N = 64


def server(batch, extra=()):
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddtree",
            "serve",
            "--port",
            "0",
            "--threads",
            "1",
            "--max-batch",
            str(batch),
            "--max-new-tokens",
            str(N),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    url = re.search(r"(http://\S+/v1)", p.stdout.readline()).group(1)
    return p, openai.OpenAI(base_url=url, api_key="x", max_retries=0)


def ask(client, prompt, out, i):
    t0 = time.perf_counter()
    r = client.completions.create(
        model="ddtree-demo",
        prompt=prompt,
        max_tokens=N,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    out[i] = (time.perf_counter() - t0, r.usage.completion_tokens, r.choices[0].text)


def measure(batch, rounds=3):
    p, client = server(batch, EXTRA if batch > 1 else ())
    lone, conc = [], []
    for _ in range(rounds):
        out = {}
        ask(client, PROMPTS[0], out, 0)
        lone.append(out[0][0])
        out = {}
        t0 = time.perf_counter()
        ths = [threading.Thread(target=ask, args=(client, PROMPTS[i], out, i)) for i in range(4)]
        [t.start() for t in ths]
        [t.join() for t in ths]
        wall = time.perf_counter() - t0
        conc.append((sum(v[0] for v in out.values()) / 4, sum(v[1] for v in out.values()) / wall))
        texts = {i: out[i][2] for i in out}
    p.terminate()
    p.wait()
    lone_s = min(lone)
    lat = min(c[0] for c in conc)
    agg = max(c[1] for c in conc)
    return lone_s, lat, agg, texts


res = {}
for batch in (1, 4, 1, 4):
    lone_s, lat, agg, texts = measure(batch)
    res.setdefault(batch, []).append((lone_s, lat, agg))
    print(
        f"max-batch {batch}: lone {lone_s * 1e3:.0f} ms, mean latency of 4 concurrent {lat * 1e3:.0f} ms ({lat / lone_s:.2f}x lone), aggregate {agg:.0f} tok/s",
        flush=True,
    )
    res.setdefault(f"texts{batch}", texts)
print("texts equal:", res["texts1"] == res["texts4"])
a1 = max(x[2] for x in res[1])
a4 = max(x[2] for x in res[4])
print(
    json.dumps(
        {"aggregate_ratio": a4 / a1, "latency_ratio_batch4": min(x[1] / x[0] for x in res[4])}
    )
)
