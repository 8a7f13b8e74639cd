"""Model shapes of the checkpoints users run, for timing at real sizes with random weights
(``ddtree bench shapes --preset NAME``): each preset is a data file
(``ddtree/assets/presets/NAME.json``) holding the target's published ``config.json`` fields,
the DFlash drafter of that target's layout, and where each came from.

Speed does not depend on the weights, acceptance does: random weights give the real cost of a
step, and the acceptance comes from the synthetic oracle drafter (``ddtree.models.oracle``).
A shape that does not fit in memory is refused before anything is allocated, naming the sizes.

Random targets are built to decode deterministically in bfloat16. Plain N(0, 0.02) weights
give near-flat next-token distributions (the top two logits of 151,936 a few hundredths
apart), so the rounding difference between a one-token and a 33-token forward flips the
greedy token every few steps, and no decode can match another. Here the embedding dominates
the residual stream (N(0, 1); each layer's output projections N(0, 0.002)) and the LM head is
a row permutation of the embedding (untied, whatever the published config says: the bytes a
step reads are the same), so the greedy continuation walks that permutation with logit
margins of hundreds: every layer still runs at full cost, and the decode is exact.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch

from ddtree.models.loading.memory import available_bytes
from ddtree.models.nn.linear import prepare_linears

PRESET_DIR = Path(str(files("ddtree") / "assets" / "presets"))
INIT_STD = 0.02  # N(0, 0.02) as transformers' initializer_range; norms 1
EMBED_STD = 1.0  # the embedding dominates the residual stream (see the module docstring)
OUTPUT_STD = 0.002  # residual-output projections: each layer adds a little to the stream
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")
# activation headroom of one forward, beyond weights and caches: logits [M, V] in float32 a
# few times over (the forward's, the softmax/top-k copies) and a layer's intermediates
ACTIVATION_COPIES = 4


class PresetError(ValueError):
    """An unknown preset, or a shape that does not fit the memory available."""


@dataclass(frozen=True)
class Preset:
    name: str
    target: dict  # a Hugging Face config.json
    drafter: dict  # a z-lab-format DFlash config.json
    sources: dict  # "target" / "drafter" -> where the shape came from

    @classmethod
    def load(cls, name: str) -> Preset:
        file = PRESET_DIR / f"{name}.json"
        if not file.is_file():
            raise PresetError(f"preset {name!r}: expected one of {', '.join(preset_names())}")
        data = json.loads(file.read_text(encoding="utf-8"))
        return cls(data["name"], data["target"], data["drafter"], data["sources"])


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one run of a preset needs (target, drafter, caches, one forward's activations)."""

    target_bytes: int
    drafter_bytes: int
    cache_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.target_bytes + self.drafter_bytes + self.cache_bytes + self.activation_bytes

    def describe(self) -> str:
        gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
        return (
            f"{gb(self.total_bytes)} (target {gb(self.target_bytes)}, drafter "
            f"{gb(self.drafter_bytes)}, caches {gb(self.cache_bytes)}, activations "
            f"{gb(self.activation_bytes)})"
        )


def _meta_params(build: Callable[[], torch.nn.Module]) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def memory_plan(preset: Preset, dtype: torch.dtype, max_len: int, max_width: int) -> MemoryPlan:
    """What a run of ``max_len`` positions with verify widths up to ``max_width`` allocates."""
    from ddtree.models.nn.decoder import DecoderModel
    from ddtree.models.nn.dflash import DFlashConfig, DFlashModel

    target = random_target_config(preset)
    drafter = DFlashConfig.from_dict(preset.drafter, source=f"preset {preset.name} drafter")
    size = dtype.itemsize
    kv = 2 * target.num_hidden_layers * target.num_key_value_heads * target.head_dim * max_len
    kv += 2 * drafter.num_hidden_layers * drafter.num_key_value_heads * drafter.head_dim * max_len
    logits = max_width * target.vocab_size * 4 * ACTIVATION_COPIES
    hidden = max_width * max(target.intermediate_size, target.hidden_size * 4) * size * 8
    return MemoryPlan(
        target_bytes=_meta_params(lambda: DecoderModel(target)) * size,
        drafter_bytes=_meta_params(lambda: DFlashModel(drafter)) * size,
        cache_bytes=kv * size,
        activation_bytes=logits + hidden,
    )


