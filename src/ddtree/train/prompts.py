"""Held-out text prompts for the demo: snippets of held-out stdlib files (split by file, see
``ddtree.train.corpus``), each starting at a ``def`` or ``class`` line.

Regenerate the bundled file with::

    python -c "from ddtree.train.prompts import write_prompts; write_prompts('src/ddtree/assets/demo/prompts.json')"
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ddtree.train.corpus import list_corpus, read_texts


def heldout_text_prompts(n: int = 16, lines: int = 6, seed: int = 0) -> list[str]:
    """``n`` prompts of ``lines`` source lines from distinct held-out files of the corpus
    (deterministic): :func:`text_prompts` of its held-out and training texts."""
    split = list_corpus()
    return text_prompts(read_texts(split.heldout), read_texts(split.train), n, lines, seed)


def text_prompts(
    heldout: list[str], train: list[str], n: int = 16, lines: int = 6, seed: int = 0
) -> list[str]:
    """``n`` snippets of ``lines`` lines, each starting at a ``def``/``class`` line, from
    distinct ``heldout`` texts (one drawn per text, then shuffled, by ``seed``). Snippets
    that also occur verbatim in a ``train`` text (shared boilerplate) are skipped."""
    seen_in_training = "\0".join(train)
    rng = random.Random(seed)
    prompts = []
    for text in heldout:
        rows = text.splitlines(keepends=True)
        starts = [i for i, r in enumerate(rows) if r.lstrip().startswith(("def ", "class "))]
        snippets = ["".join(rows[i : i + lines]) for i in starts if i + lines <= len(rows)]
        snippets = [s for s in snippets if s not in seen_in_training]
        if snippets:
            prompts.append(rng.choice(snippets))
    rng.shuffle(prompts)
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} held-out files have a def/class snippet; asked {n}")
    return prompts[:n]


def write_prompts(path: str | Path, n: int = 16, lines: int = 6, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(heldout_text_prompts(n, lines, seed), indent=1) + "\n", encoding="utf-8"
    )
    return path
