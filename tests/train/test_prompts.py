"""Demo prompts come from held-out files only, deterministically."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest

from ddtree.train.corpus import list_corpus, read_texts
from ddtree.train.prompts import text_prompts


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    """(held-out texts, training texts) of the stdlib corpus, read once for the module."""
    split = list_corpus()
    return read_texts(split.heldout), read_texts(split.train)


def test_prompts_are_snippets_of_heldout_files_only(corpus):
    heldout, train = corpus
    prompts = text_prompts(heldout, train, n=8, lines=4, seed=1)
    assert len(set(prompts)) == 8
    training = "\0".join(train)
    for p in prompts:
        assert p.lstrip().startswith(("def ", "class ")) and p.count("\n") == 4
        assert any(p in text for text in heldout)
        assert p not in training


def test_the_bundled_prompts_file_is_what_the_recipe_writes(corpus):
    # written once from this corpus: drawing again gives the same prompts (deterministic)
    bundled = Path(str(files("ddtree") / "assets" / "demo" / "prompts.json"))
    assert json.loads(bundled.read_text()) == text_prompts(*corpus)
