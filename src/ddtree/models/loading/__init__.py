"""Checkpoint folders before and while loading: config.json, safetensors shards, quantized
weights, tokenizers, and the drafter-target compatibility check. No nn.Modules."""
