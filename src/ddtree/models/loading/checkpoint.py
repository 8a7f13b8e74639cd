"""Checkpoint directories in the Hugging Face layout: ``config.json`` + safetensors.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``).
Pickled weights (``*.bin``, ``*.pt``, ``*.pth``) are refused: unpickling runs arbitrary code.
Every error is a :class:`CheckpointError` that names the file (and the tensor or field).
Only regular files are read: a named pipe (FIFO), device or socket among a checkpoint's files
is refused before anything is opened (opening a FIFO named ``model.safetensors`` blocked the
loader forever, deaf to signals).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ddtree.files import check_input_file, read_input_bytes

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# How many names an error message lists before "... and N more".
MAX_NAMES_SHOWN = 8


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked (names the file and tensor)."""


def read_config(path: str | Path) -> dict:
    """The ``config.json`` of a checkpoint directory (or the path of the file itself)."""
    path = Path(path)
    file = path if path.suffix == ".json" else path / CONFIG_NAME
    if not file.exists():
        what = "directory does not exist" if not path.exists() else "file not found"
        raise CheckpointError(f"{file}: {what}; expected a checkpoint directory with {CONFIG_NAME}")
    if path.is_dir():
        check_checkpoint_files(path)
    config = read_json_file(file, "a JSON object")
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def check_checkpoint_files(folder: Path) -> None:
    """Every file in a checkpoint folder is a regular file (or a folder): the loaders and
    transformers open files by name (weights, config, tokenizer, chat template), and a FIFO
    or device there would block or never end. Opens nothing."""
    for entry in sorted(folder.iterdir()):
        regular_file(entry, "a regular file in a checkpoint folder", folders=True)


def regular_file(file: Path, what: str, folders: bool = False) -> Path:
    """``file`` unless it is a FIFO, device, socket or symlink loop (or a folder, unless
    ``folders``): a ``CheckpointError`` naming it, before it is opened. A missing file passes
    (the caller says what is missing)."""
    if folders and file.is_dir():
        return file
    try:
        return check_input_file(file, what)
    except FileNotFoundError:
        return file
    except OSError as err:
        raise CheckpointError(f"{file}: {err.strerror or err}") from None


def read_json_file(file: Path, what: str):
    """The JSON in ``file`` (UTF-8, whatever the locale); a ``CheckpointError`` naming the file
    for text that is not UTF-8, not JSON, or nested too deeply for the parser (a 100k-deep
    array would otherwise end in a RecursionError)."""
    try:
        text = read_input_bytes(file, "a regular JSON file").decode("utf-8")
    except OSError as err:  # a FIFO or device: refused before it is opened
        raise CheckpointError(f"{file}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{file}: not UTF-8 text; expected {what}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{file}: invalid JSON at line {err.lineno}: {err.msg}; expected {what}"
        ) from None
    except RecursionError:
        raise CheckpointError(f"{file}: JSON nested too deeply; expected {what}") from None


def refuse_custom_code(file: Path, config: dict, keys: tuple[str, ...] | None = None) -> None:
    """A config (``config.json``, ``tokenizer_config.json``) whose ``auto_map`` points
    transformers at Python files shipped in the checkpoint is refused: loading it would run
    the checkpoint's code (or ask at a terminal whether to). ``keys``: only those entries of
    ``auto_map`` count (``AutoTokenizer`` for a tokenizer load); None: any."""
    auto_map = config.get("auto_map")
    if not auto_map:
        return
    if keys is not None and not (isinstance(auto_map, dict) and any(k in auto_map for k in keys)):
        return
    raise CheckpointError(
        f"{file}: field auto_map asks transformers to run Python code shipped with the "
        f"checkpoint; custom code is refused (trust_remote_code is never set); expected a "
        f"checkpoint of a built-in architecture without auto_map"
    )


# transformers' ALLOWED_LAYER_TYPES (5.x): the values a config's layer_types may hold
LAYER_TYPES = (
    "full_attention", "sliding_attention", "chunked_attention", "window_attention",
    "indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
    "minimax_m3_sparse", "conv", "moe", "hybrid", "hybrid_sliding",
    "reference_sliding_attention", "linear_attention", "sparse", "dense",
)  # fmt: skip
# safetensors dtypes that are no model weight unless a quantization_config says how to read them
INTEGER_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")


