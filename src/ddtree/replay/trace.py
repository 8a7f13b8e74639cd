"""Traces: one recorded greedy pass, replayable for any budget.

A trace holds, per prompt, the target's greedy continuation and, at every root position p of
that continuation (the committed token a decode step would start from), the drafter's top-K
log-probs and token ids at its ``B - 1`` block positions given the committed prefix ``0..p-1``.

File format: one safetensors file (no pickle) with three tensors, prompts concatenated, and a
JSON header in the safetensors metadata (key ``ddtree_trace``, :class:`TraceHeader`)::

    tokens         [S] int64           prompt + greedy continuation, prompt after prompt
    topk_logprobs  [R, B-1, K] float32 sorted descending per row (log_softmax, fp32)
    topk_tokens    [R, B-1, K] int32

Prompt i has ``prompt_tokens`` T_i and ``new_tokens`` n_i (EOS included when it stopped
there); its roots are the positions ``T_i .. T_i + n_i - 2`` (the first new token comes from the
prefill; the root at ``T_i + n_i - 2`` drafts the last one), so ``R = sum(n_i - 1)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

FORMAT = "ddtree-trace"
FORMAT_VERSION = 1
HEADER_KEY = "ddtree_trace"
TENSORS = ("tokens", "topk_logprobs", "topk_tokens")
# Files above this are fingerprinted from their size and evenly spaced samples, not read whole.
FULL_HASH_BYTES = 1 << 30
SAMPLE_BYTES, SAMPLES = 1 << 20, 64


class TraceError(ValueError):
    """A trace file that cannot be used as asked; the message names the file and field."""


@dataclass
class ModelStamp:
    """Who produced a trace: identity and a content fingerprint of the checkpoint folder."""

    name: str
    architecture: str
    n_params: int
    vocab_size: int
    dtype: str
    fingerprint: str  # "sha256:<16 hex>" of config.json + weights, or "" when unknown


@dataclass
class PromptInfo:
    prompt_tokens: int  # T
    new_tokens: int  # n, the greedy continuation's length (>= 1)
    stop_reason: str  # "max_new_tokens" | "eos"
    text: str = ""
    greedy_s: float = 0.0  # measured: the target's greedy pass (prefill + one verify per token)
    draft_s: float = 0.0  # measured: drafting every root and the top-K

    @property
    def roots(self) -> int:
        return self.new_tokens - 1


@dataclass
class TraceHeader:
    target: ModelStamp
    drafter: ModelStamp
    block_size: int  # B
    top_k: int  # K stored per depth
    max_new_tokens: int
    eos_token_ids: list[int]
    prompts: list[PromptInfo]
    device: str = "cpu"
    content_sha256: str = ""  # of the three tensors' bytes, set when saved
    ddtree_version: str = ""
    format: str = FORMAT
    version: int = FORMAT_VERSION

    @property
    def fingerprint(self) -> str:
        """Short id of the trace's content, for records and ``--explain``."""
        return f"trace:{self.content_sha256[:16]}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str, where: str) -> TraceHeader:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise TraceError(f"{where}: not a ddtree trace (format {data.get('format')!r})")
            if data.get("version") != FORMAT_VERSION:
                raise TraceError(
                    f"{where}: trace format version {data.get('version')!r}, this ddtree reads "
                    f"{FORMAT_VERSION}"
                )
            data["target"] = ModelStamp(**data["target"])
            data["drafter"] = ModelStamp(**data["drafter"])
            data["prompts"] = [PromptInfo(**p) for p in data["prompts"]]
            return TraceHeader(**data)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise TraceError(f"{where}: malformed trace header ({exc})") from None


