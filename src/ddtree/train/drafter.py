"""Train the bundled DFlash drafter on the frozen bundled target.

Recipe: the target regenerates the data (greedy continuations of corpus prompts, see
``ddtree.train.data``); its hidden states at ``target_layer_ids`` are computed once for every
sequence. Each step takes ``seqs_per_step`` sequences and ``anchors_per_step`` random anchor
positions ``a`` inside the generated part; for each anchor the block is
``[token a, MASK x (B-1)]`` after the context ``0..a-1`` and the loss is the cross-entropy on
tokens ``a+1 .. a+B-1``, position ``j`` (1-based) weighted by ``exp(-(j-1)/gamma)`` (early
positions decide acceptance, so they matter most). The context keys/values of a sequence are
computed once per step and sliced per anchor, as the decoding drafter's cache would hold them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.files import publish, replace_atomically, staging_folder
from ddtree.train.config import DrafterTrainConfig
from ddtree.train.corpus import (
    corpus_fingerprint,
    encode_stream,
    heldout_prompts,
    list_corpus,
    read_texts,
)
from ddtree.train.data import SEQUENCES_FILE, build_sequences, load_sequences, save_sequences
from ddtree.train.loop import adamw, train_steps
from ddtree.train.progress import train_progress
from ddtree.train.state import TrainState, check_checkpoint, load_checkpoint
from ddtree.train.tokenizer import EOS_TOKEN, MASK_TOKEN, load_tokenizer, special_id

EXPORT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class DrafterShape:
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (1, 3)  # decoder-layer indices of the target
    rope_theta: float = 10000.0


@dataclass
class DrafterTrainResult:
    out: Path
    steps: int
    losses: list[float]
    elapsed_s: float
    n_params: int
    mean_tau: float  # greedy, eval_budget, on held-out prompts (nan when stopped early)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B-1] float, normalised to sum 1: exp(-(j-1)/gamma) for j = 1..B-1."""
    w = torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)
    return w / w.sum()


def load_frozen_target(target_dir: Path):
    from transformers import AutoModelForCausalLM

    from ddtree.models.adapters.hf import quiet_transformers
    from ddtree.models.loading.checkpoint import CONFIG_NAME, read_config, refuse_custom_code

    refuse_custom_code(Path(target_dir) / CONFIG_NAME, read_config(target_dir))
    with quiet_transformers():  # no progress bar: a refused resume after it is one line
        model = AutoModelForCausalLM.from_pretrained(
            str(target_dir), dtype=torch.float32, trust_remote_code=False
        )
    model.eval().requires_grad_(False)
    return model


@torch.no_grad()
def target_hidden(model, sequences: torch.Tensor, layer_ids, batch: int = 32) -> torch.Tensor:
    """[S, T] -> [S, T, n_layers * H] float32: hidden states after the listed decoder layers
    (transformers' ``hidden_states[id + 1]``; the last layer's is after the final norm)."""
    out = []
    for begin in range(0, sequences.shape[0], batch):
        hs = model(input_ids=sequences[begin : begin + batch], output_hidden_states=True)
        out.append(torch.cat([hs.hidden_states[i + 1] for i in layer_ids], -1))
    return torch.cat(out)


def drafter_config(shape: DrafterShape, target_config, mask_id: int):
    from ddtree.models.nn.dflash import DFlashConfig

    return DFlashConfig(
        hidden_size=target_config.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        vocab_size=target_config.vocab_size,
        block_size=shape.block_size,
        mask_token_id=mask_id,
        target_layer_ids=list(shape.target_layer_ids),
        num_target_layers=target_config.num_hidden_layers,
        rope_theta=shape.rope_theta,
        max_position_embeddings=target_config.max_position_embeddings,
    )


def _init_weights(model) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)


