"""A synthetic drafter for timing real-size targets at an acceptance we choose: **always
labelled synthetic** (its ``ModelInfo`` name starts with ``synthetic-oracle``).

Random-weight targets accept nothing from a real drafter, so their speed with DDTree cannot be
measured directly. The oracle knows the target's own greedy continuation (a reference pass,
given with :meth:`OracleDrafter.expect`) and proposes, at each of the B-1 positions of a block,
a distribution in which the true next token sits at a random rank:

- depth d (1..B-1) puts the true token first with probability ``p_d = p * decay**(d-1)``;
  otherwise at rank r >= 1 with probability ``(1 - p_d) * (1 - spread) * spread**(r-1)``
  (ranks past ``ranks`` are cut; the true token is then absent);
- the proposed distribution *is* that rank profile: rank r gets probability
  ``p_d`` / ``(1 - p_d)(1 - spread) spread**(r-1)``, filled with distinct random tokens, so
  the drafter is calibrated (what it says about its ranks is how often they are right) and a
  best-first tree spends its budget where a real calibrated drafter would.

The draws depend on (seed, position, depth) only, so chain and DDTree see the same proposals
at the same position and the same request. The decode stays lossless: the target verifies
whatever is proposed; tau and tokens/s are measured by the engine, never computed.

Its cost is real: each propose runs the wrapped drafter's forward (e.g. a random-weight DFlash
drafter of the published shape) and discards the logits; without one the draft costs nothing
(and the name says so).

Spec syntax (``parse_oracle_spec``): ``oracle:p=0.8,decay=0.98,spread=0.4,ranks=8,seed=0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ddtree.models.base import ModelInfo
from ddtree.models.static import EnginePlan

PREFIX = "oracle:"
# logit of tokens outside the proposed ranks: finite (NaN/inf checks sum the logits), and far
# below any proposed one (a rank of probability 1e-9 still sits 20 nats above it)
FLOOR_LOGIT = -60.0


class OracleSpecError(ValueError):
    """An ``oracle:...`` spec that cannot be parsed (names the field and what was expected)."""


@dataclass(frozen=True)
class OracleSpec:
    p: float = 0.8  # P(true token ranked first) at depth 1
    decay: float = 1.0  # p_d = p * decay**(d-1)
    spread: float = 0.5  # geometric ratio of the lower ranks' probabilities
    ranks: int = 8  # ranks proposed per position
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "p": 0 <= self.p <= 1,
            "decay": 0 < self.decay <= 1,
            "spread": 0 <= self.spread < 1,
            "ranks": self.ranks >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise OracleSpecError(
                f"oracle spec: {bad[0]}={getattr(self, bad[0])!r}: expected p in [0, 1], decay "
                f"in (0, 1], spread in [0, 1), ranks >= 1"
            )

    @property
    def label(self) -> str:
        return (
            f"p={self.p:g},decay={self.decay:g},spread={self.spread:g},ranks={self.ranks},"
            f"seed={self.seed}"
        )

    def rank_probs(self, depth: int) -> list[float]:
        """[ranks] the proposed probability of each rank at ``depth`` (1-based)."""
        p_d = self.p * self.decay ** (depth - 1)
        rest = [
            (1 - p_d) * (1 - self.spread) * self.spread ** (r - 1) for r in range(1, self.ranks)
        ]
        return [p_d, *rest]


def parse_oracle_spec(text: str) -> OracleSpec:
    """``oracle:p=0.8,spread=0.4`` (every field optional) -> OracleSpec."""
    if not text.startswith(PREFIX):
        raise OracleSpecError(f"oracle spec {text!r}: expected it to start with {PREFIX!r}")
    types = {f.name: f.type for f in fields(OracleSpec)}
    values: dict = {}
    for part in filter(None, text[len(PREFIX) :].split(",")):
        name, _, value = part.partition("=")
        if name not in types or not value:
            raise OracleSpecError(
                f"oracle spec {text!r}: {part!r}: expected NAME=VALUE with NAME one of "
                f"{', '.join(types)}"
            )
        cast = int if types[name] in (int, "int") else float
        try:
            values[name] = cast(value)
        except ValueError:
            raise OracleSpecError(
                f"oracle spec {text!r}: {name}={value!r} is not a number"
            ) from None
        if cast is float and not math.isfinite(values[name]):
            raise OracleSpecError(f"oracle spec {text!r}: {name}={value!r} is not finite")
    return OracleSpec(**values)


class OracleDrafter:
    """The ``Drafter`` protocol: ``base``'s cost, the oracle's proposals (module docstring)."""

    def __init__(self, spec: OracleSpec, base=None, *, block_size: int | None = None,
                 vocab_size: int | None = None, target_layer_ids=None) -> None:  # fmt: skip
        if base is None and (block_size is None or vocab_size is None):
            raise ValueError("an oracle without a base drafter needs block_size and vocab_size")
        self.spec, self.base = spec, base
        self.block_size = base.block_size if base is not None else int(block_size)
        self.vocab_size = base.info.vocab_size if base is not None else int(vocab_size)
        self.target_layer_ids = list(
            base.target_layer_ids if base is not None else (target_layer_ids or [])
        )
        self.engine_modes = base.engine_modes if base is not None else ("eager", "compiled")
        self.device = base.device if base is not None else torch.device("cpu")
        cost = f"{base.info.name}'s forward" if base is not None else "no drafter forward"
        self.info = ModelInfo(
            name=f"synthetic-oracle({spec.label}; cost: {cost})",
            architecture="OracleDrafter",
            implementation="oracle",
            n_params=base.info.n_params if base is not None else 0,
            num_layers=base.info.num_layers if base is not None else 0,
            hidden_size=base.info.hidden_size if base is not None else 0,
            vocab_size=self.vocab_size,
            dtype=base.info.dtype if base is not None else "float32",
            draft_vocab=base.info.draft_vocab if base is not None else 0,  # its head's cost
        )
        self.reference: list[int] = []
        self.seen = 0
        # its proposals span the full vocabulary (synthetic ranks, module docstring), whatever
        # draft vocabulary the base drafter's cost is paid at
        self.draft_tokens = None
        # [ranks, B-1] float32 probabilities of each rank at each depth, their logs (the
        # proposed logits), and [ranks + 1, B-1] what the true token's rank is drawn from
        # (the last row: absent, the mass past the proposed ranks)
        probs = torch.tensor([spec.rank_probs(d) for d in range(1, self.block_size)]).T
        self._logp = probs.log().clamp(min=FLOOR_LOGIT + 10).contiguous()  # above the floor
        self._draw = torch.cat([probs, (1 - probs.sum(0, keepdim=True)).clamp(min=0)]).contiguous()

    def expect(self, sequence: list[int]) -> None:
        """The target's greedy sequence (prompt + continuation) the next requests follow."""
        self.reference = [int(t) for t in sequence]

    def reset(self) -> None:
        self.seen = 0
        if self.base is not None:
            self.base.reset()

    def set_engine_mode(self, plan: EnginePlan) -> float:
        self.seen = 0
        return self.base.set_engine_mode(plan) if self.base is not None else 0.0

    def fork(self) -> OracleDrafter:
        """An oracle for another request decoded beside this one (``ddtree.engine.batch``):
        the same spec, a fork of the base drafter (its cost), a reference of its own."""
        base = self.base.fork() if self.base is not None else None
        twin = OracleDrafter(
            self.spec, base, block_size=self.block_size, vocab_size=self.vocab_size,
            target_layer_ids=self.target_layer_ids,
        )  # fmt: skip
        twin.info = self.info
        return twin

    def batches_with(self, other) -> bool:
        """Whether ``other`` proposes in one forward with this oracle (:meth:`propose_many`):
        an oracle whose base batches with this one's (or neither has a base)."""
        if not isinstance(other, OracleDrafter) or (self.base is None) != (other.base is None):
            return False
        return self.base is None or self.base.batches_with(other.base)

    @staticmethod
    def propose_many(
        oracles: list[OracleDrafter], contexts: list[torch.Tensor], roots: list[int]
    ) -> list[torch.Tensor]:
        """Each oracle's ``propose``, their base drafters' forwards in one
        (``DFlashDrafter.propose_many``: the cost a batch of real drafters pays)."""
        bases = [o.base for o in oracles]
        if bases[0] is not None:
            type(bases[0]).propose_many(bases, contexts, roots)  # the cost; logits discarded
        out = []
        for o, ctx, root in zip(oracles, contexts, roots, strict=True):
            o.seen += int(ctx.shape[0])
            out.append(o.logits_at(o.seen, int(root)))
        return out

    def propose(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        """[B-1, V] logits for the positions after the root (at position ``seen``)."""
        if self.base is not None:
            self.base.propose(context_hidden, root_token)  # its cost; the logits are discarded
        self.seen += int(context_hidden.shape[0])
        return self.logits_at(self.seen, int(root_token))

    def logits_at(self, root_position: int, root_token: int) -> torch.Tensor:
        """The oracle's [B-1, V] float32 logits for a block rooted at ``root_position``: off
        the reference (a request it was not told, or past its end), random ranks only."""
        b, ranks = self.block_size, self.spec.ranks
        gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + root_position)
        on_track = (
            root_position < len(self.reference) and self.reference[root_position] == root_token
        )
        rows, cols, values = [], [], []  # the proposed ranks, drawn on the host
        for d in range(1, b):
            pos = root_position + d
            true = self.reference[pos] if on_track and pos < len(self.reference) else None
            row = _distinct_tokens(self.vocab_size, ranks, gen, exclude=true)  # decoys
            if true is not None:
                rank = int(torch.multinomial(self._draw[:, d - 1], 1, generator=gen))
                if rank < ranks:  # the true token at its drawn rank (ranks: left out)
                    row = torch.cat([row[:rank], torch.tensor([true]), row[rank:]])[:ranks]
            rows.append(torch.full_like(row, d - 1))
            cols.append(row)
            values.append(self._logp[: len(row), d - 1])
        # [B-1, V] on the drafter's device, as a real drafter's logits are
        logits = torch.full((b - 1, self.vocab_size), FLOOR_LOGIT, device=self.device)
        index = (torch.cat(rows).to(self.device), torch.cat(cols).to(self.device))
        logits.index_put_(index, torch.cat(values).to(self.device))
        return logits


def _distinct_tokens(vocab: int, n: int, gen: torch.Generator, exclude: int | None) -> torch.Tensor:
    """[min(n, vocab - 1)] distinct random token ids, without ``exclude``."""
    if vocab <= 4 * (n + 1):
        pool = torch.randperm(vocab, generator=gen).tolist()
    else:  # a few draws with replacement, deduplicated in order: no O(V) permutation
        pool = torch.randint(0, vocab, (4 * (n + 1),), generator=gen).tolist()
    chosen = list(dict.fromkeys(t for t in pool if t != exclude))
    return torch.tensor(chosen[:n], dtype=torch.int64)
