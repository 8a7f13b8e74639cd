"""Any transformers causal LM as a ``Target`` (batch of one request).

Each forward passes, explicitly:

- ``attention_mask``: an *additive float* 4D mask ``[1, 1, M, S + M]`` in the model dtype
  (0 visible, ``finfo.min`` hidden) covering the ``S`` cached prefix columns too. transformers
  returns a 4D mask as-is; the ``eager`` attention *adds* it to the scores, so a boolean mask
  would add 0/1 and silently attend everywhere (tests show it).
- ``position_ids`` ``[1, M]``: ``S + depth`` for a tree, ``S .. S+T-1`` for a prompt.
- the cache, under the keyword the installed transformers reads: 5.24 renamed
  ``past_key_values=`` to ``cache=`` and older 5.x releases silently ignore ``cache=``. The
  keyword is found once, at construction, from the forward's signature
  (:func:`detect_cache_keyword`), recorded in ``cache_keyword``, and every forward checks that
  the cache grew by M (a silently ignored cache would otherwise give wrong logits later).

After a verify the cache holds the tree's M provisional entries; ``commit`` keeps the accepted
ones with ``index_select`` along the sequence dim (-2) of every layer's keys and values (not
``DynamicCache.crop``, whose argument changed meaning between releases and which cannot keep a
non-suffix subset anyway).

Hidden states follow transformers' ``hidden_states`` indexing: 0 is the embedding output, i
the output of decoder layer i-1, and the last one (i = num_layers) is taken *after* the final
norm, as transformers returns it.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import DynamicCache

from ddtree.models.base import ModelInfo, NonFiniteLogitsError, TargetOutput  # noqa: F401 (its error)
from ddtree.models.nn.layers import (
    check_capture_layers,
    check_commit,
    check_positions,
    check_target_logits,
)
from ddtree.models.static import EagerLayouts, EnginePlan
from ddtree.tree.layout import VerifyLayout, compaction_indices
from ddtree.tree.types import DraftTree

CACHE_KEYWORDS = ("cache", "past_key_values")  # newest first


class CacheKeywordError(RuntimeError):
    """The model's forward takes no known cache keyword, or silently ignored the cache."""


def detect_cache_keyword(forward) -> str:
    """The keyword ``forward`` takes its KV cache under: ``"cache"`` (transformers >= 5.24) or
    ``"past_key_values"`` (earlier). Only named parameters count: a ``**kwargs`` catch-all
    would accept (and drop) either."""
    params = inspect.signature(forward).parameters
    for name in CACHE_KEYWORDS:
        if name in params and params[name].kind is not inspect.Parameter.VAR_KEYWORD:
            return name
    raise CacheKeywordError(
        f"{getattr(forward, '__qualname__', forward)}: no cache parameter in its signature "
        f"({', '.join(params)}); expected one of {CACHE_KEYWORDS}"
    )


def check_loading_info(info: dict, source: str) -> None:
    """transformers' ``output_loading_info`` of a load: tensors missing from the checkpoint
    (it would initialise them randomly), unexpected ones (it would drop them) and shape
    mismatches (it would re-initialise them) are a :class:`CheckpointError` naming them."""
    from ddtree.models.loading.checkpoint import CheckpointError, _names

    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing tensors: {_names(sorted(info['missing_keys']))}")
    if info.get("unexpected_keys"):
        problems.append(f"unexpected tensors: {_names(sorted(info['unexpected_keys']))}")
    mismatched = [
        f"{name} {tuple(found)} in the checkpoint, {tuple(wanted)} from config.json"
        for name, found, wanted in sorted(info.get("mismatched_keys") or (), key=str)
    ]
    if mismatched:
        problems.append(f"shape mismatches: {_names(mismatched)}")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


