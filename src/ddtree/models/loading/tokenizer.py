"""A checkpoint's tokenizer files, checked when they load: ``tokenizer.json`` (the
``tokenizers`` library's JSON, at most as many ids as the model's vocabulary) and
``tokenizer_config.json`` (a JSON object whose known fields have their types). Every error is
a :class:`~ddtree.models.loading.checkpoint.CheckpointError` naming the file and what was expected.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddtree.models.loading.checkpoint import (
    CONFIG_NAME,
    CheckpointError,
    read_json_file,
    refuse_custom_code,
)

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
# fields of tokenizer_config.json whose type matters to a load: name -> (types, what)
SPECIAL = (str, dict, type(None))
CONFIG_FIELDS = {
    "chat_template": ((str, list, type(None)), "a Jinja template string (or a list of them)"),
    "model_max_length": ((int, float, type(None)), "a number"),
    "tokenizer_class": ((str, type(None)), "a class name"),
    "eos_token": (SPECIAL, "a token string"),
    "bos_token": (SPECIAL, "a token string"),
    "pad_token": (SPECIAL, "a token string"),
    "unk_token": (SPECIAL, "a token string"),
    "mask_token": (SPECIAL, "a token string"),
    "added_tokens_decoder": ((dict,), "an object of id -> token"),
}


_read_json = read_json_file


def check_tokenizer_config(path: str | Path) -> None:
    """``tokenizer_config.json`` beside a checkpoint, when there is one: a JSON object whose
    known fields (``CONFIG_FIELDS``) have the types transformers reads them as, and no
    ``auto_map`` (custom tokenizer code shipped with the checkpoint: refused)."""
    file = Path(path) / TOKENIZER_CONFIG_NAME
    if not file.is_file():
        return
    config = _read_json(file, "a JSON object")
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(config).__name__}")
    for name, (types, what) in CONFIG_FIELDS.items():
        if name in config and not isinstance(config[name], types):
            raise CheckpointError(f"{file}: field {name}={config[name]!r}: expected {what}")
    refuse_custom_code(file, config)


def load_tokenizer(path: str | Path, vocab_size: int | None = None):
    """The ``tokenizers.Tokenizer`` of checkpoint folder ``path``, its files checked (see the
    module); ``vocab_size`` (the model's, from its ``config.json``): the tokenizer may not
    have more ids than the embedding has rows."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / TOKENIZER_NAME
    if not file.is_file():
        raise CheckpointError(f"{file}: no {TOKENIZER_NAME} next to the target's {CONFIG_NAME}")
    what = "a tokenizers JSON object (fields version, model, added_tokens, ...)"
    data = _read_json(file, what)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        got = type(data).__name__ if not isinstance(data, dict) else "no model object"
        raise CheckpointError(f"{file}: expected {what}, got {got}")
    try:
        tokenizer = Tokenizer.from_str(json.dumps(data))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed one
        raise CheckpointError(f"{file}: not a tokenizer tokenizers can read ({err})") from None
    check_tokenizer_config(path)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and size > vocab_size:
        raise CheckpointError(
            f"{file}: the tokenizer has {size} ids but {path / CONFIG_NAME} has "
            f"vocab_size={vocab_size} (embedding rows); expected at most {vocab_size} ids"
        )
    return tokenizer


def config_vocab_size(config: dict) -> int | None:
    """``vocab_size`` of a ``config.json`` dict (or of its ``text_config``), None without."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict) and isinstance(cfg.get("vocab_size"), int):
            return cfg["vocab_size"]
    return None
