"""The drafter's LM head alone at qwen3-1.7b's shape: [B-1 = 15, 2048] x [V or K, 2048]^T in
bfloat16 on this CPU, one thread, the full head (V = 151936) against K-row heads cut by
``ddtree.models.draft_vocab.head_rows``, with the kernel the engine picks (``onednn-packed``
where it runs, else ``aten``). Median of 20 after 3 warm-ups."""

import statistics
import time

import torch
from torch import nn

from ddtree.models.draft_vocab import head_rows
from ddtree.models.linear import PackedLinear, choose_linear_kernel

torch.set_num_threads(1)
V, H, ROWS = 151936, 2048, 15
kernel = choose_linear_kernel(torch.device("cpu"), torch.bfloat16)
full = nn.Linear(H, V, bias=False).to(torch.bfloat16).requires_grad_(False)
full = PackedLinear(full) if kernel == "onednn-packed" else full
x = torch.randn(1, ROWS, H, dtype=torch.bfloat16)
print(f"kernel {kernel}, x [1, {ROWS}, {H}] bfloat16, 1 thread")
base = None
with torch.inference_mode():
    for k in (V, 32768, 8192, 2048):
        head = full if k == V else head_rows(full, torch.arange(k))
        for _ in range(3):
            head(x)
        times = []
        for _ in range(20):
            t = time.perf_counter()
            head(x)
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        base = base or ms
        print(f"K = {k:6d}: {ms:7.2f} ms  ({ms / base:.3f} of the full head; {k * H * 2 / 1e6:.0f} MB of weights)")
