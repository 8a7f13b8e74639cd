"""Greedy acceptance of a drafter on a target: mean tau of DDTree steps on held-out prompts.

Drives the ``Target`` and ``Drafter`` protocols with the tree core only (top-k, best-first
build, greedy acceptance), so it measures the drafter before and independently of the engine.
Every step's committed tokens are the target's greedy tokens, so the decoded text equals
autoregressive greedy decoding (the test checks this).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.models.base import Drafter, Target
from ddtree.tree import accept_greedy, build_tree, topk_logprobs


@dataclass
class AcceptanceResult:
    budget: int
    block_size: int
    taus: list[list[int]]  # per prompt, tau of every step
    outputs: list[list[int]]  # per prompt, the generated token ids

    @property
    def mean_tau(self) -> float:
        flat = [t for per_prompt in self.taus for t in per_prompt]
        return sum(flat) / max(1, len(flat))


@torch.inference_mode()
def greedy_decode_tree(
    target: Target, drafter: Drafter, prompt: torch.Tensor, budget: int, max_new_tokens: int
) -> tuple[list[int], list[int]]:
    """DDTree greedy decoding of one ``prompt`` [T] int64: (generated ids, tau per step)."""
    target.reset()
    drafter.reset()
    target.set_capture_layers(list(drafter.target_layer_ids))
    out = target.prefill(prompt)
    root = int(out.logits[-1].argmax())
    context = out.hidden  # [T, F]
    generated, taus = [root], []
    while len(generated) < max_new_tokens:
        logits = drafter.propose(context, root)  # [B-1, V]
        top = topk_logprobs(logits, budget)
        tree = build_tree(root, top.logprobs, top.tokens, budget)
        verified = target.verify(tree)
        result = accept_greedy(tree, verified.logits.argmax(-1))
        target.commit(result.accepted)
        context = verified.hidden[result.accepted]  # [tau, F]
        generated.extend(tree.tokens[result.accepted[1:]].tolist())
        root = result.bonus_token
        generated.append(root)
        taus.append(result.tau)
    return generated[:max_new_tokens], taus


@torch.inference_mode()
def greedy_decode_ar(target: Target, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Plain autoregressive greedy decoding of one prompt (the losslessness reference)."""
    target.reset()
    target.set_capture_layers([])
    token = int(target.prefill(prompt).logits[-1].argmax())
    generated = [token]
    while len(generated) < max_new_tokens:
        token = int(target.prefill(torch.tensor([token])).logits[-1].argmax())
        generated.append(token)
    return generated


def greedy_acceptance(
    target: Target,
    drafter: Drafter,
    prompts: torch.Tensor,  # [P, T] int64
    budget: int,
    max_new_tokens: int,
) -> AcceptanceResult:
    taus, outputs = [], []
    for prompt in prompts:
        ids, step_taus = greedy_decode_tree(target, drafter, prompt, budget, max_new_tokens)
        outputs.append(ids)
        taus.append(step_taus)
    return AcceptanceResult(
        budget=budget, block_size=drafter.block_size, taus=taus, outputs=outputs
    )