def step_loss(model, target, seqs, hidden, anchors, mask_id, weights) -> tuple[torch.Tensor, float]:
    """Weighted block loss over ``anchors`` (list of positions shared by all rows).

    seqs [R, T] int64, hidden [R, T, F]; returns (loss, top-1 accuracy at block position 1).
    """
    r, t = seqs.shape
    b = weights.shape[0] + 1
    positions = torch.arange(t).expand(r, t)
    feats = model.context(hidden)  # [R, T, H]
    kv = model.context_kv(feats, positions)  # per layer [R, kv_heads, T, D]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    total, correct = 0.0, 0
    for a in anchors:
        block = torch.full((r, b), mask_id, dtype=torch.int64)
        block[:, 0] = seqs[:, a]
        emb = embed(block)
        kv_a = [(k[:, :, :a], v[:, :, :a]) for k, v in kv]
        h = model.block_hidden(emb, torch.arange(a, a + b).expand(r, b), kv_a)
        logits = model.logits(h[:, 1:], head)  # [R, B-1, V]
        labels = seqs[:, a + 1 : a + b]  # [R, B-1]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        total = total + (ce.view(r, b - 1) * weights).sum(-1).mean()
        correct += int((logits[:, 0].argmax(-1) == labels[:, 0]).sum())
    return total / len(anchors), correct / (r * len(anchors))


def check_drafter_inputs(cfg: DrafterTrainConfig, shape: DrafterShape, target_dir: Path) -> None:
    """What would fail after minutes of regenerating sequences, refused before any work: too
    few new tokens for a block anchored in the generated part, a target with fewer decoder
    layers than the drafter reads, sequences longer than the target's positions."""
    from ddtree.models.loading.checkpoint import CONFIG_NAME, read_config

    need = shape.block_size - 1  # anchors a in [prompt_len - 1, seq_len - block_size]
    if cfg.new_tokens < need:
        raise ValueError(
            f"--new-tokens {cfg.new_tokens}: a block of {shape.block_size} anchored in the "
            f"generated part needs at least {need} new tokens per sequence"
        )
    config = read_config(target_dir)
    where = f"--target {Path(target_dir) / CONFIG_NAME}"
    layers = config.get("num_hidden_layers")
    ids = list(shape.target_layer_ids)
    if not isinstance(layers, int) or layers <= max(ids):
        raise ValueError(
            f"{where}: num_hidden_layers={layers!r}; the drafter reads the target's hidden "
            f"states after layers {ids}, so it needs an integer >= {max(ids) + 1}"
        )
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and cfg.prompt_len + cfg.new_tokens > positions:
        raise ValueError(
            f"--new-tokens {cfg.new_tokens}: sequences of {cfg.prompt_len} + {cfg.new_tokens} "
            f"tokens pass the target's max_position_embeddings={positions} ({where})"
        )


