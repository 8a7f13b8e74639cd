"""Stop conditions of one request, checked token by token as transformers' ``generate`` does.

A request stops at the first new token that is an EOS id, or whose text completes a stop
string, or at ``max_new_tokens``, whichever comes first; the first token (the one chosen from
the prefill's logits) counts like any other. The tokens after the stop are dropped; the token
that stopped it is kept (EOS included, as transformers returns it).

Stop strings are matched on the text of the new tokens, decoded incrementally: each token
decodes a short window (the previous emitted token, for the tokenizer's spacing rules, plus
the tokens not yet emitted) and only the tail of the text that a stop string could still
complete is searched. Decoding therefore costs time linear in the output length, not the
quadratic of re-decoding the whole output per token.

Worked example, a tokenizer that decodes ``[a, b]`` to ``"wa wb"`` and stop string
``"w7 w"``: tokens ``[7, 3]``. Token 7: window ``[7]`` decodes to ``"w7"`` (no match in
``"w7"``). Token 3: window ``[7, 3]`` -> ``"w7 w3"``, minus the window's prefix ``"w7"`` gives
``" w3"``; the tail ``"w7"`` (the last ``len("w7 w") - 1 = 3`` characters) plus ``" w3"`` is
``"w7 w3"``, which holds the stop string: stop after token 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What a byte-level tokenizer returns for a multi-byte character cut in the middle.
INCOMPLETE_CHARACTER = "\ufffd"


@dataclass
class IncrementalText:
    """The text of a growing token list, one new token at a time (``push``), decoding only a
    short window per token. ``push`` returns the characters the token added ("" while a
    multi-byte character is incomplete: they come with the token that completes it)."""

    tokenizer: object  # anything with decode(list[int]) -> str
    _tokens: list[int] = field(default_factory=list)
    _prefix: int = 0  # window start: the last token whose text was emitted
    _read: int = 0  # tokens up to here have been emitted

    def push(self, token: int) -> str:
        self._tokens.append(token)
        before = self.tokenizer.decode(self._tokens[self._prefix : self._read])
        text = self.tokenizer.decode(self._tokens[self._prefix :])
        if len(text) <= len(before) or text.endswith(INCOMPLETE_CHARACTER):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return text[len(before) :]


@dataclass
class StopCondition:
    """Decides where one request stops. ``scan(tokens, start)`` after every step."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: object | None = None
    _text: IncrementalText | None = None
    _tail: str = ""  # the last (longest stop string - 1) characters of the text so far

    def __post_init__(self) -> None:
        if self.stop_strings:
            if self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer")
            if not all(self.stop_strings):
                raise ValueError("stop strings must be non-empty")
            self._text = IncrementalText(self.tokenizer)

    def scan(self, tokens: list[int], start: int) -> str | None:
        """Check ``tokens[start:]`` (each exactly once, in order, over successive calls);
        truncate ``tokens`` in place after the stop and return its reason (``"eos"``,
        ``"stop_string"``, ``"max_new_tokens"``), or None to go on."""
        del tokens[self.max_new_tokens :]
        for i in range(start, len(tokens)):
            reason = self._token_stops(tokens[i])
            if reason is not None:
                del tokens[i + 1 :]
                return reason
        return "max_new_tokens" if len(tokens) >= self.max_new_tokens else None

    def _token_stops(self, token: int) -> str | None:
        if token in self.eos_token_ids:
            return "eos"
        if self._text is None:
            return None
        window = self._tail + self._text.push(token)
        keep = max(len(s) for s in self.stop_strings) - 1
        self._tail = window[max(0, len(window) - keep) :] if keep else ""
        return "stop_string" if any(s in window for s in self.stop_strings) else None
