"""The ``Drafter`` adapter over the DFlash block drafter (:mod:`ddtree.models.nn.dflash` describes
the architecture): one request's incremental context cache, the draft step of each engine mode
(chosen once), checkpoint loading and the restricted draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ddtree.models.base import ModelInfo
from ddtree.models.nn.dflash import ARCHITECTURE, CacheView, DFlashConfig, DFlashModel
from ddtree.models.nn.layers import (
    check_finite,
)
from ddtree.models.static import (
    ENGINE_MODES,
    CompiledForward,
    EnginePlan,
    KeyPositions,
    cache_input,
    kv_bucket,
    mark_key_dim,
)


class DFlashDrafter:
    """The ``Drafter`` protocol over :class:`DFlashModel` for one request, with an incremental
    context cache: per layer the keys/values of every committed token seen so far (``seen``
    of them, at slots = positions ``0..seen-1``) in one preallocated buffer grown
    geometrically from ``capacity``. A propose writes the new context rows and then the
    block's rows right after them, and attends over the buffer's first rows; the block's rows
    are overwritten by the next propose. ``check_finite``: NaN/inf drafter logits raise
    :class:`NonFiniteLogitsError`. Engine modes as the target's (``ddtree.models.static``):
    compiled mode pads the new context to ``B`` rows (a longer first context is appended
    eagerly first) and masks the padded keys.

    ``draft_tokens`` [K] int64 (ascending vocabulary ids; None: the full vocabulary): a reduced
    draft vocabulary (``ddtree.models.adapters.draft_vocab``): :meth:`propose` computes the LM head over
    those K rows only and returns logits [B-1, K], column j standing for id
    ``draft_tokens[j]``. :meth:`propose_at` and :meth:`block_logits` (recording, training)
    keep the full head."""

    engine_modes = ENGINE_MODES
    plain_linears: tuple[str, ...] = ()  # as the target's (ddtree.models.nn.linear)

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def __init__(
        self,
        model: DFlashModel,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        name="dflash",
        capacity: int = 256,
        check_finite: bool = True,
        draft_tokens: torch.Tensor | None = None,
    ):
        self.model = model.eval()
        self.config = model.config
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.block_size = self.config.block_size
        self.check_finite = check_finite
        # the Drafter protocol indexes hidden states as transformers does (0 = embeddings)
        self.target_layer_ids = [i + 1 for i in self.config.target_layer_ids]
        c = self.config
        self.info = ModelInfo(
            name=name,
            architecture=ARCHITECTURE,
            implementation="dflash",
            n_params=sum(p.numel() for p in model.parameters()),
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            dtype=str(self.dtype).removeprefix("torch."),
            max_position=c.max_position_embeddings,
        )
        kv_heads, head_dim = c.num_key_value_heads, c.head_dim
        shape = (c.num_hidden_layers, max(int(capacity), 1), kv_heads, head_dim)
        self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [L, C, kvh, D]
        self._v = torch.zeros_like(self._k)
        self._key_positions = KeyPositions(max(int(capacity), c.block_size), self.device)
        self._block = torch.full(
            (1, c.block_size), c.mask_token_id, dtype=torch.int64, device=self.device
        )  # [1, B]: [root, MASK x (B-1)], the root refilled each step
        self._context = torch.zeros(1, c.block_size, c.context_features, device=self.device)
        self._context = self._context.to(self.dtype)  # [1, B, F]: compiled mode's padded rows
        self._seen_t = torch.zeros((), dtype=torch.int64, device=self.device)
        self._block_start = torch.zeros((), dtype=torch.int64, device=self.device)
        self.engine = EnginePlan()
        self._runner: EagerDraftStep | CompiledDraftStep = EagerDraftStep(self)
        self._graphs: CompiledDraftStep | None = None  # kept across plans: compiles once
        self.seen = 0  # committed tokens whose context keys/values are cached
        self.draft_tokens: torch.Tensor | None = None  # [K] int64, None: the full vocabulary
        self.draft_head: nn.Module = lm_head  # what propose's logits come from
        if draft_tokens is not None:
            self.restrict_vocab(draft_tokens)

    def restrict_vocab(self, draft_tokens: torch.Tensor | None) -> None:
        """Propose over ``draft_tokens`` [K] int64 (distinct vocabulary ids, ascending) only,
        or over the full vocabulary again (None): the LM head's K rows are copied once here
        (``draft_vocab.head_rows``). Proposes run eager until the next ``set_engine_mode``,
        which compiles a compiled mode's graph again, for the new head."""
        import dataclasses

        from ddtree.models.adapters.draft_vocab import head_rows

        vocab = self.config.vocab_size
        if draft_tokens is None:
            self.draft_tokens, self.draft_head = None, self.lm_head
        else:
            ids = draft_tokens.to(self.device, torch.int64)  # [K]
            assert ids.dim() == 1, ids.shape
            if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise ValueError(f"draft_tokens must be non-empty ids in 0..{vocab - 1}")
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                raise ValueError("draft_tokens must be distinct ids in ascending order")
            self.draft_tokens, self.draft_head = ids, head_rows(self.lm_head, ids)
        k = 0 if self.draft_tokens is None else int(self.draft_tokens.shape[0])
        self.info = dataclasses.replace(self.info, draft_vocab=k)
        self.engine, self._runner, self._graphs = EnginePlan(), EagerDraftStep(self), None
        self.reset()

    def reset(self) -> None:
        self.seen = 0

    def fork(self) -> DFlashDrafter:
        """A drafter for another request decoded beside this one (``ddtree.engine.batch``):
        the same modules, weights and draft vocabulary (its head rows shared, not copied), a
        context cache of its own."""
        twin = DFlashDrafter(
            self.model,
            self.embed_tokens,
            self.lm_head,
            name=self.info.name,
            capacity=int(self._k.shape[1]),
            check_finite=self.check_finite,
        )
        twin.info = self.info
        twin.draft_tokens, twin.draft_head = self.draft_tokens, self.draft_head
        return twin

    @torch.inference_mode()
    def set_engine_mode(self, plan: EnginePlan) -> float:
        """Eager or compiled proposes for the next requests: picks the step runner of
        ``plan.mode`` once (the target's widths do not matter: a propose always has B block
        rows and at most B new context rows). Compiled mode compiles its one graph the first
        time; returns the seconds that took."""
        self.engine = plan
        self.reset()
        if plan.mode == "eager":
            self._runner = EagerDraftStep(self)
            return 0.0
        self._ensure(kv_bucket(plan.max_len + 2 * self.block_size))
        compile_s = 0.0
        if self._graphs is None:
            self._graphs = CompiledDraftStep(self)
            compile_s = self._graphs.warm_up()
            self.reset()
        self._runner = self._graphs
        return compile_s

    @torch.inference_mode()
    def propose(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        """The ``Drafter`` protocol's: logits [B-1, K] over ``draft_tokens`` (K = V and
        column = id without a draft vocabulary)."""
        self._check_propose(context_hidden, root_token)
        logits = self._step(context_hidden.to(self.device, self.dtype), int(root_token))
        self._check_logits(logits, root_token)
        return logits

    def _check_propose(self, context_hidden: torch.Tensor, root_token: int) -> None:
        assert context_hidden.dim() == 2, context_hidden.shape  # [T_new, F]
        c, t_new = self.config, int(context_hidden.shape[0])
        if context_hidden.shape[1] != c.context_features:
            raise ValueError(
                f"context_hidden has {context_hidden.shape[1]} features; the drafter expects "
                f"{c.context_features} ({len(c.target_layer_ids)} target layers x {c.hidden_size})"
            )
        if not self.seen and not t_new:
            raise ValueError(
                "propose() needs context: the first call must carry the prompt's hidden states"
            )
        if not 0 <= int(root_token) < c.vocab_size:
            raise ValueError(
                f"root_token={root_token} outside the vocabulary 0..{c.vocab_size - 1}"
            )

    def _check_logits(self, logits: torch.Tensor, root_token: int) -> None:
        if self.check_finite:
            check_finite(
                logits,
                lambda: (
                    f"drafter {self.info.name}: NaN/inf logits for the block after {self.seen} "
                    f"context tokens (root {root_token}); stopping instead of drafting garbage"
                ),
            )

    def batches_with(self, other) -> bool:
        """Whether ``other`` can propose in one forward with this drafter (:meth:`propose_many`):
        a drafter of the same modules and draft vocabulary (a :meth:`fork`) in the same engine
        mode. The joint forward runs eagerly in either mode (its widths vary with the rows;
        reading the weights once for every row is what it is for); each drafter's cache stays
        what its own compiled proposes read."""
        return (
            isinstance(other, DFlashDrafter)
            and other.model is self.model
            and other.draft_head is self.draft_head
            and self.engine.mode == other.engine.mode
        )

    @staticmethod
    @torch.inference_mode()
    def propose_many(
        drafters: list[DFlashDrafter],
        contexts: list[torch.Tensor],  # per drafter [T_new, F]: as propose's context_hidden
        roots: list[int],
    ) -> list[torch.Tensor]:
        """``d.propose(context, root)`` of every drafter (forks of one: :meth:`batches_with`)
        in one forward: the new context rows of all appended to each one's cache by one
        projection, then the R blocks against their own contexts, padded to the longest and
        masked (``DFlashModel.block_hidden``'s batched form), then one head over the R
        blocks. Per drafter, logits [B-1, K]."""
        first = drafters[0]
        model, c, b, device = first.model, first.config, first.block_size, first.device
        for d, ctx, root in zip(drafters, contexts, roots, strict=True):
            d._check_propose(ctx, root)
        new = [int(x.shape[0]) for x in contexts]
        if sum(new):  # the new context rows of every drafter, projected together
            rows = torch.cat(contexts).to(device, first.dtype)[None]  # [1, sum T, F]
            slots = torch.cat(
                [
                    d.seen + torch.arange(t, device=device)
                    for d, t in zip(drafters, new, strict=True)
                ]
            )
            kv = model.context_kv(model.context(rows), slots[None])  # per layer [1, kvh, sum T, D]
            at = 0
            for d, t in zip(drafters, new, strict=True):
                d._ensure(d.seen + t + b)
                for layer, (k, v) in enumerate(kv):
                    d._k[layer, d.seen : d.seen + t] = k[0, :, at : at + t].transpose(0, 1)
                    d._v[layer, d.seen : d.seen + t] = v[0, :, at : at + t].transpose(0, 1)
                d.seen += t
                at += t
        ends = torch.tensor([d.seen for d in drafters], device=device)  # [R]: each root's slot
        longest = int(ends.max())
        r = len(drafters)
        contexts_kv = []
        for layer in range(c.num_hidden_layers):
            k = first._k.new_zeros(r, longest, *first._k.shape[2:])  # [R, C, kvh, D]
            v = torch.zeros_like(k)
            for i, d in enumerate(drafters):
                k[i, : d.seen] = d._k[layer, : d.seen]
                v[i, : d.seen] = d._v[layer, : d.seen]
            contexts_kv.append((k.transpose(1, 2), v.transpose(1, 2)))  # [R, kvh, C, D]
        block_positions = ends[:, None] + torch.arange(b, device=device)  # [R, B]
        context_positions = torch.arange(longest, device=device).expand(r, longest)
        keys = torch.cat([context_positions, block_positions], 1)  # [R, C + B]
        visible = torch.cat(
            [context_positions < ends[:, None], torch.ones(r, b, dtype=torch.bool, device=device)],
            1,
        )[:, None, None].expand(r, 1, b, longest + b)  # [R, 1, B, C + B]
        ids = torch.full((r, b), c.mask_token_id, dtype=torch.int64, device=device)
        ids[:, 0] = torch.tensor(roots, device=device)
        emb = first.embed_tokens(ids).to(first.dtype) * c.input_embedding_scale
        hidden = model.block_hidden(emb, block_positions, contexts_kv, keys, visible)
        logits = model.logits(hidden[:, 1:], first.draft_head)  # [R, B-1, K]
        out = list(logits.unbind(0))
        for d, lg, root in zip(drafters, out, roots, strict=True):
            d._check_logits(lg, root)
        return out

    @torch.inference_mode()
    def propose_at(
        self,
        context_hidden: torch.Tensor,  # [C, F] target hidden states of tokens 0..C-1
        root_tokens: torch.Tensor,  # [R] int64
        root_positions: torch.Tensor,  # [R] int64, each in 1..C
    ) -> torch.Tensor:
        """Many blocks in one forward, independent of this drafter's cache: block r is
        ``[root_tokens[r], MASK x (B-1)]`` at positions ``p..p+B-1`` (``p = root_positions[r]``)
        and sees the context ``0..p-1`` and its own block, as :meth:`propose` drafts it after
        committing tokens ``0..p-1``. Returns logits [R, B-1, V].

        The R blocks are one row of ``R * B`` queries against the context followed by every
        block, under a block-structured mask (example, B = 2, roots at 1 and 2: the queries
        at 1, 2 see context 0 and keys 1, 2; the queries at 2, 3 see context 0, 1 and keys
        2, 3), so a recorder drafts every position of a sequence in a few forwards."""
        c, b = self.config, self.config.block_size
        roots = root_positions.to(self.device, torch.int64)  # [R]
        r = int(roots.shape[0])
        ctx_len = int(roots.max()) if r else 0
        if r == 0 or int(roots.min()) < 1 or ctx_len > context_hidden.shape[0]:
            raise ValueError(
                f"root_positions must be non-empty and in 1..{context_hidden.shape[0]} (the "
                f"context rows), got {root_positions.tolist()[:8]}"
            )
        if not bool(((root_tokens >= 0) & (root_tokens < c.vocab_size)).all()):
            raise ValueError(f"root_tokens outside the vocabulary 0..{c.vocab_size - 1}")
        ctx_positions = torch.arange(ctx_len, device=self.device)[None]  # [1, C]
        feats = self.model.context(context_hidden[:ctx_len].to(self.device, self.dtype)[None])
        ids = torch.full((r, b), c.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = root_tokens.to(self.device)
        positions = (roots[:, None] + torch.arange(b, device=self.device)).view(1, r * b)
        emb = self.embed_tokens(ids.view(1, r * b)).to(self.dtype) * c.input_embedding_scale
        block_of = torch.arange(r, device=self.device).repeat_interleave(b)  # [R*B]
        sees_context = ctx_positions[0][None, :] < roots.repeat_interleave(b)[:, None]
        own_block = block_of[:, None] == block_of[None, :]  # [R*B, R*B]
        visible = torch.cat([sees_context, own_block], 1)[None, None]  # [1, 1, R*B, C+R*B]
        kv = self.model.context_kv(feats, ctx_positions)
        keys = torch.cat([ctx_positions, positions], 1)  # [1, C + R*B]
        hidden = self.model.block_hidden(emb, positions, kv, keys, visible)
        logits = self.model.logits(hidden.view(r, b, -1)[:, 1:], self.lm_head)  # [R, B-1, V]
        if self.check_finite:
            check_finite(
                logits, lambda: f"drafter {self.info.name}: NaN/inf logits in a batch of {r} blocks"
            )
        return logits

    def _step(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        """One propose through the runner the engine mode picked (one input pipeline and one
        forward, :func:`_draft_step`, for both)."""
        return self._runner.step(context_hidden, root_token)

    def run_forward(
        self,
        forward,
        context: torch.Tensor,  # [1, T, F] new context rows
        end: int,  # seen + the real new rows: the root's slot
        keys: int,  # slots attended over
        root_token: int,
        masked: bool,  # keys past the block hidden (padded inputs)
    ) -> torch.Tensor:
        """Fill the step's inputs, call ``forward`` (:func:`_draft_step`, eager or compiled)
        and count the new rows as seen. Returns logits [B-1, K] (K = V without a draft
        vocabulary)."""
        self._seen_t.fill_(self.seen)
        self._block_start.fill_(end)
        self._block[0, 0] = root_token
        key_positions = self._key_positions(keys)
        if masked:
            key_positions = mark_key_dim(key_positions)
        logits = forward(
            self.model,
            self.embed_tokens,
            self.draft_head,
            context,
            self._seen_t,
            self._block,
            self._block_start,
            key_positions,
            self._k,
            self._v,
            masked=masked,
        )
        self.seen = end
        return logits

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def _ensure(self, needed: int) -> None:
        """Grow the cache buffers (geometrically) to at least ``needed`` slots."""
        have = self._k.shape[1]
        if needed <= have:
            return
        size = max(needed, 2 * have)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], size, *old.shape[2:])
            grown[:, : self.seen] = old[:, : self.seen]
            setattr(self, name, grown)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        target,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> DFlashDrafter:
        """Load a z-lab-format directory (config.json + safetensors) for ``target``, whose
        embedding and LM head it shares. ``dtype``/``device`` None: the target's. Its config is
        not checked against the target here: ``ddtree.models.load_drafter`` checks it first
        (``ddtree.models.loading.compat.check_drafter_compat``, once per load)."""
        from ddtree.models.loading.checkpoint import load_safetensors, match_state_dict, read_config
        from ddtree.models.nn.linear import prepare_linears

        path = Path(path)
        raw = read_config(path)
        config = DFlashConfig.from_dict(raw, str(path / "config.json"))
        dtype = dtype or target.dtype
        device = device or target.device
        with torch.device("meta"):
            model = DFlashModel(config)
        tensors = load_safetensors(path)
        # published drafters may carry the target's embedding/head copies: not ours to load
        tensors = {
            k: v for k, v in tensors.items() if not k.startswith(("embed_tokens.", "lm_head."))
        }
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        match_state_dict(expected, tensors, str(path))
        model = model.to_empty(device=device)
        model.load_state_dict(tensors)
        drafter = cls(model.to(dtype), target.embed_tokens, target.lm_head, name=path.name)
        prepare_linears(drafter)
        return drafter

    def block_logits(self, context_hidden, block_ids, **positions) -> torch.Tensor:
        """:meth:`DFlashModel.block_logits` with this drafter's shared embedding and LM head:
        context_hidden [R, C, F], block_ids [R, B] -> [R, B-1, V]."""
        return self.model.block_logits(
            context_hidden.to(self.device, self.dtype),
            block_ids.to(self.device),
            self.embed_tokens,
            self.lm_head,
            **positions,
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Write a z-lab format directory: config.json + model.safetensors (the drafter's own
        tensors; no embedding or LM head)."""
        from ddtree.models.loading.checkpoint import save_safetensors

        save_safetensors(path, self.model.state_dict(), self.config.to_dict())


class EagerDraftStep:
    """Eager proposes of a :class:`DFlashDrafter`: the new context rows and the keys at their
    exact counts."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter

    def step(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        d = self.drafter
        end = d.seen + int(context_hidden.shape[0])
        keys = end + d.block_size
        d._ensure(keys)
        return d.run_forward(_draft_step, context_hidden[None], end, keys, root_token, False)


class CompiledDraftStep:
    """Compiled proposes of a :class:`DFlashDrafter`: one graph of static shapes. It only
    pads: the new context to B rows (a longer one, the prompt, appended eagerly first), the
    keys to a whole bucket, hiding what is padded."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.forward = CompiledForward(_draft_step, drafter.device)

    def warm_up(self) -> float:
        """Compile the graph; returns the seconds that took."""
        d = self.drafter
        return self.forward.warm_up(lambda: self.step(d._context[0, :1], 0))

    def step(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        d, b = self.drafter, self.drafter.block_size
        if context_hidden.shape[0] > b:
            head = context_hidden[:-b]
            d._ensure(d.seen + head.shape[0])
            d._seen_t.fill_(d.seen)
            _append_context(d.model, head[None], d._seen_t, d._k, d._v)
            d.seen += int(head.shape[0])
            context_hidden = context_hidden[-b:]
        t_new = int(context_hidden.shape[0])
        end = d.seen + t_new
        keys = kv_bucket(end + b)
        d._ensure(keys)
        d._context[0, :t_new] = context_hidden
        d._context[0, t_new:] = 0
        cache_input(d._k, capacity_dim=1)
        cache_input(d._v, capacity_dim=1)
        return d.run_forward(self.forward, d._context, end, keys, root_token, True)


def _append_context(
    model: DFlashModel,
    context_hidden: torch.Tensor,  # [1, T, F] target hidden states of the new context rows
    start: torch.Tensor,  # [] int64: their first slot (= position)
    k_cache: torch.Tensor,  # [L, capacity, kv_heads, D]
    v_cache: torch.Tensor,
) -> None:
    """Write the context keys/values of T rows at slots ``start .. start+T-1``."""
    slots = start + torch.arange(context_hidden.shape[1], device=context_hidden.device)
    for layer, (k, v) in enumerate(model.context_kv(model.context(context_hidden), slots[None])):
        CacheView(k_cache, v_cache, layer, slots, 0).store(k, v)


def _draft_step(
    model: DFlashModel,
    embed_tokens: nn.Module,
    lm_head: nn.Module,
    context_hidden: torch.Tensor,  # [1, T, F] new context rows (compiled: padded to B)
    context_start: torch.Tensor,  # [] int64: slot of the first new context row (= seen)
    block_ids: torch.Tensor,  # [1, B] int64: [root, MASK x (B-1)]
    block_start: torch.Tensor,  # [] int64: the root's slot and position (seen + real rows)
    key_positions: torch.Tensor,  # [K] int64: 0..K-1, the slots attended over
    k_cache: torch.Tensor,  # [L, capacity, kv_heads, D]
    v_cache: torch.Tensor,
    masked: bool,
) -> torch.Tensor:
    """One propose, eager or compiled: append the context rows, write the block's rows right
    after the real ones (over any padding), attend over slots ``0..K-1`` (``masked``: keys
    past the block hidden). Slot = position, so windowed/causal masks read the slots.
    Returns logits [B-1, V], or [B-1, K] when ``lm_head`` is a draft vocabulary's head."""
    _append_context(model, context_hidden, context_start, k_cache, v_cache)
    b = block_ids.shape[1]
    block_positions = (block_start + torch.arange(b, device=block_ids.device))[None]  # [1, B]
    emb = embed_tokens(block_ids).to(k_cache.dtype) * model.config.input_embedding_scale
    n_keys = key_positions.shape[0]
    views = [
        CacheView(k_cache, v_cache, layer, block_positions[0], n_keys)
        for layer in range(k_cache.shape[0])
    ]
    valid = (key_positions < block_start + b)[None, None, None] if masked else None  # [1,1,1,K]
    hidden = model.block_hidden(emb, block_positions, views, key_positions[None], valid)
    return model.logits(hidden[0, 1:], lm_head)  # [B-1, the head's rows]