def check_fits(plan: MemoryPlan, device: torch.device, what: str) -> None:
    have = available_bytes(device)
    if have is None:
        raise PresetError("cannot tell the memory available: no MemAvailable in /proc/meminfo")
    if plan.total_bytes > have:
        raise PresetError(
            f"{what} needs {plan.describe()}; {device} has {have / 1e9:.2f} GB available: "
            f"choose a smaller preset, a smaller dtype or shorter contexts"
        )


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, progress: Callable[[int], None] | None = None):
    """Random weights in place: norms 1, residual-output projections N(0, OUTPUT_STD), the
    rest N(0, INIT_STD); ``progress(numel)`` after each tensor."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            std = OUTPUT_STD if name.endswith(OUTPUT_PROJECTIONS) else INIT_STD
            p.normal_(0.0, std, generator=gen)
        if progress is not None:
            progress(p.numel())
    return model


@torch.no_grad()
def make_peaked(model, seed: int) -> None:
    """The embedding N(0, EMBED_STD) and the LM head a row permutation of it (module
    docstring): greedy decoding with large logit margins."""
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    gen = torch.Generator(device=embed.device).manual_seed(seed + 1)
    embed.normal_(0.0, EMBED_STD, generator=gen)
    head.copy_(embed[torch.randperm(embed.shape[0], generator=gen, device=embed.device)])


def random_target_config(preset: Preset):
    """The decoder config of the preset's random target: the published shape, untied."""
    from ddtree.models.nn.decoder import DecoderConfig

    untied = {**preset.target, "tie_word_embeddings": False}
    return DecoderConfig.from_hf(untied, source=f"preset {preset.name}")


def random_target(preset: Preset, dtype, device, capacity: int, seed: int = 0, progress=None):
    """The preset's target as our decoder with random weights that decode deterministically
    (module docstring; ``progress`` as :func:`randomize`)."""
    from ddtree.models.adapters.decoder import DecoderTarget
    from ddtree.models.nn.decoder import DecoderModel

    config = random_target_config(preset)
    with torch.device("meta"):
        model = DecoderModel(config).to(dtype)  # allocated once, in dtype
    model = model.to_empty(device=device)
    model.model.rotary_emb.reset_inv_freq()
    randomize(model, seed, progress)
    make_peaked(model, seed)
    target = DecoderTarget(model, name=f"random-{preset.name}", capacity=capacity)
    prepare_linears(target)
    return target


def random_drafter(
    preset: Preset, target, seed: int = 1, progress=None, draft_vocab: int | None = None
):
    """The preset's DFlash drafter, random weights, on ``target``'s embedding and LM head.
    ``draft_vocab`` K: its proposes compute K rows of the head (``ddtree.models.adapters.draft_vocab``);
    a random target has no corpus, so every count is equal and the K are its EOS tokens and
    the smallest ids: the head's cost is real, which tokens it keeps is arbitrary."""
    from ddtree.models.adapters.draft_vocab import draft_vocab_ids

    vocab = target.info.vocab_size
    zeros = lambda: torch.zeros(vocab, dtype=torch.int64)  # noqa: E731
    # a shrunk preset (tiny-qwen3) keeps its family's EOS ids past its small vocabulary
    eos = [t for t in target.info.eos_token_ids if t < vocab]
    ids = draft_vocab_ids(draft_vocab, vocab, zeros, eos)
    from ddtree.models.adapters.dflash import DFlashDrafter
    from ddtree.models.loading.compat import check_drafter_compat
    from ddtree.models.nn.dflash import DFlashConfig, DFlashModel

    check_drafter_compat(preset.drafter, target.info, f"preset {preset.name} drafter")
    config = DFlashConfig.from_dict(preset.drafter, source=f"preset {preset.name} drafter")
    with torch.device("meta"):
        model = DFlashModel(config).to(target.dtype)
    model = model.to_empty(device=target.device)
    randomize(model, seed, progress)
    drafter = DFlashDrafter(
        model,
        target.embed_tokens,
        target.lm_head,
        name=f"random-{preset.name}-dflash",
        draft_tokens=ids,
    )
    prepare_linears(drafter)
    return drafter