@contextmanager
def quiet_transformers():
    """transformers' warnings (its load report) and progress bars off, for the block."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def causal_float_mask(start: int, m: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """[1, 1, M, start+M] additive: the prefix visible, the new tokens causal among themselves."""
    mask = torch.zeros(1, 1, m, start + m, dtype=dtype, device=device)
    future = torch.ones(m, m, dtype=torch.bool, device=device).triu(1)
    mask[0, 0, :, start:].masked_fill_(future, torch.finfo(dtype).min)
    return mask


def _eos_ids(model) -> tuple[int, ...]:
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return tuple(int(e) for e in eos) if isinstance(eos, list | tuple) else (int(eos),)
    return ()


class HFTarget:
    """The ``Target`` protocol over a transformers ``*ForCausalLM`` with a ``DynamicCache``."""

    engine_modes = ("eager",)  # see set_engine_mode

    def __init__(self, model, name: str | None = None, check_finite: bool = True) -> None:
        self.model = model.eval()
        self.config = model.config.get_text_config()
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.check_finite = check_finite
        self.cache_keyword = detect_cache_keyword(model.forward)
        self.attn_implementation = getattr(model.config, "_attn_implementation", None)
        self.max_position = int(getattr(self.config, "max_position_embeddings", 0) or 0)
        self.capture_layers: tuple[int, ...] = ()
        self._layouts = EagerLayouts(self.dtype, self.device)
        self.cache = self._new_cache()
        self._seq_len = 0
        self._pending = 0  # M of the last verify, awaiting commit
        architecture = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
        self.info = ModelInfo(
            name=name or getattr(model.config, "name_or_path", "") or architecture,
            architecture=architecture,
            implementation="hf",
            n_params=sum(p.numel() for p in model.parameters()),
            num_layers=int(self.config.num_hidden_layers),
            hidden_size=int(self.config.hidden_size),
            vocab_size=int(self.config.vocab_size),
            dtype=str(self.dtype).removeprefix("torch."),
            max_position=self.max_position,
            eos_token_ids=_eos_ids(model),
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_implementation: str = "sdpa",
        check_finite: bool = True,
    ) -> HFTarget:
        """Load a checkpoint directory (config.json + safetensors; pickles are refused)."""
        from transformers import AutoModelForCausalLM

        from ddtree.models.loading.checkpoint import (
            CONFIG_NAME,
            CheckpointError,
            read_config,
            refuse_custom_code,
            weight_files,
            weights_source,
        )

        path = Path(path)
        # clear errors for a missing or broken config.json; custom modelling code refused
        refuse_custom_code(path / CONFIG_NAME, read_config(path))
        weight_files(path)  # refuses pickles, names missing shards
        try:
            with quiet_transformers():  # its load report and progress bar: ours is one line
                model, info = AutoModelForCausalLM.from_pretrained(
                    path,
                    dtype=dtype,
                    use_safetensors=True,
                    attn_implementation=attn_implementation,
                    output_loading_info=True,
                    ignore_mismatched_sizes=True,  # reported below, as ours are
                    trust_remote_code=False,  # never the checkpoint's own Python
                )
        except (ValueError, KeyError, OSError) as err:
            raise CheckpointError(f"{path}: transformers could not load it: {err}") from err
        check_loading_info(info, weights_source(path))
        return cls(model.to(device), name=path.name, check_finite=check_finite)

    # --- protocol -------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def set_capture_layers(self, layer_ids: list[int]) -> None:
        self.capture_layers = check_capture_layers(layer_ids, self.info.num_layers)

    def reset(self) -> None:
        self.cache = self._new_cache()
        self._seq_len = 0
        self._pending = 0

    def set_engine_mode(self, plan: EnginePlan) -> float:
        """Eager only (``engine_modes``, checked by the engine before this is called):
        transformers' ``DynamicCache`` grows by concatenation every forward and the tree commit
        re-slices it, so every step would have new shapes for a compiled graph (and its
        ``StaticCache`` cannot keep a non-suffix subset of the rows)."""
        if plan.capture_layers is not None:
            self.set_capture_layers(list(plan.capture_layers))
        self.reset()
        self._layouts.reserve(plan)
        return 0.0

    def layout(self, tree: DraftTree) -> VerifyLayout:
        return self._layouts.fill(tree, self._seq_len)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        assert input_ids.dim() == 1, input_ids.shape  # [T] int64
        self._drop_pending()
        t, start = int(input_ids.shape[0]), self._seq_len
        check_positions(self.info, start + t, f"prompt of {t} tokens after {start} cached")
        mask = causal_float_mask(start, t, self.dtype, self.device)
        positions = torch.arange(start, start + t, device=self.device)
        out = self._forward(input_ids.to(self.device), positions, mask)
        self._seq_len += t
        return out

    @torch.inference_mode()
    def verify(self, tree: DraftTree, layout: VerifyLayout | None = None) -> TargetOutput:
        self._drop_pending()
        m, start = tree.n_nodes, self._seq_len
        if layout is None:
            layout = self.layout(tree)
        positions, mask = layout.position_ids, layout.attn_mask
        assert positions.shape == (m,) and mask.shape == (1, 1, m, start + m), (
            positions.shape,
            mask.shape,
            m,
            start,
        )
        if mask.dtype == torch.bool or not mask.is_floating_point():
            raise TypeError(f"verify layout attn_mask is {mask.dtype}: expected an additive float")
        check_positions(
            self.info, int(positions.max()) + 1, f"tree of depth {int(tree.depth.max())}"
        )
        out = self._forward(
            tree.tokens.to(self.device),
            positions.to(self.device),
            mask.to(device=self.device, dtype=self.dtype),
        )
        self._pending = m
        return out

    @torch.inference_mode()
    def commit(self, accepted: torch.Tensor) -> None:
        check_commit(accepted, self._pending)
        plan = compaction_indices(accepted.to(self.device), self._seq_len)
        for layer in self.cache.layers:
            layer.keys = _compact(layer.keys, plan.src, plan.dst, plan.new_len)
            layer.values = _compact(layer.values, plan.src, plan.dst, plan.new_len)
        self._seq_len = plan.new_len
        self._pending = 0

    # --- internals ------------------------------------------------------------------------
    def _new_cache(self) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        sliding = [i for i, layer in enumerate(cache.layers) if getattr(layer, "is_sliding", False)]
        if sliding:
            raise ValueError(
                f"{type(self.model).__name__}: layers {sliding} use sliding-window attention; "
                f"tree verify and cache compaction need full attention layers"
            )
        return cache

    def _drop_pending(self) -> None:
        """A verify not followed by commit leaves M provisional entries: drop them."""
        if self._pending:
            keep = torch.arange(self._seq_len, device=self.device)
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(-2, keep)
                layer.values = layer.values.index_select(-2, keep)
            self._pending = 0

    def _forward(
        self,
        ids: torch.Tensor,  # [M] int64
        positions: torch.Tensor,  # [M] int64
        mask: torch.Tensor,  # [1, 1, M, S+M] additive float
    ) -> TargetOutput:
        m, start = int(ids.shape[0]), self._seq_len
        kwargs = {self.cache_keyword: self.cache}
        out = self.model(
            input_ids=ids[None],
            attention_mask=mask,
            position_ids=positions[None],
            use_cache=True,
            output_hidden_states=bool(self.capture_layers),
            **kwargs,
        )
        grown = self.cache.get_seq_length()
        if grown != start + m:
            raise CacheKeywordError(
                f"{type(self.model).__name__}: cache holds {grown} entries after a forward of "
                f"{m} tokens over {start}: the model ignored {self.cache_keyword}="
            )
        logits = out.logits[0]  # [M, V]
        if self.check_finite:
            check_target_logits(self.info.name, logits, positions)
        hidden = None
        if self.capture_layers:
            states = out.hidden_states
            hidden = torch.cat([states[i][0] for i in self.capture_layers], -1)  # [M, n * H]
        return TargetOutput(logits=logits, hidden=hidden)


def _compact(
    x: torch.Tensor,  # [B, heads, S+M, D]
    src: torch.Tensor,  # [tau] int64
    dst: torch.Tensor,  # [tau] int64
    new_len: int,
) -> torch.Tensor:
    """Move entries ``src`` to ``dst`` along the sequence dim and keep ``new_len``."""
    moved = x.index_select(-2, src)  # gathered first, so overlapping src/dst are safe
    x[..., dst, :] = moved
    return x[..., :new_len, :]
