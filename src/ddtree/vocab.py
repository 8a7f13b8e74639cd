"""The words the engine, the records and the estimator share: ``Stage``, ``EngineMode`` and
the decode ``Policy`` with its registry ``POLICIES``.

Torch-free and dependency-free, so that ``ddtree.records``, ``ddtree.perf`` and the command
line read them cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# The least sampling temperature and top-p: the sampler computes in float32 (max 3.4e38,
# smallest normal 1.2e-38). Below MIN_TEMPERATURE, logits / temperature overflow to inf for
# logits past 3.4e8 and then decode NaN garbage (1e-45 does for every logit); below MIN_TOP_P,
# top-p rounds to a subnormal or to 0 (1e-300), which drops every token. Greedy is 0.
MIN_TEMPERATURE = 1e-30
MIN_TOP_P = 1e-30


@dataclass(frozen=True)
class SamplingFloor:
    """The least value of one sampling parameter float32 holds: the one rule the decode config,
    the command line and the HTTP layer check (each names its own input in the message)."""

    name: str  # "temperature" | "top_p"
    least: float
    why: str  # what goes wrong below it
    zero_is_greedy: bool = False  # 0 is allowed and means greedy

    def refuses(self, value: float) -> bool:
        """``value`` (already known to be a finite number of the parameter's range) is below
        the floor."""
        return value < self.least and not (self.zero_is_greedy and value == 0)

    def expected(self, at_least: str = ">=") -> str:
        """What is accepted, e.g. ``0 (greedy) or >= 1e-30``."""
        greedy = "0 (greedy) or " if self.zero_is_greedy else ""
        return f"{greedy}{at_least} {self.least:g}"


SAMPLING_FLOORS: dict[str, SamplingFloor] = {
    f.name: f
    for f in (
        SamplingFloor(
            "temperature",
            MIN_TEMPERATURE,
            "smaller ones overflow float32 logits / temperature into NaN",
            zero_is_greedy=True,
        ),
        SamplingFloor(
            "top_p", MIN_TOP_P, "smaller ones round to 0 in float32 and drop every token"
        ),
    )
}


def check_sampling_floors(**values: float) -> None:
    """ValueError naming the first of ``values`` (``temperature=``, ``top_p=``) below its
    floor (:data:`SAMPLING_FLOORS`)."""
    for name, value in values.items():
        floor = SAMPLING_FLOORS[name]
        if floor.refuses(value):
            raise ValueError(f"{name} must be {floor.expected()} ({floor.why}), got {value}")


class Stage(StrEnum):
    """A timed stage. A decode step runs ``STEP_STAGES`` in order; ``prefill`` is the target
    forward over the prompt, before the first step."""

    PREFILL = "prefill"
    DRAFT = "draft"  # drafter forward over the block
    TOPK = "topk"  # top-k over the drafter's (B-1) x V logits
    BUILD = "build"  # best-first tree build
    LAYOUT = "layout"  # verify positions and the ancestor-only mask
    VERIFY = "verify"  # one target forward over the M tree tokens
    ACCEPT = "accept"  # walk the verified tree
    COMMIT = "commit"  # keep the accepted path's KV entries
    OTHER = "other"  # the rest of the step


STEP_STAGES: tuple[Stage, ...] = tuple(s for s in Stage if s is not Stage.PREFILL)
MODEL_STAGES: frozenset[Stage] = frozenset({Stage.DRAFT, Stage.VERIFY})
"""Stages spent in model forwards; every other step stage is engine overhead."""


class EngineMode(StrEnum):
    """How the engine ran its forwards: ``eager`` (Python dispatch per op) or ``compiled``
    (torch.compile: inductor C++ on CPU, CUDA graphs on CUDA)."""

    EAGER = "eager"
    COMPILED = "compiled"


class Drafting(StrEnum):
    """How a policy's drafter proposes the L = B - 1 depths of a step (what the engine runs as
    its proposer and the estimator prices as the drafter's cost)."""

    BLOCK = "block"  # one drafter forward over the block [root, MASK x (B-1)] (DFlash)
    # k = B - 1 sequential steps, each a forward of the drafter over the top-k tokens the
    # previous step kept; the estimator prices them (the engine has no proposer for them yet)
    STEPS = "steps"  # a small autoregressive drafter of its own (EAGLE-2 / EAGLE-3)
    MTP = "mtp"  # the target's multi-token-prediction layer, reused at every step
    # no drafter model: the k tokens that followed an earlier match of the last n-gram (prompt
    # lookup, vLLM's ngram, suffix decoding), found on the host
    LOOKUP = "lookup"
    # Medusa / Hydra heads on the target's last hidden state: one pass of the k heads
    HEADS = "heads"

    @property
    def in_steps(self) -> bool:
        """The depths are drafted one after another (k forwards), not in one block forward."""
        return self in (Drafting.STEPS, Drafting.MTP)

    @property
    def step_fields(self) -> bool:
        """Its tree is described by SGLang's names (num_steps k, topk, num_draft_tokens), not
        by a block size and budget."""
        return self in (Drafting.STEPS, Drafting.MTP, Drafting.LOOKUP, Drafting.HEADS)


@dataclass(frozen=True)
class Policy:
    """How a decode step proposes tokens, and every rule that follows from it.

    Vocabulary: block size B, budget N (``DecodeConfig.budget``), vocabulary size V. The
    step's tree has ``budget(B, N)`` non-root nodes over ``candidates(N, V)`` candidates per
    depth; the target verifies ``budget(B, N) + 1`` tokens. A policy is one entry of
    ``POLICIES``; code asks it for its rules instead of testing its name.
    """

    name: str
    about: str  # one line, for help texts
    drafting: Drafting | None = None  # None: no drafter, the step verifies the root alone
    candidates_per_depth: int | None = None  # K; None: min(N, V), as the published DDTree
    budget_is_depth: bool = False  # the tree is the path through all B - 1 depths, whatever N

    def __str__(self) -> str:
        return self.name

    @property
    def needs_drafter(self) -> bool:
        return self.drafting is not None

    @property
    def uses_budget(self) -> bool:
        """N sets the tree's size (a sweep over budgets means something)."""
        return self.needs_drafter and not self.budget_is_depth

    @property
    def min_budget(self) -> int:
        """The smallest N it accepts: 1 node where N sets the tree, else 0 (N is ignored)."""
        return 1 if self.uses_budget else 0

    def block(self, block_size: int) -> int:
        """Tokens one step may commit: B with a drafter, 1 without."""
        return block_size if self.needs_drafter else 1

    def budget(self, block_size: int, budget: int) -> int:
        """Non-root nodes of the tree a step builds at block size B and budget N."""
        if not self.needs_drafter:
            return 0
        return block_size - 1 if self.budget_is_depth else budget

    def candidates(self, budget: int, vocab_size: int) -> int:
        """K, the candidates per depth taken from a block drafter's logits (a policy that
        drafts in steps keeps the top-k its deployment sets at each step instead)."""
        if self.candidates_per_depth is not None:
            return self.candidates_per_depth
        return max(1, min(budget, vocab_size))


AR = Policy("ar", "no drafter: one target forward per token (verify width M = 1)")
"""The baseline: a speedup is tokens/s over this policy's, same hardware and engine mode."""

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        AR,
        Policy(
            "chain",
            "the drafter's top-1 at each of the B - 1 depths, verified as one path (budget B - 1)",
            Drafting.BLOCK,
            candidates_per_depth=1,
            budget_is_depth=True,
        ),
        Policy(
            "ddtree",
            "best-first tree of N nodes over the drafter's top-K per depth, K = min(N, V)",
            Drafting.BLOCK,
        ),
        Policy(
            "eagle",
            "EAGLE-2/3: k = B - 1 sequential steps of a small drafter, top-k kept per step, a "
            "tree of N nodes verified (SGLang's num_steps, topk, num_draft_tokens = N + 1)",
            Drafting.STEPS,
        ),
        Policy(
            "mtp",
            "DeepSeek-style multi-token prediction: the target's MTP layer applied k = B - 1 "
            "times as the drafter, then verified like eagle",
            Drafting.MTP,
        ),
        Policy(
            "ngram",
            "n-gram / prompt lookup: the k tokens that followed the last match of the context's "
            "final n-gram, found on the host, no drafter model; verified as a chain of k + 1",
            Drafting.LOOKUP,
        ),
        Policy(
            "medusa",
            "Medusa / Hydra: k heads on the target's last hidden state propose k depths in one "
            "pass (each head with its own vocabulary projection); a tree of N nodes verified",
            Drafting.HEADS,
        ),
    )
}
"""name -> Policy. Adding a policy: one entry here."""

DEFAULT_POLICY = "ddtree"
AUTO_MAX_BUDGET = 64
"""``--budget auto``: the tree each step is built at; the step verifies its best prefix
(``ddtree.engine.budget``)."""
"""What a request or a scenario that names no policy runs."""


def policies_help() -> str:
    """One line per policy, for a command's ``--help``: ``name: about``."""
    return "; ".join(f"{p.name}: {p.about}" for p in POLICIES.values())


def get_policy(name: str) -> Policy:
    """The policy called ``name``; ValueError naming the choices."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r}: expected one of {', '.join(POLICIES)}")
    return POLICIES[name]
