"""A byte-level BPE tokenizer trained with ``tokenizers`` on the corpus.

Two special tokens: ``EOS_TOKEN`` ends each file, ``MASK_TOKEN`` fills the drafter's block.
Saved as ``tokenizer.json`` + ``tokenizer_config.json`` (loads with transformers'
``AutoTokenizer`` as a ``PreTrainedTokenizerFast``).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ddtree.files import replace_atomically

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # ids 0 and 1


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least 258")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    out = Path(out)
    with replace_atomically(out / "tokenizer.json") as partial:
        tok.save(str(partial))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    with replace_atomically(out / "tokenizer_config.json") as partial:
        partial.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_tokenizer(path: Path) -> Tokenizer:
    """``tokenizer.json`` of folder ``path``, checked as every loader checks it
    (``ddtree.models.loading.tokenizer``: one error naming the file)."""
    from ddtree.models.loading.tokenizer import load_tokenizer as load_checked

    return load_checked(path)


def special_id(tok: Tokenizer, token: str) -> int:
    idx = tok.token_to_id(token)
    if idx is None:
        raise ValueError(f"tokenizer has no special token {token!r}")
    return idx
