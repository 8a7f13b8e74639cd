"""Demo prompts come from held-out files only, deterministically."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from ddtree.train.corpus import list_corpus, read_texts
from ddtree.train.prompts import heldout_text_prompts


def test_prompts_are_deterministic_snippets_of_heldout_files_only():
    prompts = heldout_text_prompts(n=8, lines=4, seed=1)
    assert prompts == heldout_text_prompts(n=8, lines=4, seed=1)
    assert len(set(prompts)) == 8
    split = list_corpus()
    heldout, train = read_texts(split.heldout), read_texts(split.train)
    for p in prompts:
        assert p.lstrip().startswith(("def ", "class ")) and p.count("\n") == 4
        assert any(p in text for text in heldout)
        assert not any(p in text for text in train)


def test_the_bundled_prompts_file_is_what_the_recipe_writes():
    bundled = Path(str(files("ddtree") / "assets" / "demo" / "prompts.json"))
    assert json.loads(bundled.read_text()) == heldout_text_prompts()
