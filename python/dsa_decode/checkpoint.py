"""A DSA layer's attention weights from a Hugging Face checkpoint (safetensors
files), in the form Stage takes them: the Python half of `dsa-decode
--weights PATH --layer N` (tools/checkpoint.h), with the same names, rules
and bits.

The safetensors format, read here directly with NumPy (memory-mapped, no
other dependency): an 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
"__metadata__"}, then the tensors' raw little-endian bytes, offsets relative
to the end of the header. A checkpoint is one directory (its
model.safetensors.index.json when present, opening only the files that hold
the layer's tensors; else every *.safetensors in it) or a list of files.

Names under model.layers.N.self_attn. (as vLLM's glm5next / DeepSeek-V3.2
models load them): q_a_proj, kv_a_proj_with_mqa (stacked into the stage's
fused_qkv_a_proj), q_a_layernorm, kv_a_layernorm, q_b_proj, kv_b_proj (split
per head into W_UK_T [H, P, L] and W_UV [H, L, V] as vLLM's MLA
process_weights_after_loading does), o_proj, and the indexer's wq_b, wk,
weights_proj, k_norm.weight / .bias, index_kpool_compress_gate and
index_kpool_compress_ape. Tensor parallelism as vLLM splits it: rank r of tp
keeps heads [r H, (r + 1) H) of the column-parallel q_b_proj and kv_b_proj
and the matching H V input columns of the row-parallel o_proj; everything
else is replicated.

Dtypes: BF16 (kept), F32 (rounded to BF16, nearest even, where the stage
takes BF16; kept where it takes F32) and, for the 2-D projections, F8_E4M3
with 128 x 128 block scales (`<name>_scale_inv`, F32 [ceil(rows / 128),
ceil(cols / 128)]), dequantized at load to bf16_rne(e4m3 * scale_inv of its
block) in FP32 arithmetic: the C++ loader's bits, checked against it
(dsa_decode._C.checkpoint_layer_weights) in python/tests/test_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from ._C import InvalidArgument

SCALE_BLOCK = 128  # DeepSeek-V3's FP8 weight blocks: 128 x 128
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the header
INDEXER_DIM = 128
# The C++ loader's q_scale and k_scale (the synthetic layer's calibrated
# static scales, amax 6 / 448): a checkpoint holds no activation scales.
DEFAULT_STATIC_SCALE = float(np.float32(6.0) / np.float32(448.0))

# The bytes of one element of each safetensors dtype, and the NumPy dtype its
# raw bytes are read as (F8 codes and BF16 bits as unsigned integers).
_RAW_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F32": np.dtype("<f4"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
}


def layer_tensor_name(layer: int, suffix: str) -> str:
    """The Hugging Face name of a layer's attention tensor, e.g.
    'model.layers.3.self_attn.q_b_proj.weight' for (3, 'q_b_proj.weight')."""
    return f"model.layers.{layer}.self_attn.{suffix}"


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


# ---- numerics: the C++ loader's conversions (include/dsa_decode/numerics.h) ----


def bf16_from_f32(values: np.ndarray) -> np.ndarray:
    """FP32 -> BF16 bits (uint16), round to nearest even; NaN -> 0x7FFF (the
    canonical NaN cvt.rn.bf16.f32 gives)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    rounded[nan] = 0x7FFF
    return rounded


def f32_from_bf16(bits: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) -> FP32, exact."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _e4m3_table() -> np.ndarray:
    # Every e4m3 ("fn": no infinities, 0x7F / 0xFF NaN) code's FP32 value, built from its bits.
    codes = np.arange(256, dtype=np.uint32)
    sign = (codes & 0x80) << 24
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).view(np.float32)
    subnormal = (mantissa.astype(np.float32) * np.float32(1.0 / 512.0)).view(np.uint32) | sign
    table = np.where(exponent == 0, subnormal.view(np.float32), normal).astype(np.float32)
    table[(codes & 0x7F) == 0x7F] = np.nan  # 0x7F, 0xFF: NaN, whose product rounds to BF16's canonical NaN
    return table


E4M3_VALUES = _e4m3_table()


