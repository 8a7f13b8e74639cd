"""A reduced draft vocabulary (``--draft-vocab K``): the drafter's LM head over the K most
frequent tokens of a corpus only, as EAGLE-3 and FR-Spec do.

The drafter's head is the step's largest matrix at real shapes (qwen3-1.7b: 151936 x 2048, as
many bytes as two of its drafter layers' MLPs): computing K of its V rows makes the draft
cheaper; its proposals (top-k per depth, the tree) are then drawn from those K tokens, mapped
back to vocabulary ids. The target still verifies over the full vocabulary, so greedy output
is unchanged and sampled output still follows the target (its acceptance never reads the
drafter's probabilities, ``ddtree.tree.accept``): only tau can drop, when the target's token
lies outside the K.

Which K: the ``token_counts`` of a corpus (``draft_vocab.json`` beside the drafter,
written by ``ddtree train drafter`` from its training text), the most frequent first, ties by
the smaller id, the EOS tokens always in. K >= V is the full vocabulary (nothing changes).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

FLAG = "--draft-vocab"
COUNTS_FILE = "draft_vocab.json"  # beside the drafter's config.json
COUNTS_FILE_LIMIT = 64 << 20  # bytes: a 1M-token vocabulary's counts fit many times over


class DraftVocabError(ValueError):
    """A draft vocabulary that cannot be built (names the flag or file and what was expected)."""


def check_draft_vocab(k) -> int:
    """K as given to ``--draft-vocab``: an integer >= 1, else a DraftVocabError naming the flag.
    Example: 512 -> 512; 0, -3, 2.5, "8" -> errors."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise DraftVocabError(f"{FLAG}: expected a token count >= 1, got {k!r}")
    return k


def token_counts(
    sequences: Iterable[Sequence[int] | torch.Tensor], vocab_size: int
) -> torch.Tensor:
    """How often each token id occurs over ``sequences`` of token ids: [V] int64.

    Example: ``[[3, 1, 3], [1, 3]]``, V = 5 -> ``[0, 2, 0, 3, 0]``. An id outside
    ``0..V-1`` is an error (the corpus was tokenized for another vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.int64).reshape(-1)  # [T]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise DraftVocabError(
                f"token ids {int(ids.min())}..{int(ids.max())} outside the vocabulary "
                f"0..{vocab_size - 1}"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def most_frequent(counts: torch.Tensor, k: int, always: Sequence[int] = ()) -> torch.Tensor | None:
    """The K ids of a draft vocabulary, ascending: [K] int64; None when K >= V (the full
    vocabulary). ``always`` (the EOS tokens) are in whatever their counts; the other K - |always|
    slots go to the most frequent ids, ties to the smaller id.

    Example: counts ``[0, 2, 0, 3, 0]`` (ids 0..4), always ``(0,)``: K = 2 -> ``[0, 3]``;
    K = 3 -> ``[0, 1, 3]``; K = 4 -> ``[0, 1, 2, 3]`` (ids 2 and 4 tie at 0: 2 is smaller);
    K = 5 -> None."""
    check_draft_vocab(k)
    assert counts.dim() == 1, counts.shape  # [V]
    vocab = int(counts.shape[0])
    if k >= vocab:
        return None
    always = sorted({int(t) for t in always})
    if any(not 0 <= t < vocab for t in always):
        raise DraftVocabError(f"{FLAG}: special token ids {always} outside 0..{vocab - 1}")
    if len(always) > k:
        raise DraftVocabError(
            f"{FLAG} {k}: fewer than the {len(always)} special tokens {always} it must hold"
        )
    # a stable sort of -counts keeps equal counts in id order: ties go to the smaller id
    order = torch.sort(-counts.to(torch.int64), stable=True).indices  # [V]
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[always] = True
    rest = order[~keep[order]][: k - len(always)]
    keep[rest] = True
    return keep.nonzero().view(-1)  # [K] ascending


def save_token_counts(folder: str | Path, counts: torch.Tensor, source: str) -> Path:
    """Write ``counts`` [V] int64 as ``folder/draft_vocab.json``: ``{"source": what corpus
    they count, "vocab_size": V, "token_counts": [V ints]}`` (JSON, not a second
    ``.safetensors`` beside the weights, which a loader would take for a shard). Returns it."""
    path = Path(folder) / COUNTS_FILE
    doc = {"source": source, "vocab_size": int(counts.shape[0]), "token_counts": counts.tolist()}
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
    return path


def load_token_counts(folder: str | Path, vocab_size: int) -> torch.Tensor:
    """``folder/draft_vocab.json``'s counts [V] int64, checked against ``vocab_size``; a
    DraftVocabError naming the file and field when it is absent or not what was expected."""
    from ddtree.files import read_input_bytes

    path = Path(folder) / COUNTS_FILE
    if not path.is_file():
        raise DraftVocabError(
            f"{FLAG}: {path} not found: the drafter has no token counts to choose its K tokens "
            "from (ddtree train drafter writes them; docs/usage.md, Draft vocabulary)"
        )
    try:
        doc = json.loads(read_input_bytes(path, "a regular JSON file", COUNTS_FILE_LIMIT))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftVocabError(f"{FLAG}: {path}: not a readable JSON file ({e})") from None
    counts = doc.get("token_counts") if isinstance(doc, dict) else None
    if not (
        isinstance(counts, list)
        and len(counts) == vocab_size
        and all(type(n) is int and n >= 0 for n in counts)
    ):
        got = f"{len(counts)} entries" if isinstance(counts, list) else f"{type(counts).__name__}"
        raise DraftVocabError(
            f"{FLAG}: {path}: field token_counts: expected a list of {vocab_size} integers >= 0 "
            f"(the target's vocabulary), got {got}"
        )
    return torch.tensor(counts, dtype=torch.int64)


def head_rows(lm_head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A head computing rows ``ids`` [K] of ``lm_head``'s output only: ``x [..., H] -> [..., K]``,
    column j being vocabulary id ``ids[j]``. A copy of K weight rows (K x H more memory), in
    the kernel the head runs with (``nn.Linear``, or ``PackedLinear`` packed again)."""
    from ddtree.models.nn.linear import PackedLinear

    packed = isinstance(lm_head, PackedLinear)
    if packed:
        weight = lm_head.weight.to_dense()  # [V, H] from oneDNN's blocked layout
    elif type(lm_head) is nn.Linear:
        weight = lm_head.weight
    else:
        raise DraftVocabError(
            f"{FLAG}: the target's LM head is a {type(lm_head).__name__}; only a linear head "
            "(nn.Linear) can be cut to K rows"
        )
    bias = lm_head.bias
    with torch.inference_mode(False), torch.no_grad():  # weights a compiled graph reads
        cut = nn.Linear(weight.shape[1], int(ids.shape[0]), bias=bias is not None)
        cut = cut.to(device=weight.device, dtype=weight.dtype)
        cut.weight.copy_(weight.index_select(0, ids.to(weight.device)))
        if bias is not None:
            cut.bias.copy_(bias.index_select(0, ids.to(bias.device)))
        cut.requires_grad_(False)
    return PackedLinear(cut) if packed else cut


def draft_vocab_ids(
    k: int | None, vocab_size: int, counts: Callable[[], torch.Tensor], always: Sequence[int] = ()
) -> torch.Tensor | None:
    """The ids [K] int64 of ``--draft-vocab k`` (None: no flag, or K >= V: the full
    vocabulary), the counts read (``counts()``) only when K < V."""
    if k is None or check_draft_vocab(k) >= vocab_size:
        return None
    return most_frequent(counts(), k, always)
