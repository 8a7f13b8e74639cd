"""Record a trace: the target's greedy pass, then the drafter's top-K at every root.

Per prompt: one autoregressive greedy pass of the target (``ddtree.engine.generate`` under
``ar``, the target wrapped so that it also keeps the hidden states the drafter conditions on
of every committed token); then the drafter drafts every root position of the continuation at once,
``roots_per_forward`` blocks per forward (:meth:`DFlashDrafter.propose_at`), and
``ddtree.tree.topk_logprobs`` keeps the K best per depth. The drafting costs a fraction of the
greedy pass: recording costs about one AR generation of the same tokens (measured in the
README), where drafting each position from scratch would cost a drafter forward per token.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ddtree import tree as tree_core
from ddtree.engine import (
    ContextLengthError,
    DecodeConfig,
    generate,
    prompt_tensor,
    request_positions,
)
from ddtree.replay.trace import ModelStamp, PromptInfo, Trace, TraceHeader

DEFAULT_TOP_K = 1024  # candidates per depth: enough for any budget up to 1024
# Per recording forward: logit elements (R blocks x (B-1) x V) and attention scores
# (heads x R*B queries x (context + R*B) keys), each at most 4M / 64M floats.
LOGITS_PER_FORWARD = 1 << 22
SCORES_PER_FORWARD = 1 << 26
MAX_ROOTS_PER_FORWARD = 64


@dataclass
class GreedyPass:
    new_tokens: list[int]  # n >= 1, EOS included when it stopped there
    hidden: torch.Tensor  # [T + n - 1, F] captured target hidden states of tokens 0..T+n-2
    stop_reason: str  # "max_new_tokens" | "eos"


class CommittedHidden:
    """A target that keeps the hidden states of layers ``capture`` (HF indexing) of every
    token it commits (``hidden``: one [t, F] tensor per prefill or commit, in order); every
    other attribute is the wrapped target's."""

    def __init__(self, target, capture: list[int]) -> None:
        self.target, self.capture = target, capture
        self.hidden: list[torch.Tensor] = []
        self._verified: torch.Tensor | None = None  # [M, F] of the last verify

    def __getattr__(self, name: str):
        return getattr(self.target, name)

    def set_capture_layers(self, layer_ids: list[int]) -> None:
        self.target.set_capture_layers(self.capture)

    def set_engine_mode(self, plan):
        """The plan with this wrapper's capture layers, whatever the policy's."""
        return self.target.set_engine_mode(
            dataclasses.replace(plan, capture_layers=tuple(self.capture))
        )

    def prefill(self, input_ids: torch.Tensor):
        out = self.target.prefill(input_ids)
        self.hidden.append(out.hidden)
        return out

    def verify(self, tree, layout=None):
        out = self.target.verify(tree, layout)
        self._verified = out.hidden
        return out

    def commit(self, accepted: torch.Tensor) -> None:
        self.target.commit(accepted)
        self.hidden.append(self._verified.index_select(0, accepted.to(self._verified.device)))


@torch.inference_mode()
def greedy_pass(
    target, prompt: torch.Tensor, max_new_tokens: int, eos: set[int], capture: list[int]
) -> GreedyPass:
    """The target's greedy continuation of ``prompt`` [T] int64, decoded by the engine under
    ``ar`` (so it stops as the engine does), with the hidden states of layers ``capture`` (HF
    indexing) for every token it was fed."""
    recorder = CommittedHidden(target, capture)
    config = DecodeConfig("ar", max_new_tokens=max_new_tokens, eos_token_ids=tuple(sorted(eos)))
    out = generate(recorder, None, prompt, config)
    return GreedyPass(out.tokens, torch.cat(recorder.hidden), out.stop_reason)


