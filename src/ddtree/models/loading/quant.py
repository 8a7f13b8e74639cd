"""Quantized DeepSeek-V3 / Kimi-K2 checkpoints, dequantized on load.

A quantized linear weight ``X.weight`` (logical ``[out, in]``) is stored as a few tensors
named ``X.<part>``; which weights are quantized is read from the checkpoint (those that have
the parts), as the published checkpoints choose it. Two published formats, chosen by
``config.json``'s ``quantization_config`` (registry :data:`QUANT_METHODS`):

``fp8`` (DeepSeek-V3, Kimi-K2-Instruct: ``{"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}``)
    ``X.weight`` float8_e4m3fn ``[out, in]`` and ``X.weight_scale_inv`` float32
    ``[ceil(out/128), ceil(in/128)]``; ``W[i, j] = W_fp8[i, j] * scale_inv[i // 128, j // 128]``
    (the last block of a dimension may be partial). Every linear of the decoder layers is
    quantized; the embedding, norms, router and ``lm_head`` are not.

``compressed-tensors`` with ``format: "pack-quantized"`` (Kimi-K2-Thinking: W4A16, symmetric
int, ``strategy: "group"``, ``group_size: 32``, routed experts only, the rest in ``ignore``)
    ``X.weight_packed`` int32 ``[out, ceil(in/P)]`` with ``P = 32 // num_bits`` values per
    word, ``X.weight_scale`` (bf16) ``[out, ceil(in/group_size)]``, ``X.weight_shape`` int
    ``[2] = (out, in)``. Value ``j`` of a row is bits ``num_bits*(j % P) ..`` of word ``j // P``
    (lowest bits first), stored as ``q + 2**(num_bits-1)``; ``W[i, j] = q * scale[i, j // g]``.
    Worked example, 4 bits: the word ``0x76543210`` holds the stored values 0, 1, ..., 7 for
    columns 0..7, i.e. ``q = -8, -7, ..., -1``.

Products are taken in float32 (the fp8 reference's ``x.float() * s``) and cast once to the
requested dtype; in bfloat16 that equals compressed-tensors' bf16 product. Activations run
unquantized in that dtype (the fp8 checkpoints' dynamic activation quantization is a serving
kernel's choice, not part of the weights). A tensor-parallel rank reads only the blocks (fp8)
or the words and groups (packed) covering its slice of a weight, and dequantizes those.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from ddtree.models.loading.checkpoint import CheckpointError, CheckpointSlices, load_safetensors

WEIGHT = "weight"  # the logical tensor X.weight a quantized group replaces
PACK_WORD_BITS = 32  # pack-quantized stores its values in int32 words
MAX_PACKED_BITS = 8  # compressed-tensors packs widths of 1..8 bits only


class QuantizationError(CheckpointError):
    """A quantized checkpoint that cannot be loaded (names the file, tensor or field)."""


Index = tuple[slice, ...]
Shape = tuple[int, ...]


class QuantScheme(Protocol):
    """How one format stores a linear weight ``[out, in]`` as tensors ``X.<suffix>``.

    ``stored`` lists every suffix of one weight; ``covers(shape)`` maps those read in slices
    to the logical (rows, columns) one of their elements covers: ``(1, 1)`` for fp8 values,
    ``(128, 128)`` for a block scale, ``(1, 8)`` for a word of eight int4 values (the others,
    such as ``weight_shape``, are read whole). A window of a weight aligned to every cover
    reads whole elements of each part.
    """

    description: str  # recorded in ModelInfo.quantization
    data: str  # the suffix holding the quantized values
    data_dtype: torch.dtype
    scale: str  # the suffix of their scales
    stored: tuple[str, ...]

    def covers(self, shape: tuple[int, int]) -> dict[str, tuple[int, int]]: ...

    def logical_shape(self, base: str, shapes: Mapping[str, Shape], read) -> tuple[int, int]:
        """``[out, in]`` of ``base + "weight"`` from its stored parts (``read(name)`` reads a
        whole stored tensor); raises ValueError naming the tensor when they disagree."""

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{suffix: tensor}`` of ``weight`` [out, in] float (what a checkpoint stores)."""

    def dequantize(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]):
        """float32 ``[out, in]`` from the parts of a window of that logical ``shape``."""


