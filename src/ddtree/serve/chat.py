"""Chat messages -> prompt token ids through the checkpoint's own chat template.

The template is the one transformers finds in a checkpoint folder (``chat_template`` in
``tokenizer_config.json``, or a ``chat_template.jinja`` file beside it); it is rendered by
transformers' ``apply_chat_template`` with the generation prompt appended, so the ids are the
ones the model was trained to continue. Reusable outside the server (``generate --chat``)::

    template = ChatTemplate.load(Path("ckpt"))
    ids = template.prompt_ids([{"role": "user", "content": "hi"}])
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class ChatTemplateError(ValueError):
    """The checkpoint has no chat template, or the template refused the messages."""


@dataclass
class ChatTemplate:
    tokenizer: object | None  # a transformers tokenizer; None: the checkpoint has no template
    checkpoint: Path

    @staticmethod
    def load(checkpoint: Path) -> ChatTemplate:
        """The checkpoint's tokenizer and template (a folder without a template loads too:
        ``prompt_ids`` then says so, so a server can still serve plain completions)."""
        from transformers import AutoTokenizer

        from ddtree.models.loading.checkpoint import CONFIG_NAME, read_config, refuse_custom_code
        from ddtree.models.loading.tokenizer import (
            TOKENIZER_NAME,
            check_tokenizer_config,
            load_tokenizer,
        )

        # the files transformers reads, checked first: one line naming a broken one, and
        # custom tokenizer code (auto_map) refused rather than run
        check_tokenizer_config(checkpoint)
        config_file = Path(checkpoint) / CONFIG_NAME
        if config_file.is_file():
            refuse_custom_code(config_file, read_config(checkpoint), keys=("AutoTokenizer",))
        if (Path(checkpoint) / TOKENIZER_NAME).is_file():
            load_tokenizer(checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), trust_remote_code=False)
        return ChatTemplate(tokenizer if tokenizer.chat_template else None, Path(checkpoint))

    @property
    def available(self) -> bool:
        return self.tokenizer is not None

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` (``[{"role": ..., "content": ...}, ...]``) rendered by the
        template, ending with the assistant's generation prompt."""
        if self.tokenizer is None:
            raise ChatTemplateError(
                f"{self.checkpoint}: the checkpoint has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja); send a plain prompt (the "
                "completions endpoint, generate without --chat) or add a template"
            )
        from jinja2 import TemplateError

        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except TemplateError as e:  # raise_exception() in a template, or a template bug
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
        return list(encoded["input_ids"])
