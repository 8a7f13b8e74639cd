"""Error types shared across layers, kept free of heavy imports so the CLI can catch them."""


class NonFiniteLogitsError(RuntimeError):
    """A model produced NaN or inf logits; decoding stops instead of emitting garbage."""
