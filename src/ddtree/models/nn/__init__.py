"""The nn.Modules: shared layers (norms, RoPE, experts, attention, packed linears), the module
shape our causal LMs share, and each model family (Qwen3 / Llama decoder, MLA+MoE, DFlash). No
engine modes, no caches of a request: ``ddtree.models.adapters`` wraps these."""
