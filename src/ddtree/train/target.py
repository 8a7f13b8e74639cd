"""Train the bundled tiny Kimi-K2-style target (MLA + MoE, Hugging Face DeepseekV3 format).

Trained with transformers' ``DeepseekV3ForCausalLM`` (batched, autograd-ready; our
``MlaMoeModel`` is golden-tested against it and loads the result). The router's correction
bias is updated without gradients, as DeepSeek-V3's auxiliary-loss-free balancing: after every
step each expert's bias moves by ``bias_update_rate`` towards the mean load
(up when under-loaded, down when over-loaded).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ddtree.files import publish, staging_folder
from ddtree.train.config import TargetTrainConfig
from ddtree.train.corpus import (
    corpus_fingerprint,
    encode_stream,
    list_corpus,
    read_texts,
    sample_windows,
)
from ddtree.train.loop import adamw, train_steps
from ddtree.train.progress import train_progress
from ddtree.train.state import TrainState, check_checkpoint, load_checkpoint
from ddtree.train.tokenizer import (
    EOS_TOKEN,
    load_tokenizer,
    save_tokenizer,
    special_id,
    train_tokenizer,
)

EXPORT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class TargetShape:
    """A tiny Kimi-K2 look-alike: 1 dense layer then MoE layers, one expert group, MLA with
    q and kv LoRA, sigmoid router with correction bias, one shared expert."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 512  # the dense first layer
    moe_intermediate_size: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 32
    qk_nope_head_dim: int = 32
    v_head_dim: int = 64
    max_position_embeddings: int = 2048
    routed_scaling_factor: float = 2.5


@dataclass
class TargetTrainResult:
    out: Path
    steps: int
    losses: list[float]  # mean train loss per log interval
    heldout_loss: float
    elapsed_s: float
    n_params: int


def hf_config(shape: TargetShape, vocab_size: int, eos_id: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        num_key_value_heads=shape.num_attention_heads,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        rope_interleave=True,
        tie_word_embeddings=False,
        **asdict(shape),
    )


class _LoadCounter:
    """Counts how many tokens each MoE layer's router sends to each expert (forward hooks)."""

    def __init__(self, model) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = [torch.zeros(r.num_experts) for r in self.routers]
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(_module, _inputs, output) -> None:
            ids = output[2]  # [tokens, k] chosen experts
            self.counts[i] += torch.bincount(ids.reshape(-1), minlength=self.counts[i].numel())

        return hook

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        for r, c in zip(self.routers, self.counts, strict=True):
            r.e_score_correction_bias += rate * torch.sign(c.mean() - c)
            c.zero_()


def prepare_tokenizer(out: Path, texts: list[str], vocab_size: int, resume: bool):
    if resume and (out / "tokenizer.json").is_file():
        return load_tokenizer(out)
    tok = train_tokenizer(texts, vocab_size)
    save_tokenizer(tok, out)
    return tok


def train_target(
    cfg: TargetTrainConfig,
    out: Path,
    shape: TargetShape = TargetShape(),
    resume: bool = False,
    show_progress: bool = True,
    stop_at: int | None = None,
) -> TargetTrainResult:
    """Train (or with ``resume`` continue) and export to ``out``. ``stop_at`` ends this run
    after that step with a checkpoint and no export, as an interruption would."""
    from transformers import DeepseekV3ForCausalLM

    out = Path(out)
    if resume:  # a broken checkpoint is refused before anything is read or written
        check_checkpoint(out)
    out.mkdir(parents=True, exist_ok=True)
    split = list_corpus(max_files=cfg.max_files)
    train_texts = read_texts(split.train)
    tok = prepare_tokenizer(out, train_texts, cfg.vocab_size, resume)
    eos_id = special_id(tok, EOS_TOKEN)
    stream = encode_stream(tok, train_texts, eos_id)  # [N]
    heldout = encode_stream(tok, read_texts(split.heldout), eos_id)

    torch.manual_seed(cfg.seed)
    config = hf_config(shape, tok.get_vocab_size(), eos_id)
    config._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(config).float().train()
    counter = _LoadCounter(model)
    # the router's weight is a matrix that is not decayed (its bias is balanced by load)
    opt = adamw(model, cfg.lr, cfg.weight_decay, decays=lambda name: "gate.weight" not in name)
    run_config = {"train": asdict(cfg), "shape": asdict(shape), "corpus": corpus_fingerprint(split)}
    state = load_checkpoint(out, model, opt, run_config) if resume else TrainState()

    def step_loss(step: int) -> tuple[torch.Tensor, float]:
        batch = sample_windows(stream, cfg.batch_size, cfg.seq_len + 1, cfg.seed * 1_000_003 + step)
        # labels are shifted inside the model: position t predicts token t+1
        return model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss, 0.0

    def tokens_per_s(state: TrainState, _metric: float) -> str:
        rate = cfg.batch_size * cfg.seq_len * state.step / max(state.elapsed_s, 1e-9)
        return f"{rate:.0f} tok/s"

    with train_progress(disable=not show_progress) as bar:
        train_steps(
            "target", model, opt, cfg, state, (out, run_config), bar, step_loss, tokens_per_s,
            stop_at, after_step=lambda: counter.update_bias(cfg.bias_update_rate),
        )  # fmt: skip

    model.eval()
    if state.step < cfg.steps:  # stopped early: the checkpoint is the result
        return TargetTrainResult(out, state.step, state.losses, float("nan"), state.elapsed_s, 0)
    heldout_loss = evaluate_loss(model, heldout, cfg)
    export_target(
        model, out, meta={**run_config, "heldout_loss": heldout_loss, "losses": state.losses}
    )
    return TargetTrainResult(
        out=out,
        steps=state.step,
        losses=state.losses,
        heldout_loss=heldout_loss,
        elapsed_s=state.elapsed_s,
        n_params=sum(p.numel() for p in model.parameters()),
    )


@torch.no_grad()
def evaluate_loss(model, stream: torch.Tensor, cfg: TargetTrainConfig) -> float:
    """Mean next-token cross-entropy on fixed windows of ``stream``."""
    windows = sample_windows(stream, cfg.eval_windows, cfg.seq_len, seed=12345)
    losses = [float(model(input_ids=w[None], labels=w[None].clone()).loss) for w in windows]
    return sum(losses) / len(losses)


def export_target(model, out: Path, meta: dict) -> None:
    """config.json + model.safetensors in bfloat16 (router weights and bias stay float32 as
    transformers keeps them) + train_meta.json."""
    import copy

    export = copy.deepcopy(model).to(EXPORT_DTYPE)
    for name, module in export.named_modules():
        if name.endswith("mlp.gate"):
            module.float()
    export.config.architectures = ["DeepseekV3ForCausalLM"]
    with staging_folder(out) as stage:  # all files in place together, or none of the new
        export.save_pretrained(str(stage))
        (stage / "train_meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        publish(stage, Path(out))
