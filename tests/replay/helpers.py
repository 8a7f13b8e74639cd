"""Hand-made traces for replay tests."""

from __future__ import annotations

import torch

from ddtree.replay.record import DEFAULT_TOP_K, record_prompts
from ddtree.replay.simulate import PromptReplay, PromptReplayer
from ddtree.replay.trace import ModelStamp, PromptInfo, Trace, TraceHeader, merge_traces


def stamp(name="m", fingerprint=""):
    return ModelStamp(name, "Arch", 10, 16, "float32", fingerprint)


def make_trace(prompt, continuation, logprobs, tokens, block_size, stop="max_new_tokens"):
    """One prompt; ``logprobs``/``tokens`` [n-1, B-1, K] (one row per root)."""
    lp = torch.tensor(logprobs, dtype=torch.float32)
    header = TraceHeader(
        target=stamp("t"),
        drafter=stamp("d"),
        block_size=block_size,
        top_k=lp.shape[-1],
        max_new_tokens=len(continuation),
        eos_token_ids=[],
        prompts=[PromptInfo(len(prompt), len(continuation), stop)],
    )
    return Trace(
        header, torch.tensor(prompt + continuation), lp, torch.tensor(tokens, dtype=torch.int64)
    )


# The simulate module's worked example: B = 3, prompt of 2 tokens, continuation [5, 6, 7].
EXAMPLE = dict(
    prompt=[1, 2],
    continuation=[5, 6, 7],
    logprobs=[[[-0.1, -2.0], [-0.5, -0.7]], [[-0.2, -0.3], [-0.1, -0.9]]],
    tokens=[[[6, 9], [8, 7]], [[7, 3], [4, 5]]],
    block_size=3,
)


def record_trace(target, drafter, prompts, max_new_tokens, top_k=DEFAULT_TOP_K, eos_token_ids=None):
    """One trace over ``prompts``: ``record_prompts``' per-prompt traces, joined."""
    return merge_traces(
        list(
            record_prompts(
                target, drafter, prompts, max_new_tokens, top_k, eos_token_ids=eos_token_ids
            )
        )
    )


def replay_prompt(trace: Trace, index: int, policy: str, budget: int) -> PromptReplay:
    """Replay prompt ``index`` of ``trace`` under ``policy`` (chain, ddtree) at ``budget``."""
    return PromptReplayer(trace, index, policy).run([budget])[0]