def roots_per_forward(block_size: int, vocab_size: int, context: int = 0, heads: int = 1) -> int:
    """Blocks per recording forward: at most 64, 4M logit elements and 64M attention scores
    over ``context`` keys."""
    r = max(
        1, min(MAX_ROOTS_PER_FORWARD, LOGITS_PER_FORWARD // max(1, (block_size - 1) * vocab_size))
    )
    while r > 1 and heads * r * block_size * (context + r * block_size) > SCORES_PER_FORWARD:
        r //= 2
    return r


@torch.inference_mode()
def draft_all_roots(drafter, sequence: torch.Tensor, hidden: torch.Tensor, first_root: int, k: int):
    """Top-K drafter candidates at roots ``first_root .. len(sequence) - 2``.

    ``sequence`` [S] int64 (prompt + continuation), ``hidden`` [>= S-2, F] the target's hidden
    states of its tokens. Returns (logprobs [R, B-1, K] float32, tokens [R, B-1, K] int64)."""
    positions = torch.arange(first_root, int(sequence.shape[0]) - 1)  # [R]
    heads = getattr(getattr(drafter, "config", None), "num_attention_heads", 1)
    chunk = roots_per_forward(
        drafter.block_size, drafter.info.vocab_size, int(sequence.shape[0]), heads
    )
    logprobs, tokens = [], []
    for start in range(0, int(positions.shape[0]), chunk):
        roots = positions[start : start + chunk]
        logits = drafter.propose_at(hidden, sequence[roots], roots)  # [r, B-1, V]
        top = tree_core.topk_logprobs(logits, k)
        logprobs.append(top.logprobs.cpu())
        tokens.append(top.tokens.cpu())
    if not logprobs:
        depth = drafter.block_size - 1
        return torch.zeros(0, depth, k), torch.zeros(0, depth, k, dtype=torch.int64)
    return torch.cat(logprobs), torch.cat(tokens)


def record_prompts(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    top_k: int = DEFAULT_TOP_K,
    target_stamp: ModelStamp | None = None,
    drafter_stamp: ModelStamp | None = None,
    texts: Sequence[str] | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> Iterator[Trace]:
    """Record ``prompts`` (token ids) one by one, yielding each prompt's trace as it is done
    (``merge_traces`` joins them into one; a caller that stops early keeps the finished
    ones). ``top_k`` is capped at the vocabulary; ``eos_token_ids`` None: the target's."""
    from ddtree.replay.trace import model_stamp

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if not prompts:
        raise ValueError("no prompts to record")
    vocab = int(drafter.info.vocab_size)
    k = min(top_k, vocab)
    eos = set(target.info.eos_token_ids if eos_token_ids is None else eos_token_ids)
    target_stamp = target_stamp or model_stamp(target.info, None)
    drafter_stamp = drafter_stamp or model_stamp(drafter.info, None)
    for i, ids in enumerate(prompts):
        try:
            prompt = prompt_tensor(ids)  # [T] int64
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        try:
            request_positions(target.info, int(prompt.numel()), max_new_tokens, drafter.block_size)
        except ContextLengthError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        t0 = time.perf_counter()
        run = greedy_pass(target, prompt, max_new_tokens, eos, list(drafter.target_layer_ids))
        t1 = time.perf_counter()
        sequence = torch.cat([prompt, torch.tensor(run.new_tokens, dtype=torch.int64)])
        lp, tok = draft_all_roots(drafter, sequence, run.hidden, int(prompt.numel()), k)
        t2 = time.perf_counter()
        text = texts[i] if texts is not None else ""
        info = PromptInfo(
            int(prompt.numel()), len(run.new_tokens), run.stop_reason, text, t1 - t0, t2 - t1
        )
        header = TraceHeader(
            target=target_stamp,
            drafter=drafter_stamp,
            block_size=int(drafter.block_size),
            top_k=k,
            max_new_tokens=max_new_tokens,
            eos_token_ids=sorted(eos),
            prompts=[info],
            device=str(getattr(target, "device", "cpu")),
        )
        yield Trace(header, sequence, lp, tok)