# --- fp8 with block scales -------------------------------------------------------------------

# config fmt -> storage dtype (transformers' fine-grained FP8 and DeepSeek-V3 use e4m3 only)
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Fp8Block:
    """fp8 weights with one float32 inverse scale per ``block`` (rows, columns) block."""

    block: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"
    data: ClassVar[str] = WEIGHT
    scale: ClassVar[str] = "weight_scale_inv"

    @classmethod
    def from_config(cls, qc: dict, field: str) -> Fp8Block:
        fmt = qc.get("fmt", "e4m3")
        if fmt not in FP8_FORMATS:
            raise QuantizationError(
                f"{field}.fmt={fmt!r} unsupported, expected one of {list(FP8_FORMATS)}"
            )
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise QuantizationError(
                f"{field}.activation_scheme={scheme!r} unsupported (static activation scales), "
                f"expected 'dynamic'"
            )
        block = qc.get("weight_block_size")
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise QuantizationError(
                f"{field}.weight_block_size={block!r}: expected two positive integers "
                f"[rows, columns] (per-tensor fp8 scales are not supported)"
            )
        return cls(block=(block[0], block[1]), fmt=fmt)

    @property
    def description(self) -> str:
        return f"fp8 {self.fmt} weights, {self.block[0]}x{self.block[1]} block scales"

    @property
    def data_dtype(self) -> torch.dtype:
        return FP8_FORMATS[self.fmt]

    @property
    def stored(self) -> tuple[str, ...]:
        return (self.data, self.scale)

    def covers(self, shape) -> dict[str, tuple[int, int]]:
        return {self.data: (1, 1), self.scale: self.block}

    def logical_shape(self, base, shapes, read) -> tuple[int, int]:
        shape = shapes[base + self.data]
        if len(shape) != 2:
            raise ValueError(f"{base}{self.data} has shape {shape}, expected 2 dimensions")
        return shape[0], shape[1]

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        out, inp = weight.shape  # [out, in] float
        b0, b1 = self.block
        rows, cols = math.ceil(out / b0), math.ceil(inp / b1)
        padded = F.pad(weight.float(), (0, cols * b1 - inp, 0, rows * b0 - out))
        amax = padded.view(rows, b0, cols, b1).abs().amax(dim=(1, 3))  # [rows, cols]
        fp8_max = torch.finfo(self.data_dtype).max
        scale_inv = amax.clamp_min(torch.finfo(torch.float32).tiny) / fp8_max
        values = weight.float() / _expand(scale_inv, self.block, (out, inp))
        return {self.data: values.to(self.data_dtype), self.scale: scale_inv}

    def dequantize(self, parts, shape) -> torch.Tensor:
        return parts[self.data].float() * _expand(parts[self.scale].float(), self.block, shape)


# --- compressed-tensors pack-quantized --------------------------------------------------------