def dequantize_fp8_blocks(codes: np.ndarray, scale_inv: np.ndarray, first_row: int = 0, first_col: int = 0) -> np.ndarray:
    """BF16 bits of F8_E4M3 codes [rows, cols] with 128 x 128 block scales:
    bf16_rne(e4m3(code) * scale_inv[block]) in FP32. The codes are the block
    [first_row:, first_col:] of the whole tensor whose scales `scale_inv` are
    (a TP slice keeps the scales of the blocks it falls in)."""
    codes = np.asarray(codes)
    scale_inv = np.asarray(scale_inv, dtype=np.float32)
    rows, cols = codes.shape
    out = np.empty((rows, cols), dtype=np.uint16)
    col_blocks = (np.arange(first_col, first_col + cols) // SCALE_BLOCK).astype(np.intp)
    row = 0
    while row < rows:
        block = (first_row + row) // SCALE_BLOCK
        end = min(rows, (block + 1) * SCALE_BLOCK - first_row)
        values = E4M3_VALUES[codes[row:end]] * scale_inv[block][col_blocks]
        out[row:end] = bf16_from_f32(values)
        row = end
    return out


# ---- safetensors files ----


@dataclass(frozen=True)
class SafeTensor:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    dtype: str  # as the header spells it: "BF16", "F32", "F8_E4M3", ...
    shape: tuple
    file: str
    offset: int  # of its first byte in `file`
    nbytes: int


def _error(message: str) -> InvalidArgument:
    return InvalidArgument("invalid argument: " + message)


def _is_uint(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value


def _file_tensors(path: str, problems: List[str]) -> Dict[str, SafeTensor]:
    """The tensors a file's header describes; its problems appended to `problems`."""
    where = f"checkpoint file {path}"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length_bytes = f.read(8)
            if len(length_bytes) < 8:
                problems.append(f"{where}: bad header (shorter than its 8-byte length)")
                return {}
            header_bytes = int.from_bytes(length_bytes, "little")
            if header_bytes > MAX_HEADER_BYTES or header_bytes > size - 8:
                problems.append(
                    f"{where}: bad header (length {header_bytes} bytes, the file has {size}): truncated or not safetensors"
                )
                return {}
            text = f.read(header_bytes)
    except OSError as error:
        problems.append(f"{where}: cannot open ({error.strerror or error})")
        return {}
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        problems.append(f"{where}: bad header (JSON: {error})")
        return {}
    if not isinstance(header, dict):
        problems.append(f"{where}: bad header (not a JSON object)")
        return {}
    data_start = 8 + header_bytes
    data_bytes = size - data_start
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(entry, dict)
        dtype = entry.get("dtype") if ok else None
        shape = entry.get("shape") if ok else None
        offsets = entry.get("data_offsets") if ok else None
        ok = (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(_is_uint(d) and d < (1 << 40) for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_uint(o) for o in offsets)
            and offsets[0] <= offsets[1]
        )
        if not ok:
            problems.append(
                f"{where}: {name}: bad header entry (expected {{\"dtype\": string, \"shape\": [integers], "
                f"\"data_offsets\": [begin, end]}}, got {json.dumps(entry)[:200]})"
            )
            continue
        begin, end = offsets
        raw = _RAW_DTYPES.get(dtype)
        if raw is not None and int(np.prod(shape, dtype=np.int64)) * raw.itemsize != end - begin:
            problems.append(
                f"{where}: {name}: data_offsets span {end - begin} bytes, but {dtype} {_shape_text(shape)} is "
                f"{int(np.prod(shape, dtype=np.int64)) * raw.itemsize} bytes"
            )
            continue
        if end > data_bytes:
            problems.append(
                f"{where}: {name}: data [{begin}, {end}) runs past the end of the file's {data_bytes} data bytes "
                "(truncated file)"
            )
            continue
        tensors[name] = SafeTensor(name, dtype, tuple(shape), path, data_start + begin, end - begin)
    return tensors


class Checkpoint:
    """The tensors of a checkpoint's safetensors files, memory-mapped.

    paths: one directory (its model.safetensors.index.json when present,
    else every *.safetensors in it) or a list of files. With an index, only
    the files that hold a tensor of `wanted` are opened (None: all of them).
    Every opened header is checked whole: a bad header, a tensor whose bytes
    do not match its dtype and shape, one whose data runs past the end of its
    file (a truncated file) or one in two files raises InvalidArgument naming
    the file and the tensor, every problem of every file in one message."""

    def __init__(self, paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]], wanted=None):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise _error("argument 'path': expected a directory or safetensors files, got none")
        self.paths = paths
        self.tensors: Dict[str, SafeTensor] = {}
        self.indexed: set = set()  # every name of the index's weight_map
        self.config: Optional[dict] = None  # config.json beside the files, parsed
        self.config_path: Optional[str] = None
        self._maps: Dict[str, np.memmap] = {}
        self.bytes_read = 0
        files, config_directory = self._files(paths, wanted)
        self.files = files
        problems: List[str] = []
        for path in files:
            for name, tensor in _file_tensors(path, problems).items():
                if name in self.tensors:
                    problems.append(f"{name}: in two files, {self.tensors[name].file} and {path}")
                    continue
                self.tensors[name] = tensor
        if problems:
            count = len(problems)
            raise _error(
                f"checkpoint {','.join(paths)}: {count} bad header{'s' if count > 1 else ''} or tensor "
                f"entr{'ies' if count > 1 else 'y'}:\n  " + "\n  ".join(problems)
            )
        config_path = os.path.join(config_directory, "config.json")
        if os.path.isfile(config_path):
            self.config_path = config_path
            try:
                with open(config_path, "rb") as f:
                    config = json.loads(f.read().decode("utf-8"))
                self.config = config if isinstance(config, dict) else None
            except (OSError, UnicodeDecodeError, ValueError):
                self.config = None

    def _files(self, paths: List[str], wanted) -> tuple:
        if len(paths) == 1 and os.path.isdir(paths[0]):
            directory = paths[0]
            index_path = os.path.join(directory, INDEX_FILE)
            if os.path.isfile(index_path):
                try:
                    with open(index_path, "rb") as f:
                        index = json.loads(f.read().decode("utf-8"))
                except OSError as error:
                    raise _error(f"{index_path}: cannot read ({error.strerror or error})") from None
                except (UnicodeDecodeError, ValueError) as error:
                    raise _error(f"{index_path}: bad JSON ({error})") from None
                weight_map = index.get("weight_map") if isinstance(index, dict) else None
                if not isinstance(weight_map, dict):
                    raise _error(f'{index_path}: no "weight_map" object')
                wanted = None if wanted is None else set(wanted)
                files, problems = [], []
                for name, file in weight_map.items():
                    self.indexed.add(name)
                    if wanted is not None and name not in wanted:
                        continue
                    if not isinstance(file, str) or not file or "/" in file:
                        problems.append(f"{name}: the weight_map names no file in the directory (got {file!r})")
                        continue
                    shard = os.path.join(directory, file)
                    if not os.path.isfile(shard):
                        problems.append(f"{name}: in {file}, which is not in {directory}")
                        continue
                    if shard not in files:
                        files.append(shard)
                if problems:
                    raise _error(f"{index_path}: {len(problems)} tensors not readable:\n  " + "\n  ".join(problems))
                return files, directory
            files = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))
            if not files:
                raise _error(
                    f"argument 'path': directory {directory} holds neither {INDEX_FILE} nor any .safetensors file"
                )
            return files, directory
        for path in paths:
            if os.path.isdir(path):
                raise _error(f"argument 'path': {path} is a directory; give one directory or a list of files")
            if not os.path.isfile(path):
                raise _error(f"argument 'path': expected a directory or safetensors files, got {path} (no such file)")
        return list(paths), os.path.dirname(paths[0]) or "."

    def find(self, name: str) -> Optional[SafeTensor]:
        """The tensor, or None where the checkpoint does not hold it."""
        return self.tensors.get(name)

    def raw(self, tensor: SafeTensor) -> np.ndarray:
        """The tensor's bytes as a read-only memory-mapped array of its shape
        (F8 codes as uint8, BF16 bits as uint16), nothing read yet."""
        raw = _RAW_DTYPES.get(tensor.dtype)
        if raw is None:
            raise _error(f"{tensor.name}: dtype {tensor.dtype} is not one this reader knows")
        mapped = self._maps.get(tensor.file)
        if mapped is None:
            mapped = self._maps[tensor.file] = np.memmap(tensor.file, dtype=np.uint8, mode="r")
        data = mapped[tensor.offset : tensor.offset + tensor.nbytes]
        return data.view(raw).reshape(tensor.shape)


