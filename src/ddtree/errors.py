"""Error types shared across layers, kept free of heavy imports so the CLI can catch them."""


class NonFiniteLogitsError(RuntimeError):
    """A model produced NaN or inf logits; decoding stops instead of emitting garbage."""


class DistributedError(RuntimeError):
    """A tensor/expert-parallel group failed: a rank died, stalled past the collective timeout,
    could not join, or disagrees with rank 0. The message names the ranks and why."""


class MissingExtraError(ImportError):
    """A command needs an optional extra (``pip install 'ddtree[serve]'``) that is not
    installed; the message is the one line that says which and how."""