@dataclass(frozen=True)
class PackQuantized:
    """Symmetric ``num_bits`` integers packed into int32 words, one scale per ``group_size``
    columns of a row (``strategy: "channel"`` is one group per row: ``group_size`` 0)."""

    num_bits: int = 4
    group_size: int = 32
    scale_dtype: torch.dtype = torch.bfloat16  # of the scales quantize writes (Kimi's: bf16)
    data: ClassVar[str] = "weight_packed"
    scale: ClassVar[str] = "weight_scale"
    shape_part: ClassVar[str] = "weight_shape"
    data_dtype: ClassVar[torch.dtype] = torch.int32

    @classmethod
    def from_config(cls, qc: dict, field: str) -> PackQuantized:
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise QuantizationError(f"{field}.config_groups: expected at least one group")
        schemes = {name: (g or {}).get("weights") for name, g in groups.items()}
        first_name, weights = next(iter(schemes.items()))
        where = f"{field}.config_groups.{first_name}"
        differ = [name for name, w in schemes.items() if w != weights]
        if differ:
            raise QuantizationError(
                f"{field}.config_groups: groups {first_name} and {differ[0]} quantize weights "
                f"differently; one weight scheme for every group is supported"
            )
        for name, group in groups.items():
            if (group or {}).get("input_activations") is not None:
                raise QuantizationError(
                    f"{field}.config_groups.{name}.input_activations is set; only weight-only "
                    f"schemes (input_activations null) are supported"
                )
        if not isinstance(weights, dict):
            raise QuantizationError(f"{where}.weights: expected an object")
        expected = {"type": "int", "symmetric": True, "dynamic": False, "actorder": None}
        for key, value in expected.items():
            if weights.get(key, value) != value:
                raise QuantizationError(
                    f"{where}.weights.{key}={weights[key]!r} unsupported, expected {value!r}"
                )
        bits = weights.get("num_bits")
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= MAX_PACKED_BITS:
            raise QuantizationError(
                f"{where}.weights.num_bits={bits!r}: expected 1..{MAX_PACKED_BITS} "
                f"(pack-quantized packs 32 // num_bits values per int32)"
            )
        strategy = weights.get("strategy")
        if strategy == "channel":
            return cls(num_bits=bits, group_size=0)
        if strategy != "group":
            raise QuantizationError(
                f"{where}.weights.strategy={strategy!r} unsupported, expected 'group' or 'channel'"
            )
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise QuantizationError(
                f"{where}.weights.group_size={size!r}: expected a positive integer"
            )
        return cls(num_bits=bits, group_size=size)

    @property
    def pack_factor(self) -> int:
        return PACK_WORD_BITS // self.num_bits

    @property
    def description(self) -> str:
        groups = f"group {self.group_size}" if self.group_size else "per channel"
        return f"int{self.num_bits} pack-quantized (compressed-tensors), {groups}"

    @property
    def stored(self) -> tuple[str, ...]:
        return (self.data, self.scale, self.shape_part)

    def covers(self, shape) -> dict[str, tuple[int, int]]:
        return {self.data: (1, self.pack_factor), self.scale: (1, self.group_size or shape[1])}

    def logical_shape(self, base, shapes, read) -> tuple[int, int]:
        name = base + self.shape_part
        stored = read(name)
        if stored.dtype.is_floating_point or stored.numel() != 2:
            raise ValueError(f"{name} is {list(stored.shape)} {stored.dtype}, expected 2 integers")
        out, inp = (int(v) for v in stored.tolist())
        return out, inp

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        out, inp = weight.shape  # [out, in] float
        group = self.group_size or inp
        n_groups = math.ceil(inp / group)
        padded = F.pad(weight.float(), (0, n_groups * group - inp))
        amax = padded.view(out, n_groups, group).abs().amax(-1)  # [out, n_groups]
        # symmetric minmax: the largest magnitude spans half the integer range
        half_range = (2**self.num_bits - 1) / 2
        scale = (amax.clamp_min(torch.finfo(torch.float32).tiny) / half_range).to(self.scale_dtype)
        q = weight.float() / _expand(scale.float(), (1, group), (out, inp))
        low, high = -(2 ** (self.num_bits - 1)), 2 ** (self.num_bits - 1) - 1
        q = q.round().clamp(low, high).to(torch.int8)
        return {
            self.data: pack_int32(q, self.num_bits),
            self.scale: scale,
            self.shape_part: torch.tensor([out, inp], dtype=torch.int32),
        }

    def dequantize(self, parts, shape) -> torch.Tensor:
        q = unpack_int32(parts[self.data], self.num_bits, shape[1])  # [out, in] int8
        group = self.group_size or shape[1]
        return q.float() * _expand(parts[self.scale].float(), (1, group), shape)