def check_layer_types(config: dict, source: str) -> None:
    """``layer_types`` (when a config has it, or its ``text_config``) has one known entry per
    decoder layer: ``num_hidden_layers`` of them."""
    for cfg, prefix in ((config, ""), (config.get("text_config"), "text_config.")):
        if not isinstance(cfg, dict) or cfg.get("layer_types") is None:
            continue
        types, n_layers = cfg["layer_types"], cfg.get("num_hidden_layers")
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise CheckpointError(
                f"{source}: field {prefix}layer_types={types!r}: expected a list of strings"
            )
        if isinstance(n_layers, int) and len(types) != n_layers:
            raise CheckpointError(
                f"{source}: field {prefix}layer_types has {len(types)} entries, expected "
                f"num_hidden_layers={n_layers}"
            )
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown:
            raise CheckpointError(
                f"{source}: field {prefix}layer_types holds {', '.join(map(repr, unknown))}; "
                f"expected entries of {', '.join(LAYER_TYPES[:4])}, ..."
            )


def check_float_weights(path: str | Path, config: dict) -> None:
    """Without a ``quantization_config``, every ``*.weight`` tensor must be stored as floats:
    integer weights (int8 ...) would otherwise be cast to the model dtype, silently wrong.
    Reads the safetensors headers only."""
    if config.get("quantization_config"):
        return
    try:
        files = weight_files(path)
    except CheckpointError:
        return  # no weights (or pickles): the loader that reads them says so
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    dtype = handle.get_slice(name).get_dtype()
                    if name.endswith("weight") and dtype in INTEGER_DTYPES:
                        stored = _TORCH_DTYPE.get(dtype, dtype)
                        raise CheckpointError(
                            f"{file}: tensor {name} is stored as {stored} but {CONFIG_NAME} has "
                            f"no quantization_config; expected floating-point weights "
                            f"(float32, bfloat16, float16)"
                        )
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None


_TORCH_DTYPE = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
                "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64"}  # fmt: skip


def weights_source(path: str | Path) -> str:
    """What names a checkpoint's weights in a message: its one safetensors file, or the index
    of its shards."""
    path = Path(path)
    files = weight_files(path)
    return str(files[0] if len(files) == 1 else path / INDEX_NAME)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, found and checked without reading tensors.

    ``path`` is a directory (sharded index, ``model.safetensors``, or a single ``*.safetensors``
    file) or a ``.safetensors`` file. Refuses pickles; names a missing shard.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        regular_file(path, "a regular .safetensors file")
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            raise _pickle_error(path)
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: expected a .safetensors file")
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    index = path / INDEX_NAME
    if index.exists():
        return [path / shard for shard in _read_index(index)]
    single = path / WEIGHTS_NAME
    if single.exists():
        return [regular_file(single, "a regular .safetensors file")]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return [regular_file(found[0], "a regular .safetensors file")]
    if len(found) > 1:
        raise CheckpointError(
            f"{path}: {len(found)} .safetensors files ({_names([f.name for f in found])}) but "
            f"no {INDEX_NAME} saying which tensor is in which"
        )
    pickles = sorted(f for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise _pickle_error(pickles[0])
    raise CheckpointError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME} found")


def load_safetensors(path: str | Path, device: str | torch.device = "cpu") -> dict:
    """All tensors of a checkpoint: ``{name: tensor}`` (see :func:`weight_files`)."""
    path = Path(path)
    files = weight_files(path)
    index = path / INDEX_NAME
    if not (path.is_dir() and index.is_file()):
        return _load_file(files[0], device)
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in _read_index(index).items():
        file = path / shard
        loaded = _load_file(file, device)
        missing = [n for n in names if n not in loaded]
        if missing:
            raise CheckpointError(
                f"{file}: tensors listed in {index.name} are absent: {_names(missing)}"
            )
        for name in names:
            tensors[name] = loaded[name]
    return tensors


