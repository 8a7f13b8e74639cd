"""Record a trace: the target's greedy pass, then the drafter's top-K at every root.

Per prompt: one autoregressive greedy pass of the target (the engine's ``ar`` calls: prefill,
then one single-node verify per token) that also captures the hidden states the drafter
conditions on; then the drafter drafts every root position of the continuation at once,
``roots_per_forward`` blocks per forward (:meth:`DFlashDrafter.propose_at`), and
``ddtree.tree.topk_logprobs`` keeps the K best per depth. The drafting costs a fraction of the
greedy pass: recording costs about one AR generation of the same tokens (measured in the
README), where drafting each position from scratch would cost a drafter forward per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ddtree import tree as tree_core
from ddtree.engine.policies import root_tree
from ddtree.engine.stop import StopCondition
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


@torch.inference_mode()
def greedy_pass(
    target, prompt: torch.Tensor, max_new_tokens: int, eos: set[int], capture: list[int]
) -> GreedyPass:
    """The target's greedy continuation of ``prompt`` [T] int64 (stopping as the engine does:
    ``ddtree.engine.stop``), with the hidden states of layers ``capture`` (HF indexing) for
    every token it was fed."""
    stop_condition = StopCondition(max_new_tokens, frozenset(eos))
    target.reset()
    target.set_capture_layers(capture)
    device = getattr(target, "device", "cpu")
    out = target.prefill(prompt.to(device))
    hidden = [out.hidden]
    new = [int(out.logits[-1].argmax())]
    stop = stop_condition.scan(new, 0)
    while stop is None:
        out = target.verify(root_tree(new[-1], device))
        target.commit(torch.zeros(1, dtype=torch.int64, device=device))
        hidden.append(out.hidden)
        new.append(int(out.logits[-1].argmax()))
        stop = stop_condition.scan(new, len(new) - 1)
    return GreedyPass(new, torch.cat(hidden), stop)


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


def record_trace(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    top_k: int = DEFAULT_TOP_K,
    target_stamp: ModelStamp | None = None,
    drafter_stamp: ModelStamp | None = None,
    texts: Sequence[str] | None = None,
    eos_token_ids: Sequence[int] | None = None,
    on_prompt: Callable[[int, int], None] | None = None,
) -> Trace:
    """Record one trace over ``prompts`` (token ids). ``top_k`` is capped at the vocabulary;
    ``eos_token_ids`` None: the target's. ``on_prompt(index, new_tokens)`` after each prompt."""
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
    limit = target.info.max_position
    sequences, logprobs, tokens, infos = [], [], [], []
    for i, ids in enumerate(prompts):
        prompt = torch.as_tensor(list(ids), dtype=torch.int64)  # [T]
        if prompt.numel() == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        needed = int(prompt.numel()) + max_new_tokens + drafter.block_size
        if limit and needed > limit:
            raise ValueError(
                f"prompt {i}: {prompt.numel()} tokens + max_new_tokens {max_new_tokens} + block "
                f"{drafter.block_size} needs {needed} positions; {target.info.name} has "
                f"max_position {limit}"
            )
        t0 = time.perf_counter()
        run = greedy_pass(target, prompt, max_new_tokens, eos, list(drafter.target_layer_ids))
        t1 = time.perf_counter()
        sequence = torch.cat([prompt, torch.tensor(run.new_tokens, dtype=torch.int64)])
        lp, tok = draft_all_roots(drafter, sequence, run.hidden, int(prompt.numel()), k)
        t2 = time.perf_counter()
        sequences.append(sequence)
        logprobs.append(lp)
        tokens.append(tok)
        text = texts[i] if texts is not None else ""
        infos.append(
            PromptInfo(
                int(prompt.numel()), len(run.new_tokens), run.stop_reason, text, t1 - t0, t2 - t1
            )
        )
        if on_prompt is not None:
            on_prompt(i, len(run.new_tokens))
    header = TraceHeader(
        target=target_stamp or model_stamp(target.info, None),
        drafter=drafter_stamp or model_stamp(drafter.info, None),
        block_size=int(drafter.block_size),
        top_k=k,
        max_new_tokens=max_new_tokens,
        eos_token_ids=sorted(eos),
        prompts=infos,
        device=str(getattr(target, "device", "cpu")),
    )
    return Trace(header, torch.cat(sequences), torch.cat(logprobs), torch.cat(tokens))