def train_drafter(
    cfg: DrafterTrainConfig,
    target_dir: Path,
    out: Path,
    shape: DrafterShape = DrafterShape(),
    resume: bool = False,
    show_progress: bool = True,
    stop_at: int | None = None,
) -> DrafterTrainResult:
    from ddtree.models.nn.dflash import DFlashModel

    target_dir, out = Path(target_dir), Path(out)
    if resume:  # a broken checkpoint is refused before anything is read or written
        check_checkpoint(out)
    check_drafter_inputs(cfg, shape, target_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(target_dir)
    eos_id, mask_id = special_id(tok, EOS_TOKEN), special_id(tok, MASK_TOKEN)
    split = list_corpus(max_files=cfg.max_files)
    target = load_frozen_target(target_dir)

    with train_progress(disable=not show_progress) as bar:
        # the training text's token ids: the sequences' prompts, and the drafter's token counts
        # (--draft-vocab), a few seconds for the stdlib
        stream = encode_stream(tok, read_texts(split.train), eos_id)
        if (out / SEQUENCES_FILE).is_file() and resume:
            sequences, prompt_len = load_sequences(out)
        else:
            gen_task = bar.add_task("regenerate", total=cfg.n_sequences, loss="-", rate="")
            sequences = build_sequences(
                target,
                stream,
                cfg.n_sequences,
                cfg.prompt_len,
                cfg.new_tokens,
                seed=cfg.seed + 17,
                batch_size=cfg.gen_batch,
                on_batch=lambda n: bar.advance(gen_task, n),
            )
            prompt_len = cfg.prompt_len
            save_sequences(out, sequences, prompt_len)
        hidden = target_hidden(target, sequences, shape.target_layer_ids)  # [S, T, F]

        torch.manual_seed(cfg.seed)
        model = DFlashModel(drafter_config(shape, target.config, mask_id)).float().train()
        _init_weights(model)
        opt = adamw(model, cfg.lr, cfg.weight_decay)
        run_config = {"train": asdict(cfg), "shape": asdict(shape), "target": str(target_dir)}
        run_config["shape"]["target_layer_ids"] = list(shape.target_layer_ids)
        state = load_checkpoint(out, model, opt, run_config) if resume else TrainState()

        weights = position_weights(shape.block_size, cfg.loss_gamma)
        n_seq, seq_len = sequences.shape
        first_anchor, last_anchor = prompt_len - 1, seq_len - shape.block_size

        def anchored_loss(step: int) -> tuple[torch.Tensor, float]:
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            rows = torch.randint(0, n_seq, (cfg.seqs_per_step,), generator=gen)
            anchors = torch.randint(
                first_anchor, last_anchor + 1, (cfg.anchors_per_step,), generator=gen
            ).tolist()
            return step_loss(
                model, target, sequences[rows], hidden[rows], anchors, mask_id, weights
            )

        train_steps(
            "drafter", model, opt, cfg, state, (out, run_config), bar, anchored_loss,
            lambda _state, acc: f"acc@1 {acc:.3f}", stop_at,
        )  # fmt: skip

    n_params = sum(p.numel() for p in model.parameters())
    if state.step < cfg.steps:
        return DrafterTrainResult(
            out, state.step, state.losses, state.elapsed_s, n_params, math.nan
        )
    from ddtree.models.adapters.draft_vocab import token_counts

    counts = token_counts([stream], target.config.vocab_size)
    where = json.dumps(corpus_fingerprint(split), sort_keys=True)
    export_drafter(model, target, out, (counts, f"train split of the drafter's corpus {where}"))
    mean_tau = evaluate_drafter(target_dir, out, cfg, split, tok, eos_id)
    meta = {
        **run_config,
        "losses": state.losses,
        "elapsed_s": state.elapsed_s,
        "mean_tau": mean_tau,
    }
    with replace_atomically(out / "train_meta.json") as partial:
        partial.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return DrafterTrainResult(out, state.step, state.losses, state.elapsed_s, n_params, mean_tau)


def export_drafter(model, target, out: Path, counts: tuple | None = None) -> None:
    """config.json (z-lab DFlash format) + model.safetensors in bfloat16, and with ``counts``
    (token counts [V] int64, what they count) ``draft_vocab.safetensors`` (``--draft-vocab``)."""
    import copy

    from ddtree.models.adapters.dflash import DFlashDrafter
    from ddtree.models.adapters.draft_vocab import save_token_counts

    export = copy.deepcopy(model).to(EXPORT_DTYPE)
    drafter = DFlashDrafter(export, target.get_input_embeddings(), target.get_output_embeddings())
    with staging_folder(out) as stage:  # both files in place together, or none of the new
        drafter.save_pretrained(stage)
        if counts is not None:
            save_token_counts(stage, *counts)
        publish(stage, Path(out))


def evaluate_drafter(target_dir, drafter_dir, cfg: DrafterTrainConfig, split, tok, eos_id) -> float:
    """Mean greedy tau of the exported pair on held-out prompts (our MLA+MoE target)."""
    from ddtree.models import load_drafter
    from ddtree.models.adapters.mla_moe import MlaMoeTarget
    from ddtree.train.eval import greedy_acceptance

    target = MlaMoeTarget.from_pretrained(target_dir)
    drafter = load_drafter(drafter_dir, target)
    stream = encode_stream(tok, read_texts(split.heldout), eos_id)
    prompts = heldout_prompts(
        stream, cfg.eval_prompts, cfg.prompt_len, seed=cfg.seed + 99, eos_id=eos_id
    )
    result = greedy_acceptance(target, drafter, prompts, cfg.eval_budget, cfg.eval_new_tokens)
    return result.mean_tau
