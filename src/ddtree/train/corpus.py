"""The training corpus: the Python standard library's own ``*.py`` source, on every machine.

Files are listed in sorted order of their path relative to the stdlib root, skipping test
suites and ``site-packages``; every ``HELDOUT_EVERY``-th file of that list is held out for
evaluation prompts, so the split is by file (no held-out text leaks into training windows).
The list depends on the Python version; :func:`corpus_fingerprint` records which one ran.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
HELDOUT_EVERY = 20  # file i is held out when i % HELDOUT_EVERY == 0


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: tuple[Path, ...]
    heldout: tuple[Path, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus(root: Path | None = None, max_files: int | None = None) -> CorpusSplit:
    """Sorted ``*.py`` files under ``root`` (default: the stdlib), split by file.
    ``max_files`` keeps the first files of the sorted list (tests use a slice)."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    files = sorted(
        (f for f in root.rglob("*.py") if not SKIP_DIRS & set(f.relative_to(root).parts[:-1])),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    if max_files is not None:
        files = files[:max_files]
    if len(files) < 2:
        raise ValueError(f"corpus root {root}: found {len(files)} .py files, need at least 2")
    heldout = tuple(f for i, f in enumerate(files) if i % HELDOUT_EVERY == 0)
    train = tuple(f for i, f in enumerate(files) if i % HELDOUT_EVERY != 0)
    return CorpusSplit(root=root, train=train, heldout=heldout)


def read_texts(files: tuple[Path, ...]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def corpus_fingerprint(split: CorpusSplit) -> dict:
    """Which corpus ran: Python version, file counts and a hash of the file list."""
    digest = hashlib.sha256()
    for f in split.train + split.heldout:
        digest.update(f.relative_to(split.root).as_posix().encode())
    return {
        "python": sys.version.split()[0],
        "n_train_files": len(split.train),
        "n_heldout_files": len(split.heldout),
        "file_list_sha256": digest.hexdigest()[:16],
    }


def encode_stream(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """All texts tokenised and joined with EOS between files: [N] int64."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def sample_windows(stream: torch.Tensor, batch: int, length: int, seed: int) -> torch.Tensor:
    """``batch`` random windows of ``length`` tokens from ``stream`` [N]: [batch, length].
    The same seed gives the same windows (resumed runs see the batches they would have)."""
    n = int(stream.shape[0])
    if n <= length:
        raise ValueError(f"token stream of {n} tokens is shorter than a window of {length}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def heldout_prompts(
    stream: torch.Tensor, n_prompts: int, length: int, seed: int, eos_id: int
) -> torch.Tensor:
    """Prompts of ``length`` tokens from ``stream`` [N] that contain no EOS (each lies inside
    one file): [n_prompts, length]. Deterministic in ``seed``."""
    n = int(stream.shape[0])
    if n <= length:
        raise ValueError(f"held-out stream of {n} tokens is shorter than a prompt of {length}")
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for _ in range(100 * n_prompts):
        if len(out) == n_prompts:
            break
        s = int(torch.randint(0, n - length, (1,), generator=gen))
        window = stream[s : s + length]
        if not bool((window == eos_id).any()):
            out.append(window)
    if len(out) < n_prompts:
        raise ValueError(f"held-out stream too short for {n_prompts} prompts of {length} tokens")
    return torch.stack(out)
