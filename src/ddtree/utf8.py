"""Text a user gives (prompts, messages, stop strings) checked as UTF-8 before a tokenizer sees
it: one check for the command line, prompt files and the server's request bodies."""

from __future__ import annotations


def decode_text(data: bytes, what: str) -> str:
    """``data`` as UTF-8 text, or a ValueError naming ``what`` (a file) and the byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def check_text(text: str, what: str) -> str:
    """``text`` once it holds no lone surrogate: how the command line carries bytes that are not
    UTF-8 (surrogateescape), and what a JSON ``\\udcff`` escape decodes to. Tokenizers cannot
    take them (a TypeError deep inside). A ValueError names ``what`` and the character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what}: not valid UTF-8 text (a lone surrogate or undecodable byte, "
            f"{ascii(text[e.start])}, at character {e.start})"
        ) from None
    return text
