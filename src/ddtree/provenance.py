"""Who and where: the ``hardware`` and ``provenance`` sections of a record, collected for this
process (the schema they fill is ``ddtree.records``)."""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from ddtree.records import HardwareInfo, Provenance


def this_hardware() -> HardwareInfo:
    """Describe this machine (torch and CUDA only if torch is already importable)."""
    torch_version = gpu_name = None
    gpu_count = 0
    try:
        import torch

        torch_version = torch.__version__
        if torch.cuda.is_available():
            gpu_count = torch.cuda.device_count()
            gpu_name = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return HardwareInfo(
        cpu_model=_cpu_model(),
        cpu_cores=os.cpu_count() or 1,
        torch_version=torch_version,
        gpu_name=gpu_name,
        gpu_count=gpu_count,
        hostname=platform.node(),
    )


def this_process(producer: str) -> Provenance:
    """This process as ``producer``: ``sys.argv``, the installed ddtree version, the
    checkout's commit."""
    return Provenance(producer, " ".join(redact_argv(sys.argv)), _version(), _git_commit())


REDACTED = "***"
# words of a flag's name that mark its value as a secret: --api-key, --hf-token, --secret ...
# (whole words, so --max-new-tokens is no secret)
_SECRET_WORDS = re.compile(r"(?:^|[-_])(?:key|apikey|token|secret|password|passwd)(?:$|[-_])")


def is_secret_flag(flag: str) -> bool:
    """Whether ``--flag``'s value is a secret to keep out of records and logs."""
    return flag.startswith("-") and bool(_SECRET_WORDS.search(flag.lstrip("-").lower()))


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the value of every secret flag (``--api-key KEY``, ``--api-key=KEY``,
    ``--hf-token T``) replaced by ``***``: records are made to be shared."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif arg.startswith("--") and "=" in arg and is_secret_flag(arg.split("=", 1)[0]):
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
        else:
            out.append(arg)
            hide_next = arg != "--" and is_secret_flag(arg)
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddtree")
    except PackageNotFoundError:
        return ""


@functools.cache
def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None