# ---- the layer ----


@dataclass(frozen=True)
class _Needed:
    suffix: str
    shape: tuple  # in the whole model
    projection: bool  # 2-D: may be F8_E4M3 with block scales


def _needed(D, heads, Q, L, P, V, HI, S, R=0) -> List[_Needed]:
    """The layer's tensors. R = qk_rope_head_dim: a RoPE layer's
    kv_a_proj_with_mqa holds k_pe's R rows after kv_c's, its q_b_proj R rope
    rows after each head's P; its indexer (S = 1, DeepSeek-V3.2's) has no
    pool gate or positional term."""
    I = INDEXER_DIM
    needed = [
        _Needed("q_a_proj.weight", (Q, D), True),
        _Needed("q_a_layernorm.weight", (Q,), False),
        _Needed("q_b_proj.weight", (heads * (P + R), Q), True),
        _Needed("kv_a_proj_with_mqa.weight", (L + R, D), True),
        _Needed("kv_a_layernorm.weight", (L,), False),
        _Needed("kv_b_proj.weight", (heads * (P + V), L), True),
        _Needed("o_proj.weight", (D, heads * V), True),
        _Needed("indexer.wq_b.weight", (HI * I, Q), True),
        _Needed("indexer.wk.weight", (I, D), True),
        _Needed("indexer.weights_proj.weight", (HI, D), True),
        _Needed("indexer.k_norm.weight", (I,), False),
        _Needed("indexer.k_norm.bias", (I,), False),
    ]
    if S != 1:
        needed += [
            _Needed("indexer.index_kpool_compress_gate", (I, D), True),
            _Needed("indexer.index_kpool_compress_ape", (S, I), False),
        ]
    return needed