@dataclass
class Trace:
    header: TraceHeader
    tokens: torch.Tensor  # [S] int64
    topk_logprobs: torch.Tensor  # [R, B-1, K] float32
    topk_tokens: torch.Tensor  # [R, B-1, K] int64 in memory (int32 on disk)
    path: str = ""
    # per prompt: offset of its first token in ``tokens`` and of its first root row
    token_offsets: list[int] = field(default_factory=list)
    root_offsets: list[int] = field(default_factory=list)
    _greedy_ranks: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.token_offsets, self.root_offsets = [], []
        tok = root = 0
        for p in self.header.prompts:
            self.token_offsets.append(tok)
            self.root_offsets.append(root)
            tok += p.prompt_tokens + p.new_tokens
            root += p.roots
        where = self.path or "trace"
        depth = self.header.block_size - 1
        want = {
            "tokens": (tok,),
            "topk_logprobs": (root, depth, self.header.top_k),
            "topk_tokens": (root, depth, self.header.top_k),
        }
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise TraceError(
                    f"{where}: tensor {name} has shape {got}, the header implies {shape}"
                )

    @property
    def fingerprint(self) -> str:
        return self.header.fingerprint

    def sequence(self, i: int) -> torch.Tensor:
        """Prompt i's tokens followed by its greedy continuation: [T_i + n_i] int64."""
        p = self.header.prompts[i]
        start = self.token_offsets[i]
        return self.tokens[start : start + p.prompt_tokens + p.new_tokens]

    def roots(self, i: int) -> slice:
        """Rows of prompt i in ``topk_logprobs`` / ``topk_tokens`` (root j at position T_i + j)."""
        start = self.root_offsets[i]
        return slice(start, start + self.header.prompts[i].roots)

    def greedy_ranks(self) -> np.ndarray:
        """[R, B-1] int64, computed once: at root row r of prompt i (position T_i + j), the rank
        of the greedy token at position T_i + j + d + 1 in the stored list for depth d + 1;
        -1 when it is outside the top-K or past the end of the continuation."""
        if self._greedy_ranks is None:
            depth = self.header.block_size - 1
            out = []
            for i, info in enumerate(self.header.prompts):
                padded = torch.cat([self.sequence(i), torch.full((depth,), -1)])
                after = info.prompt_tokens + 1 + torch.arange(info.roots)[:, None]
                want = padded[after + torch.arange(depth)]  # [n-1, L]
                hit = self.topk_tokens[self.roots(i)] == want[..., None]  # [n-1, L, K]
                out.append(torch.where(hit.any(-1), hit.byte().argmax(-1), -1))
            self._greedy_ranks = torch.cat(out).numpy() if out else np.zeros((0, depth), int)
        return self._greedy_ranks


def merge_traces(traces: list[Trace]) -> Trace:
    """One trace of the prompts of ``traces``, in order (each recorded by the same models with
    the same settings: the headers agree but for their prompts)."""
    if not traces:
        raise TraceError("no traces to merge")
    first = traces[0].header

    def settings(h: TraceHeader) -> dict:
        d = dataclasses.asdict(h)
        for name in ("prompts", "content_sha256", "ddtree_version"):
            d.pop(name)
        return d

    for i, t in enumerate(traces[1:], 1):
        if settings(t.header) != settings(first):
            raise TraceError(f"trace {i} was recorded with other models or settings than trace 0")
    header = dataclasses.replace(
        first, prompts=[p for t in traces for p in t.header.prompts], content_sha256=""
    )
    return Trace(
        header,
        torch.cat([t.tokens for t in traces]),
        torch.cat([t.topk_logprobs for t in traces]),
        torch.cat([t.topk_tokens for t in traces]),
    )


def _content_sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in TENSORS:
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


