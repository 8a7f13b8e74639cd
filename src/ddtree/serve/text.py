"""The text a client sees of a completion while it grows.

The engine returns the token that stopped a request (EOS, or the one completing a stop
string), as transformers' ``generate`` does; the OpenAI API returns neither the EOS text nor
the stop string. So the streamed text leaves EOS tokens out and holds back the last
``len(longest stop) - 1`` characters: an occurrence of a stop string that a later token
completes starts inside that tail (one that started earlier would be complete already, and
the request would have stopped), so nothing emitted is ever part of a stop string.

Worked example, stop ``"ab"`` (hold back 1 character): pieces ``"x"``, ``"a"``, ``"bz"``.
``"x"``: pending ``"x"``, emit ``""`` (held). ``"a"``: pending ``"xa"``, emit ``"x"``.
``"bz"``: pending ``"abz"`` holds ``"ab"`` at 0: emit ``""``, stopped. Text: ``"x"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddtree.engine.stop import IncrementalText


@dataclass
class CompletionText:
    tokenizer: object  # anything with decode(list[int]) -> str
    eos_token_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    text: str = ""  # emitted so far
    _pending: str = ""  # decoded, not emitted yet
    _stopped: bool = False
    _decoder: IncrementalText = field(init=False)

    def __post_init__(self) -> None:
        self._decoder = IncrementalText(self.tokenizer)
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1

    def push(self, tokens: list[int]) -> str:
        """The text these new tokens add that can be sent now ("" while held back)."""
        if self._stopped:
            return ""
        self._pending += "".join(
            self._decoder.push(t) for t in tokens if t not in self.eos_token_ids
        )
        cut = min((i for i in map(self._pending.find, self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self._stopped = True
            return self._emit(cut)
        return self._emit(len(self._pending) - self._hold)

    def finish(self) -> str:
        """The held-back rest, once the request has ended."""
        return "" if self._stopped else self._emit(len(self._pending))

    def _emit(self, n: int) -> str:
        out = self._pending[: max(n, 0)]
        self._pending = "" if self._stopped else self._pending[len(out) :]
        self.text += out
        return out