class CheckpointSlices:
    """Parts of the tensors of a checkpoint, read without loading whole files.

    safetensors files are memory-mapped and only the requested slices are copied, so a rank
    of a parallel group holds its own shard and nothing more. Use as a context manager.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path
        self._handles = {}
        self._file_of: dict[str, Path] = {}
        index = path / INDEX_NAME
        try:
            if path.is_dir() and index.is_file():
                for shard, names in _read_index(index).items():
                    handle = self._open(path / shard)
                    absent = [n for n in names if n not in set(handle.keys())]
                    if absent:
                        raise CheckpointError(
                            f"{path / shard}: tensors listed in {INDEX_NAME} are absent: "
                            f"{_names(absent)}"
                        )
                    self._file_of.update({n: path / shard for n in names})
            else:
                file = weight_files(path)[0]
                self._file_of = {n: file for n in self._open(file).keys()}
        except BaseException:
            self.close()
            raise

    def _open(self, file: Path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None
        self._handles[file] = handle
        return handle

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """``{tensor name: shape}`` from the file headers (no tensor data read)."""
        return {
            name: tuple(self._handles[file].get_slice(name).get_shape())
            for name, file in self._file_of.items()
        }

    def file_of(self, name: str) -> Path:
        """The safetensors file holding tensor ``name`` (the directory when none does)."""
        return self._file_of.get(name, self.path)

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """Tensor ``name``, or the part ``index`` (one slice per leading dimension) of it."""
        if name not in self._file_of:
            raise CheckpointError(f"{self.path}: missing tensor {name}")
        piece = self._handles[self._file_of[name]].get_slice(name)
        return piece[index] if index else piece[:]

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap when released

    def __enter__(self) -> CheckpointSlices:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pickle_error(file: Path) -> CheckpointError:
    return CheckpointError(
        f"{file}: pickled weights are refused (loading a pickle can run arbitrary code); "
        f"convert the checkpoint to safetensors (e.g. load it once in a trusted environment and "
        f"save with save_pretrained(..., safe_serialization=True))"
    )


def _load_file(file: Path, device) -> dict:
    try:
        return load_file(file, device=str(device))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None


def _read_index(index: Path) -> dict[str, list[str]]:
    """``{shard file: [tensor names]}`` from a sharded index; every shard checked to exist."""
    try:
        weight_map = read_json_file(index, "an object with a weight_map")["weight_map"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{index}: missing field weight_map") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: field weight_map must map tensor names to shard files")
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        file = _inside(index, shard)
        if Path(shard).suffix in PICKLE_SUFFIXES:
            raise _pickle_error(file)
        regular_file(file, "a regular .safetensors file")
        if not file.is_file():
            raise CheckpointError(
                f"{index}: shard {shard} (holding {_names(names)}) not found at {file}"
            )
    return by_shard


def _inside(index: Path, shard) -> Path:
    """The path of a shard named in ``index``, refused unless it is a plain file name (or a
    relative path) that stays inside the checkpoint folder once symlinks are followed: an
    index must not make the loader read ``../../secret`` or ``/etc/passwd``."""
    folder = index.parent
    if not isinstance(shard, str) or not shard or "\x00" in shard:
        raise CheckpointError(
            f"{index}: field weight_map holds shard {shard!r}; expected a file name"
        )
    rel = Path(shard)
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckpointError(
            f"{index}: field weight_map names shard {shard!r} outside the checkpoint folder; "
            f"expected a file name inside {folder}"
        )
    file = folder / rel
    try:
        file.resolve().relative_to(folder.resolve())
    except ValueError:
        raise CheckpointError(
            f"{index}: field weight_map names shard {shard!r}, a symlink leading outside the "
            f"checkpoint folder (to {file.resolve()}); expected a file inside {folder}"
        ) from None
    except (OSError, RuntimeError) as err:  # a symlink loop
        raise CheckpointError(f"{index}: shard {shard!r} cannot be resolved ({err})") from None
    return file


def match_state_dict(
    expected: dict[str, tuple[int, ...]],
    tensors: dict[str, torch.Tensor],
    source: str,
    against: str = CONFIG_NAME,
) -> None:
    """Check checkpoint tensor names and shapes against those the config implies.

    ``expected`` maps names to shapes built from ``config.json``; ``source`` names the
    checkpoint in the error, ``against`` where the expected shapes come from. Raises :class:`CheckpointError` listing every missing tensor,
    unexpected tensor and shape mismatch at once.
    """
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    mismatched = [
        f"{name} {tuple(tensors[name].shape)} in the checkpoint, {tuple(shape)} from {against}"
        for name, shape in sorted(expected.items())
        if name in tensors and tuple(tensors[name].shape) != tuple(shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_names(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {_names(mismatched)}")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


def save_safetensors(path: str | Path, state_dict: dict, config: dict) -> list[str]:
    """Write ``config.json`` and ``model.safetensors`` into directory ``path``.

    Tensors are moved to CPU and made contiguous. A tensor that is the same view of the same
    storage as an earlier one (tied weights, e.g. ``lm_head.weight`` tied to the embedding) is
    written once under the earlier name, as transformers does; a partial overlap is copied.
    Returns the names written.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    seen: dict[tuple, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{path}: state_dict[{name!r}] is not a tensor")
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        if tensor.numel() and key in seen:
            continue  # an alias of seen[key]
        seen[key] = name
        out[name] = tensor.detach().to("cpu").contiguous()
    # contiguous() keeps the storage when already contiguous: clone what still overlaps
    ptrs: dict[int, str] = {}
    for name, tensor in out.items():
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr in ptrs:
            out[name] = tensor.clone()
        else:
            ptrs[ptr] = name
    (path / CONFIG_NAME).write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    save_file(out, path / WEIGHTS_NAME, metadata={"format": "pt"})
    return list(out)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES_SHOWN])
    more = len(names) - MAX_NAMES_SHOWN
    return shown + (f" ... and {more} more" if more > 0 else "")
