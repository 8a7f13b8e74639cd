"""The ``Target`` / ``Drafter`` protocols over a model: a request's cache, the verify inputs,
prefill / verify / commit, the eager and compiled runners chosen once (``target.py``), one
adapter per family, the transformers wrapper (``hf.py``), batched rows, tensor parallelism and
the drafter's restricted vocabulary."""
