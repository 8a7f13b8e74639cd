"""Which kernel runs the linear layers of our models, chosen once when a model is loaded (like
the tree core's backend) and named in its ``ModelInfo.linear_kernel``, so every record says
which one ran.

Kernels (:data:`LINEAR_KERNELS`):

- ``aten``: ``nn.Linear`` as built, torch's own GEMM.
- ``onednn-packed``: each weight reordered once into oneDNN's blocked layout for a batch of
  :data:`PACK_HINT_M` rows (``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's
  freezing pass packs bfloat16 linears into), then called through ``ddtree::packed_linear``, a
  custom op that compiled graphs call as one opaque kernel: the compile boundary stays where it
  is and the model never knows the mode. CPU, bfloat16, a oneDNN build with bf16 support.

Why it exists: a verify of M tokens is nearly free only if the weight-streaming GEMM does not
slow down with M. On this project's CPU (one thread, Xeon with AMX-BF16), one forward's linear
layers of qwen3-1.7b's shape (``ddtree bench linear``, weights past twice the L3) took 329 ms
with ``aten`` at M = 1 and 1.35x that at M = 33; with ``onednn-packed`` 279 ms and 1.30x
(15% and 18% faster), outputs equal to bf16 rounding (max |diff| 0.004, 0 for most shapes).
A packed weight replaces the layer's own: the loaded model holds one copy (a tied LM head gets
its own packed copy; the embedding keeps the original). Packed models are for inference: they
cannot be moved, cast or saved (saving raises).

``DDTREE_LINEAR_KERNEL=aten|onednn-packed`` forces one (``onednn-packed`` where it cannot run
is an error naming why); otherwise ``onednn-packed`` where it can run, else ``aten``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

ENV_VAR = "DDTREE_LINEAR_KERNEL"
ATEN = "aten"
ONEDNN_PACKED = "onednn-packed"
LINEAR_KERNELS = (ATEN, ONEDNN_PACKED)
PACK_HINT_M = 64  # rows the layout is chosen for (64 and 256 timed best of 1..512, M = 1..257)


def packed_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``onednn-packed`` cannot run for weights on ``device`` in ``dtype``; None if it can."""
    if torch.device(device).type != "cpu":
        return f"device {torch.device(device).type} (CPU only)"
    if dtype != torch.bfloat16:
        return f"dtype {str(dtype).removeprefix('torch.')} (bfloat16 only)"
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "this torch build or CPU has no oneDNN bfloat16 support"
    return None


def choose_linear_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel for a model's linear layers (module docstring)."""
    forced = os.environ.get(ENV_VAR, "").strip()
    if forced:
        if forced not in LINEAR_KERNELS:
            raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {', '.join(LINEAR_KERNELS)}")
        why = packed_unavailable(device, dtype) if forced == ONEDNN_PACKED else None
        if why:
            raise ValueError(f"{ENV_VAR}={forced}: cannot run here: {why}")
        return forced
    return ATEN if packed_unavailable(device, dtype) else ONEDNN_PACKED


@torch.library.custom_op("ddtree::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x [..., in] @ W.T + b`` with ``weight`` a oneDNN-packed ``[out, in]`` weight."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x, weight, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is packed once (``onednn-packed``); same outputs."""

    def __init__(self, linear: nn.Linear, hint_m: int = PACK_HINT_M) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.inference_mode(False), torch.no_grad():  # a buffer compiled graphs read
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.contiguous(), hint_m)
        self.register_buffer("weight", packed, persistent=False)  # [out, in], blocked
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)  # [out] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return packed_linear(x, self.weight, self.bias, self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        raise RuntimeError(
            f"{prefix}weight is packed for inference ({ONEDNN_PACKED}); save the checkpoint the "
            "model was loaded from, or load it with DDTREE_LINEAR_KERNEL=aten"
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def use_linear_kernel(model: nn.Module, kernel: str, keep: tuple[str, ...] = ()) -> int:
    """Run ``model``'s ``nn.Linear`` layers with ``kernel``, in place, except those named in
    ``keep`` (attribute names, e.g. ``kv_b_proj``: a layer whose weight is also read as a
    matrix); the count replaced."""
    if kernel == ATEN:
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in keep:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced


def prepare_linears(adapter) -> None:
    """Choose the kernel for a loaded target's or drafter's linear layers (``adapter.model``
    on ``adapter.device`` in ``adapter.dtype``; ``adapter.plain_linears`` stay as they are),
    apply it, and name it in ``adapter.info``."""
    import dataclasses

    kernel = choose_linear_kernel(adapter.device, adapter.dtype)
    use_linear_kernel(adapter.model, kernel, adapter.plain_linears)
    adapter.info = dataclasses.replace(adapter.info, linear_kernel=kernel)


def weight_tensors(model: nn.Module):
    """``(name, tensor)`` of every weight ``model`` reads: its parameters and packed layers'
    weights and biases (buffers: a packed layer is for inference)."""
    yield from model.named_parameters()
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            yield f"{name}.weight", module.weight
            if module.bias is not None:
                yield f"{name}.bias", module.bias