def _scale_shape(shape) -> tuple:
    return tuple(-(-int(d) // SCALE_BLOCK) for d in shape)


def _check_tensors(c: Checkpoint, layer: int, needed: List[_Needed]) -> List[str]:
    problems = []
    for n in needed:
        name = layer_tensor_name(layer, n.suffix)
        t = c.find(name)
        if t is None:
            problems.append(f"{name}: missing (expected {_shape_text(n.shape)})")
            continue
        fp8 = t.dtype == "F8_E4M3"
        if t.dtype not in ("BF16", "F32") and not (fp8 and n.projection):
            problems.append(
                f"{name}: dtype {t.dtype}, expected BF16, F32"
                + (" or F8_E4M3 with 128 x 128 block scales" if n.projection else "")
            )
        if t.shape != n.shape:
            problems.append(f"{name}: shape {_shape_text(t.shape)}, expected {_shape_text(n.shape)}")
            continue
        if not (fp8 and n.projection):
            continue
        scale_name = name + "_scale_inv"
        scale = c.find(scale_name)
        expected = _scale_shape(n.shape)
        if scale is None:
            problems.append(
                f"{scale_name}: missing (the F32 {_shape_text(expected)} block scales of F8_E4M3 {name})"
            )
        elif scale.dtype != "F32" or scale.shape != expected:
            problems.append(
                f"{scale_name}: {scale.dtype} {_shape_text(scale.shape)}, expected F32 {_shape_text(expected)} "
                f"(the 128 x 128 block scales of {name})"
            )
    return problems


def _layers_present(c: Checkpoint, suffix: str) -> str:
    pattern = re.compile(r"model\.layers\.(\d+)\.self_attn\." + re.escape(suffix) + "$")
    layers = sorted({int(m.group(1)) for n in set(c.tensors) | c.indexed for m in [pattern.match(n)] if m})
    return ", ".join(map(str, layers)) or "none"


class _Reader:
    """Reads a checked layer's tensors as BF16 bits or FP32, counting what it read."""

    def __init__(self, c: Checkpoint, layer: int):
        self.c, self.layer = c, layer
        self.tensors = 0
        self.fp8_tensors = 0
        self.bytes = 0

    def tensor(self, suffix: str) -> SafeTensor:
        return self.c.find(layer_tensor_name(self.layer, suffix))

    def bf16(self, suffix: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> np.ndarray:
        """The tensor's block [rows, cols] (a 1-D tensor: all of it) as BF16 bits."""
        t = self.tensor(suffix)
        raw = self.c.raw(t)
        self.tensors += 1
        index = (rows or slice(None),) if raw.ndim == 1 else (rows or slice(None), cols or slice(None))
        part = raw[index]
        self.bytes += part.nbytes
        if t.dtype == "BF16":
            return np.array(part, dtype=np.uint16)
        if t.dtype == "F32":
            return bf16_from_f32(part)
        # F8_E4M3 (checked): the codes and the scales of the 128 x 128 blocks they fall in.
        scale = self.c.raw(self.c.find(t.name + "_scale_inv"))
        first_row = index[0].indices(t.shape[0])[0]
        first_col = index[1].indices(t.shape[1])[0]
        # The scales of the blocks the part falls in (what dequantize_fp8_blocks reads).
        block_rows = (first_row + part.shape[0] - 1) // SCALE_BLOCK - first_row // SCALE_BLOCK + 1
        block_cols = (first_col + part.shape[1] - 1) // SCALE_BLOCK - first_col // SCALE_BLOCK + 1
        self.bytes += 4 * block_rows * block_cols if part.size else 0
        self.fp8_tensors += 1
        return dequantize_fp8_blocks(part, scale, first_row, first_col)

    def floats(self, suffix: str) -> np.ndarray:
        """The whole tensor as FP32 (F32 kept; BF16 exact)."""
        t = self.tensor(suffix)
        if t.dtype == "F32":
            self.tensors += 1
            self.bytes += t.nbytes
            return np.array(self.c.raw(t), dtype=np.float32)
        return f32_from_bf16(self.bf16(suffix))


@dataclass
class LayerWeights:
    """One rank's weights of a checkpoint's layer, as Stage takes them.

    weights: WEIGHT_NAMES -> arrays: NumPy (BF16 as uint16 bits, F32 as
    float32) when loaded without a device, else PyTorch tensors on it
    (torch.bfloat16 / torch.float32). config: the layer's LayerConfig on this
    rank (rms_norm_eps from config.json beside the files where it has one);
    plan: the StagePlan of the indexer shape the weights were read at.
    Stage(lw.config, lw.weights, lw.plan) builds the stage (on a device)."""

    weights: Dict[str, Any]
    config: Any
    plan: Any
    layer: int
    tp: int
    rank: int
    files: List[str] = field(default_factory=list)
    tensors: int = 0  # of the layer, read
    fp8_tensors: int = 0  # of those, dequantized from FP8 blocks
    bytes: int = 0  # read from the files
    seconds: float = 0.0  # opening, reading, dequantizing and splitting
    eps_source: str = ""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds * 1e-9 if self.seconds > 0 else 0.0

    def to(self, device) -> "LayerWeights":
        """The same weights as PyTorch tensors on `device` (BF16 bits become torch.bfloat16)."""
        return dataclasses.replace(self, weights=_to_torch(self.weights, device))


def _to_torch(weights: Dict[str, Any], device) -> Dict[str, Any]:
    try:
        import torch
    except ImportError:
        raise ImportError(f"argument 'device': {device!r} needs PyTorch, which is not installed") from None
    out = {}
    for name, a in weights.items():
        if isinstance(a, np.ndarray) and a.dtype == np.uint16:
            t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        elif isinstance(a, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(a))
        else:
            t = a
        out[name] = t.to(device)
    return out


def _config_eps(c: Checkpoint) -> Optional[float]:
    eps = c.config.get("rms_norm_eps") if c.config else None
    if isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0 and np.isfinite(eps):
        return float(eps)
    return None


def _positive_int(value, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise _error(f"argument '{name}': expected an int >= {low}, got {value!r}")
    return int(value)


def load_layer_weights(
    path: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
    layer: int,
    config: Any = "glm5next",
    plan: Any = None,
    *,
    tp: int = 1,
    rank: int = 0,
    q_scale: Optional[float] = None,
    k_scale: Optional[float] = None,
    device: Any = None,
) -> LayerWeights:
    """Rank `rank` of `tp`'s attention weights of layer `layer` from the
    checkpoint at `path` (a directory, a .safetensors file, or a list of
    files), as Stage takes them.

    config: a preset name (layer_config(preset, tp)) or the rank's
    LayerConfig (num_heads per rank: the checkpoint holds num_heads * tp
    heads); either way rms_norm_eps becomes a config.json's beside the files
    where it has one, as in the C++ loader (LayerWeights.eps_source says
    which).
    plan: a StagePlan, whose indexer_heads and indexer_pool are the indexer
    tensors' shapes; None: the indexer shape of a config.json beside the
    files where it has index_n_heads (StagePlan.from_model_config), else the
    preset's (stage_plan_for) or StagePlan()'s.
    q_scale, k_scale: the attention's static FP8 scales ([1] F32 weights; a
    checkpoint holds none): the engine's calibrated values, default the C++
    loader's (6 / 448).
    device: None returns NumPy arrays (BF16 as uint16 bits); "cuda", a
    torch.device, ...: PyTorch tensors there (needs PyTorch).

    RoPE layers (qk_rope_head_dim R > 0: "dsv32", "glm5", or a LayerConfig
    with its rotaries, e.g. LayerConfig.from_model_config of the
    checkpoint's config.json): kv_a_proj_with_mqa [L + R, D] (k_pe's rows
    last), q_b_proj [heads (P + R), Q] (rank r keeps heads [r H, (r + 1) H)
    of P + R rows each), no pool gate or positional term (the unpooled
    indexer: plan.indexer_pool 1), no q_scale or k_scale (the stage does not
    read them: the keywords must be None). The C++ loader does not take
    RoPE layers: these are checked against the source arrays only.

    Raises InvalidArgument naming every missing tensor, wrong shape,
    unsupported dtype and missing or mis-shaped block scale in one message
    (and, for a bad file, every bad header or entry of the files opened)."""
    from .stage import LayerConfig, StagePlan, layer_config, stage_plan_for

    start = time.perf_counter()
    layer = _positive_int(layer, "layer", 0)
    tp = _positive_int(tp, "tp")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < tp:
        raise _error(f"argument 'rank': expected an int in [0, {tp}) (tp = {tp}), got {rank!r}")
    rank = int(rank)
    if not isinstance(config, (str, LayerConfig)):
        raise _error(f"argument 'config': expected a preset name or a LayerConfig, got {type(config).__name__}")
    if plan is not None and not isinstance(plan, StagePlan):
        raise _error(f"argument 'plan': expected a StagePlan or None, got {type(plan).__name__}")
    for name, value in (("q_scale", q_scale), ("k_scale", k_scale)):
        if value is not None and not (
            isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and 0 < value < np.inf
        ):
            raise _error(f"argument '{name}': expected a finite scale > 0 or None, got {value!r}")
    # The C++ loader's wanted names (and a pooled indexer's): the layer's tensors and their block scales.
    suffixes = [n.suffix for n in _needed(1, 1, 1, 1, 1, 1, 1, 4)]
    wanted = [layer_tensor_name(layer, s) + tail for s in suffixes for tail in ("", "_scale_inv")]
    c = Checkpoint(path, wanted)

    eps = _config_eps(c)
    preset = config if isinstance(config, str) else None
    if preset is not None:
        config = layer_config(preset, tp, eps) if eps is not None else layer_config(preset, tp)
        eps_source = "config.json's rms_norm_eps" if eps is not None else "layer_config's default"
    elif eps is not None:
        config = dataclasses.replace(config, rms_norm_eps=eps)
        eps_source = "config.json's rms_norm_eps"
    else:
        eps_source = "the LayerConfig's"
    if plan is None:
        if c.config is not None and "index_n_heads" in c.config:
            plan = StagePlan.from_model_config(c.config)
        elif preset is not None:
            plan = stage_plan_for(preset)
        else:
            plan = StagePlan()
    D, H, Q, L, P, V, R = (
        config.hidden_size,
        config.num_heads,
        config.q_lora_rank,
        config.kv_lora_rank,
        config.qk_nope_head_dim,
        config.v_head_dim,
        config.qk_rope_head_dim,
    )
    if R > 0:
        scales = [name for name, value in (("q_scale", q_scale), ("k_scale", k_scale)) if value is not None]
        if scales:
            raise _error(
                f"argument '{', '.join(scales)}': expected None for a RoPE layer (qk_rope_head_dim {R}: its query "
                f"stays BF16 and its cache entries hold their own scales), got {q_scale if scales[0] == 'q_scale' else k_scale!r}"
            )
        if plan.indexer_pool != 1:
            raise _error(
                f"argument 'plan': expected indexer_pool 1 for a RoPE layer (DeepSeek-V3.2's unpooled indexer), "
                f"got {plan.indexer_pool}"
            )
    heads = H * tp
    needed = _needed(D, heads, Q, L, P, V, plan.indexer_heads, plan.indexer_pool, R)
    problems = _check_tensors(c, layer, needed)
    if problems:
        count = len(problems)
        raise _error(
            f"checkpoint {','.join(c.paths)}, layer {layer} at TP{tp} (D={D}, H={H} per rank, Q={Q}, L={L}, P={P}, "
            f"{f'R={R}, ' if R else ''}V={V}; indexer {plan.indexer_heads} heads, pools of {plan.indexer_pool}; the whole model's {heads} "
            f"heads): {count} tensor problem{'s' if count > 1 else ''}:\n  "
            + "\n  ".join(problems)
            + f"\n(layers with attention tensors in the checkpoint: {_layers_present(c, needed[0].suffix)})"
        )

    r = _Reader(c, layer)
    w = {}
    # fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa] (vLLM's MergedColumnParallelLinear; replicated).
    w["fused_qkv_a_proj"] = np.concatenate([r.bf16("q_a_proj.weight"), r.bf16("kv_a_proj_with_mqa.weight")])
    w["q_a_norm"] = r.bf16("q_a_layernorm.weight")
    w["kv_a_norm"] = r.bf16("kv_a_layernorm.weight")
    # Column-parallel: rank r holds heads [r H, (r + 1) H) of the output rows (P + R each).
    w["q_b_proj"] = r.bf16("q_b_proj.weight", slice(rank * H * (P + R), (rank + 1) * H * (P + R)))
    # kv_b_proj [heads (P + V), L]: per head P rows of W_UK, then V rows of W_UV.
    kv_b = r.bf16("kv_b_proj.weight", slice(rank * H * (P + V), (rank + 1) * H * (P + V))).reshape(H, P + V, L)
    w["w_uk_t"] = np.ascontiguousarray(kv_b[:, :P, :])  # W_UK_T[h, p, l] = kv_b[h (P + V) + p, l]
    w["w_uv"] = np.ascontiguousarray(kv_b[:, P:, :].transpose(0, 2, 1))  # W_UV[h, l, v] = kv_b[h (P + V) + P + v, l]
    # Row-parallel: rank r holds input columns [r H V, (r + 1) H V) of every row.
    w["o_proj"] = r.bf16("o_proj.weight", None, slice(rank * H * V, (rank + 1) * H * V))
    if R == 0:  # a RoPE layer's stage reads neither
        w["q_scale"] = np.array([DEFAULT_STATIC_SCALE if q_scale is None else q_scale], dtype=np.float32)
        w["k_scale"] = np.array([DEFAULT_STATIC_SCALE if k_scale is None else k_scale], dtype=np.float32)
    # The indexer: replicated on every rank.
    w["index_wq_b"] = r.bf16("indexer.wq_b.weight")
    w["index_wk"] = r.bf16("indexer.wk.weight")
    w["index_weights_proj"] = r.bf16("indexer.weights_proj.weight")
    pooled = plan.indexer_pool != 1  # the unpooled indexer has no gate and no positional term
    if pooled:
        w["index_compress_gate"] = r.bf16("indexer.index_kpool_compress_gate")
    w["index_k_norm_weight"] = r.floats("indexer.k_norm.weight")
    w["index_k_norm_bias"] = r.floats("indexer.k_norm.bias")
    if pooled:
        w["index_ape"] = r.floats("indexer.index_kpool_compress_ape")
    if device is not None:
        w = _to_torch(w, device)
    return LayerWeights(
        weights=w,
        config=config,
        plan=plan,
        layer=layer,
        tp=tp,
        rank=rank,
        files=list(c.files),
        tensors=r.tensors,
        fp8_tensors=r.fp8_tensors,
        bytes=r.bytes,
        seconds=time.perf_counter() - start,
        eps_source=eps_source,
    )


__all__ = [
    "Checkpoint",
    "DEFAULT_STATIC_SCALE",
    "LayerWeights",
    "SafeTensor",
    "bf16_from_f32",
    "dequantize_fp8_blocks",
    "f32_from_bf16",
    "layer_tensor_name",
    "load_layer_weights",
]
