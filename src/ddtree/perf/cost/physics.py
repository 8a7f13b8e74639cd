"""Physics a configuration must obey before the estimator prices it (issue 18).

* Memory: weights + KV cache + activations + the runtime's reserve per GPU against the GPU's
  memory. Over it is refused, naming the sizes (``--allow-oversubscribe`` makes it a warning:
  a user who offloads or swaps may still want the number).
* Tensor parallelism against the attention heads: the attention group must divide the query
  heads and either divide or be divided by the KV heads; more GPUs than KV heads replicate
  them (priced: each GPU keeps a whole KV head and its projections), which is said once.
* Context: the positions a step reaches (context + verify width) against the model's
  ``max_position_embeddings``.

Pure: a ``Finding`` list per point; the scenario reader turns refusals into one-line errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddtree.perf.cost.step import Point
from ddtree.perf.hardware.units import BYTES, format_quantity
from ddtree.perf.shapes.model import PRECISION_BYTES, ModelShape

RUNTIME_RESERVE_BYTES = 3.5 * 2**30
"""CUDA context, NCCL buffers, captured graphs and allocator slack per GPU: aiconfigurator's
``other_mem`` (3.5 GiB, 'for safer deployment'; its nccl_mem adds 0.4 GB) (assumed)."""

ACTIVATION_BUFFERS = 4
"""Hidden-size activations a forward keeps alive per token (residual, norm output, attention
output, MLP input), each in bf16 (assumed)."""


@dataclass(frozen=True)
class MemoryUse:
    """Bytes one GPU holds for a point (the busiest GPU where the split is uneven)."""

    weights_bytes: float
    kv_bytes: float
    activation_bytes: float
    reserve_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes + self.reserve_bytes

    def describe(self) -> str:
        f = lambda x: format_quantity(x, BYTES)  # noqa: E731
        return (
            f"{f(self.weights_bytes)} of weights + {f(self.kv_bytes)} of KV cache + "
            f"{f(self.activation_bytes)} of activations + {f(self.reserve_bytes)} runtime "
            f"reserve = {f(self.total_bytes)} per GPU"
        )


@dataclass(frozen=True)
class Finding:
    kind: str  # "refuse" | "oversubscribe" | "note"
    message: str


def _layer_bytes(model: ModelShape, pt: Point) -> float:
    """The decoder layers' weights on one GPU: attention (KV projections replicated past the
    KV heads), routed experts (all of them spread over the group, however split), shared
    experts, dense MLP layers."""
    shards = pt.weight_shards
    attn = (
        model.num_layers
        * model.attention_params_per_shard(shards)
        * model.bytes_per_param("attention")
    )
    routed = (
        model.num_moe_layers * model.n_routed_experts * model.expert_params
        * model.bytes_per_param("routed_experts") / pt.tp
    )  # fmt: skip
    shared = (
        model.num_moe_layers * model.n_shared_experts * model.expert_params
        * model.bytes_per_param("shared_experts") / shards
    )  # fmt: skip
    dense = model.num_dense_layers * model.dense_mlp_params * model.bytes_per_param("dense_mlp")
    return attn + routed + shared + dense / shards


def weight_bytes_per_gpu(model: ModelShape, pt: Point) -> float:
    """Every weight a GPU holds: the decoder layers, LM head and input embedding, the drafter
    (an MTP layer as one more decoder layer of the target's shape, an EAGLE head with its own
    LM head if it has one)."""
    shards = pt.weight_shards
    vocab = 2 * model.lm_head_params * model.bytes_per_param("lm_head")  # LM head + embedding
    total = _layer_bytes(model, pt) + vocab / shards
    d = pt.drafter
    if d is not None and d.layer_shape is not None:
        total += _layer_bytes(d.layer_shape, pt)
        total += d.projection_params * PRECISION_BYTES[d.precision] / shards
    elif d is not None:
        head = d.lm_head_vocab * model.hidden_size if not d.shares_target_lm_head else 0
        total += (d.params + head) * PRECISION_BYTES[d.precision] / shards
    return total


def memory_per_gpu(model: ModelShape, pt: Point) -> MemoryUse:
    """The memory one GPU needs at the point's context, verify width and concurrency."""
    tokens = pt.context_tokens + pt.verify_width
    kv = pt.requests_per_gpu * model.kv_bytes_read(tokens, pt.weight_shards)
    if pt.drafter is not None:
        kv += pt.requests_per_gpu * tokens * pt.drafter.kv_bytes_per_token / pt.weight_shards
    step_tokens = pt.verify_width * pt.requests_per_gpu
    widest = max(model.intermediate_size / pt.weight_shards,
                 model.top_k * model.moe_intermediate_size / pt.experts_tp)  # fmt: skip
    act = step_tokens * (ACTIVATION_BUFFERS * model.hidden_size + 2 * widest) * 2.0
    act += step_tokens * model.vocab_size / pt.weight_shards * 4.0  # fp32 logits
    return MemoryUse(weight_bytes_per_gpu(model, pt), float(kv), float(act),
                     RUNTIME_RESERVE_BYTES)  # fmt: skip


def findings(model: ModelShape, pt: Point) -> list[Finding]:
    """What is wrong with pricing this point, most fundamental first."""
    out: list[Finding] = []
    hw = pt.hardware
    shards = pt.weight_shards
    if model.attention == "gqa":
        if model.num_heads % shards:
            out.append(Finding(
                "refuse",
                f"tp {shards} does not divide the {model.num_heads} attention heads of "
                f"{model.name}; use a divisor of {model.num_heads}",
            ))  # fmt: skip
        for kv in sorted({k.kv_heads for k in model.softmax_kinds()} or {model.num_kv_heads}):
            if kv % shards and shards % kv:
                out.append(Finding(
                    "refuse",
                    f"tp {shards} neither divides nor is divided by the {kv} KV heads of "
                    f"{model.name}: the KV heads cannot be split or replicated evenly",
                ))  # fmt: skip
            elif shards > kv:
                out.append(Finding(
                    "note",
                    f"tp {shards} > {kv} KV heads of {model.name}: each KV head (and its K/V "
                    f"projections) is replicated on {shards // kv} GPUs, priced as such",
                ))  # fmt: skip
    elif model.num_heads % shards:
        out.append(Finding(
            "refuse",
            f"tp {shards} does not divide the {model.num_heads} attention heads of {model.name}",
        ))  # fmt: skip
    # a step places its verify width, and the drafter its block, after the context
    span, what = max((pt.verify_width, "verify width"), (pt.block_size, "block size"))
    reach = pt.context_tokens + span
    if model.max_positions and reach > model.max_positions:
        out.append(Finding(
            "refuse",
            f"context {pt.context_tokens:.0f} + {what} {span} = {reach:.0f} "
            f"positions exceeds {model.name}'s max_position_embeddings {model.max_positions}",
        ))  # fmt: skip
    if hw.memory_bytes > 0:
        use = memory_per_gpu(model, pt)
        if use.total_bytes > hw.memory_bytes:
            out.append(Finding(
                "oversubscribe",
                f"{model.name} on {pt.tp} x {hw.key} needs {use.describe()}, more than the "
                f"{format_quantity(hw.memory_bytes, BYTES)} a GPU has; use more GPUs (tp) or a "
                "smaller context or concurrency",
            ))  # fmt: skip
    return out