TRACE_FILE = "a trace file (.safetensors) or a new file's path"


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    """Write ``trace`` to ``path`` atomically (``ddtree.files.replace_atomically``: a
    temporary file in the same folder, then a rename): an interrupted or failed save leaves
    no half-written trace under the final name and the old file, if any, as it was."""
    from ddtree import __version__
    from ddtree.files import replace_atomically, write_safetensors

    path = Path(path)
    tensors = {
        "tokens": trace.tokens.to(torch.int64).contiguous(),
        "topk_logprobs": trace.topk_logprobs.to(torch.float32).contiguous(),
        "topk_tokens": trace.topk_tokens.to(torch.int32).contiguous(),
    }
    trace.header.content_sha256 = _content_sha256(tensors)
    trace.header.ddtree_version = __version__
    with replace_atomically(path, TRACE_FILE) as partial:
        write_safetensors(tensors, partial, metadata={HEADER_KEY: trace.header.to_json()})
    return path


def load_trace(path: str | os.PathLike, verify: bool = True) -> Trace:
    """Read a trace written by :func:`save_trace`; ``verify`` checks its content hash."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file (write one with `ddtree replay record`)")
    try:
        with safe_open(str(path), "pt") as fh:
            metadata = fh.metadata() or {}
            names = set(fh.keys())
            missing = [n for n in TENSORS if n not in names]
            if HEADER_KEY not in metadata:
                raise TraceError(f"{path}: a safetensors file without a ddtree trace header")
            if missing:
                raise TraceError(f"{path}: missing tensor(s) {', '.join(missing)}")
            tensors = {n: fh.get_tensor(n) for n in TENSORS}
    except SafetensorError as exc:
        raise TraceError(f"{path}: not a readable safetensors file ({exc})") from None
    header = TraceHeader.from_json(metadata[HEADER_KEY], str(path))
    if verify and _content_sha256(tensors) != header.content_sha256:
        raise TraceError(f"{path}: content hash differs from the header's: the file is damaged")
    return Trace(
        header=header,
        tokens=tensors["tokens"],
        topk_logprobs=tensors["topk_logprobs"],
        topk_tokens=tensors["topk_tokens"].to(torch.int64),
        path=str(path),
    )


def folder_fingerprint(path: str | os.PathLike | None) -> str:
    """``sha256:<16 hex>`` of a checkpoint folder's ``config.json`` and ``*.safetensors``
    files (names and bytes; files over 1 GiB by size and 64 evenly spaced 1 MiB samples).
    ``""`` when there is no folder (a model built in memory)."""
    if path is None:
        return ""
    path = Path(path)
    files = [path / "config.json", *sorted(path.glob("*.safetensors"))]
    digest = hashlib.sha256()
    for file in files:
        if not file.is_file():
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as fh:
            if size <= FULL_HASH_BYTES:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    digest.update(block)
            else:
                for i in range(SAMPLES):
                    fh.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                    digest.update(fh.read(SAMPLE_BYTES))
    return f"sha256:{digest.hexdigest()[:16]}"


def model_stamp(info, path: str | os.PathLike | None) -> ModelStamp:
    """A :class:`ModelStamp` from a model's ``ModelInfo`` and its checkpoint folder."""
    return ModelStamp(
        name=info.name,
        architecture=info.architecture,
        n_params=int(info.n_params),
        vocab_size=int(info.vocab_size),
        dtype=info.dtype,
        fingerprint=folder_fingerprint(path),
    )


def check_folders(header: TraceHeader, where: str, target=None, drafter=None) -> None:
    """Raise :class:`TraceError` unless the trace was recorded from these checkpoint folders
    (``target``/``drafter``: paths or None to skip), by :func:`folder_fingerprint`."""
    for role, stamp, folder in (
        ("target", header.target, target),
        ("drafter", header.drafter, drafter),
    ):
        if folder is None:
            continue
        if not stamp.fingerprint:
            raise TraceError(
                f"{where}: its {role} was built in memory (no fingerprint); cannot check {folder}"
            )
        given = folder_fingerprint(folder)
        if given != stamp.fingerprint:
            raise TraceError(
                f"{where}: recorded with a different {role}: fingerprint {stamp.fingerprint} "
                f"({stamp.name}), {folder} has {given}"
            )
