"""How much memory this process can still allocate on a device: what a command checks a
model, a cache or a benchmark's buffers against before allocating them."""

from __future__ import annotations

from pathlib import Path

import torch


def available_bytes(device: torch.device | str) -> int | None:
    """Bytes this process can still allocate on ``device``: CUDA's free memory, the CPU's
    ``MemAvailable``; None when the machine does not say (no /proc/meminfo)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