def pack_int32(q: torch.Tensor, num_bits: int) -> torch.Tensor:
    """[R, C] int8 in ``-2**(b-1) .. 2**(b-1)-1`` -> [R, ceil(C/P)] int32, P = 32 // b values
    per word, column ``j`` at bits ``b*(j % P)`` of word ``j // P``, stored as ``q + 2**(b-1)``;
    the last word is padded with stored zeros."""
    assert q.dim() == 2 and q.dtype == torch.int8, (q.shape, q.dtype)
    per_word = PACK_WORD_BITS // num_bits
    words = math.ceil(q.shape[1] / per_word)
    stored = q.to(torch.int64) + 2 ** (num_bits - 1)  # [R, C] in 0 .. 2**b - 1
    stored = F.pad(stored, (0, words * per_word - q.shape[1])).view(q.shape[0], words, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    packed = (stored << shifts).sum(-1)  # [R, words] in 0 .. 2**32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: [R, W] int32 -> [R, cols] int8 (padding dropped)."""
    assert packed.dim() == 2 and packed.dtype == torch.int32, (packed.shape, packed.dtype)
    per_word = PACK_WORD_BITS // num_bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * num_bits
    stored = (packed[..., None] >> shifts) & (2**num_bits - 1)  # [R, W, P]
    stored = stored.reshape(packed.shape[0], -1)[:, :cols]
    return (stored - 2 ** (num_bits - 1)).to(torch.int8)


def _expand(scale: torch.Tensor, cover: tuple[int, int], shape: Shape) -> torch.Tensor:
    """[ceil(R/c0), ceil(C/c1)] per-block values -> [R, C]: element (i, j) gets block
    (i // c0, j // c1)."""
    rows = scale.repeat_interleave(cover[0], 0)[: shape[0]]
    return rows.repeat_interleave(cover[1], 1)[:, : shape[1]]


# --- registry ---------------------------------------------------------------------------------


def _compressed_tensors(qc: dict, field: str) -> QuantScheme:
    fmt = qc.get("format")
    if fmt not in COMPRESSED_TENSORS_FORMATS:
        raise QuantizationError(
            f"{field}.format={fmt!r} unsupported, expected one of "
            f"{list(COMPRESSED_TENSORS_FORMATS)}"
        )
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantizationError(
            f"{field}.quantization_status={status!r}: expected 'compressed' (packed weights)"
        )
    return COMPRESSED_TENSORS_FORMATS[fmt](qc, field)


COMPRESSED_TENSORS_FORMATS: dict[str, Callable[[dict, str], QuantScheme]] = {
    "pack-quantized": PackQuantized.from_config,
}
# quantization_config.quant_method -> the scheme it describes
QUANT_METHODS: dict[str, Callable[[dict, str], QuantScheme]] = {
    "fp8": Fp8Block.from_config,
    "compressed-tensors": _compressed_tensors,
}


def scheme_from_config(config: dict, source: str = "config.json") -> QuantScheme | None:
    """The scheme of a ``config.json`` dict's ``quantization_config`` (None: unquantized)."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    field = f"{source}: field quantization_config"
    if not isinstance(qc, dict):
        raise QuantizationError(f"{field}: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise QuantizationError(
            f"{field}.quant_method={method!r} unsupported, expected one of {list(QUANT_METHODS)}"
        )
    return QUANT_METHODS[method](qc, field)


# --- reading a quantized checkpoint -----------------------------------------------------------


class DequantizedSlices:
    """The logical (float) tensors of a quantized checkpoint over its stored ones.

    ``shapes()`` and ``read(name, index)`` as :class:`CheckpointSlices`; a quantized weight is
    read as the window of stored parts covering ``index`` (whole blocks, words and groups),
    dequantized into ``dtype`` and cut to ``index``. Every quantized weight's parts are checked
    (present, shaped for its logical shape) on construction; dtypes when read.
    """

    def __init__(self, stored: CheckpointSlices, scheme: QuantScheme, dtype: torch.dtype):
        self.stored = stored
        self.scheme = scheme
        self.dtype = dtype
        shapes = stored.shapes()
        # a weight is quantized where any part but the logical "weight" itself is stored
        markers = [s for s in scheme.stored if s != WEIGHT]
        bases = {n[: -len(s)] for n in shapes for s in markers if n.endswith("." + s)}
        self._weights = {base: self._check(base, shapes) for base in sorted(bases)}
        parts = {base + s for base in bases for s in scheme.stored}
        self._shapes = {n: shape for n, shape in shapes.items() if n not in parts}
        self._shapes.update({base + WEIGHT: shape for base, shape in self._weights.items()})

    def _check(self, base: str, shapes: Mapping[str, Shape]) -> tuple[int, int]:
        """The logical [out, in] of ``base + "weight"``, its parts checked against it."""
        scheme, file_of = self.scheme, self.stored.file_of
        present = next(base + s for s in scheme.stored if base + s in shapes)
        for suffix in scheme.stored:
            if base + suffix not in shapes:
                raise QuantizationError(
                    f"{file_of(present)}: tensor {present} has no {base}{suffix} beside it "
                    f"({scheme.description})"
                )
        try:
            shape = scheme.logical_shape(base, shapes, self.stored.read)
        except ValueError as err:
            raise QuantizationError(f"{file_of(present)}: {err}") from None
        for suffix, cover in scheme.covers(shape).items():
            expected = [math.ceil(n / c) for n, c in zip(shape, cover, strict=True)]
            if list(shapes[base + suffix]) != expected:
                raise QuantizationError(
                    f"{file_of(base + suffix)}: tensor {base}{suffix} has shape "
                    f"{list(shapes[base + suffix])}, expected {expected} for the "
                    f"{list(shape)} weight {base}{WEIGHT} ({scheme.description})"
                )
        return shape

    def shapes(self) -> dict[str, Shape]:
        return dict(self._shapes)

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        base = name[: -len(WEIGHT)]
        if base + WEIGHT != name or base not in self._weights:
            tensor = self.stored.read(name, index)
            if tensor.dtype == self.scheme.data_dtype:
                raise QuantizationError(
                    f"{self.stored.file_of(name)}: tensor {name} is {tensor.dtype} but "
                    f"{base}{self.scheme.scale} is missing ({self.scheme.description})"
                )
            return tensor
        shape = self._weights[base]
        covers = self.scheme.covers(shape)
        window, cut = _window(index, shape, covers.values())
        parts = {}
        for suffix, cover in covers.items():
            part_index = tuple(
                slice(w.start // c, math.ceil(w.stop / c))
                for w, c in zip(window, cover, strict=True)
            )
            parts[suffix] = self._checked_dtype(
                base + suffix, self.stored.read(base + suffix, part_index), suffix
            )
        window_shape = (window[0].stop - window[0].start, window[1].stop - window[1].start)
        return self.scheme.dequantize(parts, window_shape)[cut].to(self.dtype)

    def _checked_dtype(self, name: str, tensor: torch.Tensor, suffix: str) -> torch.Tensor:
        is_data = suffix == self.scheme.data
        expected = self.scheme.data_dtype
        if (tensor.dtype != expected) if is_data else not tensor.dtype.is_floating_point:
            want = str(expected) if is_data else "a floating-point dtype"
            raise QuantizationError(
                f"{self.stored.file_of(name)}: tensor {name} is {tensor.dtype}, expected "
                f"{want} ({self.scheme.description})"
            )
        return tensor


def _window(
    index: Index, shape: tuple[int, int], covers
) -> tuple[tuple[slice, slice], tuple[slice, slice]]:
    """The window of a weight aligned to every part's cover that holds ``index`` (slices of
    rows, then columns), and where ``index`` lies inside that window.

    Worked example: rows 200..300 of a 512-row weight with 128-row blocks lie in the window
    128..384; inside it, at 72..172."""
    windows, cut = [], []
    for dim, size in enumerate(shape):
        wanted = index[dim] if dim < len(index) else slice(None)
        start, stop, step = wanted.indices(size)
        assert step == 1, index
        unit = math.lcm(*(min(c[dim], size) for c in covers))
        lo, hi = start // unit * unit, min(math.ceil(stop / unit) * unit, size)
        windows.append(slice(lo, hi))
        cut.append(slice(start - lo, stop - lo))
    return (windows[0], windows[1]), (cut[0], cut[1])


def dequantized(stored: CheckpointSlices, scheme: QuantScheme | None, dtype: torch.dtype):
    """``stored`` itself when unquantized, else its :class:`DequantizedSlices` view."""
    return stored if scheme is None else DequantizedSlices(stored, scheme, dtype)


def load_weights(
    path: str | Path, scheme: QuantScheme | None, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every logical tensor of the checkpoint at ``path``: quantized weights dequantized into
    ``dtype``, the rest as stored (:func:`load_safetensors` when unquantized)."""
    if scheme is None:
        return load_safetensors(path)
    with CheckpointSlices(path) as stored:
        view = DequantizedSlices(stored, scheme, dtype)
        return {name: view.read(name) for name in view.shapes()}
