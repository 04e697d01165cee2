"""GGUF files (llama.cpp's format) as tandem model folders.

``gguf_folder`` gives a GGUF file a Hugging Face-style folder in tandem's cache (config,
tokenizer, and ``gguf.json`` pointing back at the file with its tensor table, so the
slow metadata parse is paid once), and ``weights.load_model`` reads the weights from the
file, dequantized with the ``gguf`` library. Only the ``llama`` architecture is taken.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tandem.scheduler.models.decoder import CausalLM
from tandem.scheduler.models.gguf_tokenizer import write_gguf_tokenizer
from tandem.scheduler.models.model_config import ModelConfig
from tandem.scheduler.models.quant_rows import KERNEL_TYPES, RowQuant, decode_gguf
from tandem.scheduler.models.quantized import QuantizedLinear
from tandem.scheduler.models.rope import compute_inv_freq
from tandem.scheduler.models.tensor_parallel import TensorParallel
from tandem.scheduler.models.tiny import build_once, write_json
from tandem.scheduler.models.weights import GGUF_JSON, Shape, copy_shard

log = logging.getLogger(__name__)

ARCHITECTURE = "llama"
_MAGIC = b"GGUF"
_MARKER = ".tandem-complete"
# Part of the folder's key: a change to what the folder holds makes a new folder.
_LAYOUT = 1
# Rows dequantized at a time hold at most this many values (16 MB of float32).
CHUNK_VALUES = 1 << 22

# llama.cpp's tensor names -> the Hugging Face names of tandem's model.
_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES: Mapping[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors of llama.cpp's that tandem's model has no parameter for: rotary frequency
# factors (honoured through the config's rope scaling, see ``_rope_scaling``) and the
# rotary tables some old converters saved.
_IGNORED = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?")
# The rows of these are stored in llama.cpp's rotary layout (see ``unpermute_heads``).
_PERMUTED = ("attn_q", "attn_k")
# Weights multiplied as one product (``CausalLM.pack``): kept quantized together or not.
_PRODUCTS = (
    ("attn_q", "attn_k", "attn_v"),
    ("attn_output",),
    ("ffn_gate", "ffn_up"),
    ("ffn_down",),
)
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, as ``gguf.json`` records it.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        qtype: how it is stored (F32, Q4_1, ...).
        shape: in PyTorch's order (rows first; GGUF lists its dimensions the other way).
        offset: where its data starts, in bytes from the start of the file.
        nbytes: the size of its data.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (a 1-D tensor is one row); rows of blocks are independent."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.qtype.name,
            "shape": list(self.shape),
            "offset": self.offset,
            "bytes": self.nbytes,
        }


@dataclass(frozen=True)
class GGUFSource:
    """What ``gguf.json`` says: the file (as it was when the folder was made) and its
    tensors by llama.cpp's names."""

    file: Path
    size: int
    mtime_ns: int
    tensors: Mapping[str, GGUFTensor]

    @classmethod
    def read(cls, folder: Path) -> GGUFSource:
        """The folder's ``gguf.json``; refuses a file that is gone or has changed since
        (its tensor list would no longer be true)."""
        d = json.loads((folder / GGUF_JSON).read_text(encoding="utf-8"))
        tensors = {
            name: GGUFTensor(
                name, GGMLQuantizationType[t["type"]], tuple(t["shape"]), t["offset"], t["bytes"]
            )
            for name, t in d["tensors"].items()
        }
        source = cls(Path(d["file"]), int(d["size"]), int(d["mtime_ns"]), tensors)
        if not source.file.is_file():
            raise FileNotFoundError(f"{folder / GGUF_JSON} points at {source.file}, which is gone")
        stat = source.file.stat()
        if (stat.st_size, stat.st_mtime_ns) != (source.size, source.mtime_ns):
            raise ValueError(
                f"{source.file} changed after {folder} was made from it; open the file "
                "again (gguf_folder) to get a folder for its new contents"
            )
        return source

    def open(self) -> np.ndarray:
        """The file's bytes, mapped. Copy-on-write: the arrays dequantize returns for F32
        tensors are views of it, and torch wants writable arrays; nothing is written."""
        with self.file.open("rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                raise ValueError(f"{self.file} is no longer a GGUF file")
        return np.memmap(self.file, dtype=np.uint8, mode="c")


def sidecar_path(gguf_file: Path, root: Path) -> Path:
    """Where ``gguf_folder`` puts ``gguf_file``'s folder: named by the file's resolved
    path, size and modification time (hashing gigabytes of weights would take longer
    than loading them), so a changed or replaced file gets a folder of its own."""
    resolved = gguf_file.resolve()
    return _sidecar_path(resolved, resolved.stat(), root)


def _sidecar_path(resolved: Path, stat: os.stat_result, root: Path) -> Path:
    key = f"{resolved}\n{stat.st_size}\n{stat.st_mtime_ns}\n{_LAYOUT}"
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return root / "gguf" / f"{resolved.stem}-{digest}"


def gguf_folder(gguf_file: Path, root: Path) -> Path:
    """The sidecar folder of ``gguf_file`` under ``root`` (tandem's cache root), made on
    first use.

    The file is checked before anything is written: not a GGUF file, truncated or
    corrupt, an architecture other than ``llama``, or a tensor type the loader cannot
    dequantize is a ValueError naming the file and the problem (as is a tokenizer the
    tokenizer writer refuses). The folder is built aside and renamed into place
    (``build_once``), so nothing half-written is ever under its name.
    """
    resolved = gguf_file.resolve()
    stat = resolved.stat()
    target = _sidecar_path(resolved, stat, root)
    marker = f"gguf {target.name}\n"
    complete = functools.partial(_has_marker, text=marker)
    if complete(target):
        return target
    reader = open_reader(resolved)
    tensors = tensor_table(reader, resolved, stat.st_size)
    config = hf_config(reader, tensors, resolved)

    def write(staging: Path) -> None:
        info = write_gguf_tokenizer(reader, staging)
        bos = info.bos_token_id
        write_json(
            staging / "config.json",
            {**config, "bos_token_id": bos, "eos_token_id": info.eos_token_id},
        )
        # Generation stops where llama.cpp's does: eos and the end-of-turn tokens.
        stops = list(info.stop_token_ids)
        write_json(staging / "generation_config.json", {"bos_token_id": bos, "eos_token_id": stops})
        write_json(
            staging / GGUF_JSON,
            {
                "file": str(resolved),
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "tensors": {name: t.to_json() for name, t in tensors.items()},
            },
        )
        (staging / _MARKER).write_text(marker, encoding="utf-8")

    return build_once(target, write, complete)


def _has_marker(folder: Path, text: str) -> bool:
    """Whether ``folder`` holds a finished build whose marker reads ``text``."""
    try:
        return (folder / _MARKER).read_text(encoding="utf-8") == text
    except OSError:
        return False


def open_reader(file: Path) -> GGUFReader:
    """The library's reader over ``file``, its failures as a ValueError naming the file."""
    with file.open("rb") as f:
        head = f.read(len(_MAGIC))
    if head != _MAGIC:
        raise ValueError(f"{file} is not a GGUF file (it does not start with {_MAGIC!r})")
    try:
        return GGUFReader(file)
    except Exception as exc:
        raise ValueError(
            f"{file} is a truncated or corrupt GGUF file ({type(exc).__name__}: {exc})"
        ) from exc


@functools.cache
def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` handles ``qtype`` (asked of the library by
    dequantizing one block of zeros, so a newer library's types are taken as they come)."""
    _, size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def dequantizable_types() -> list[str]:
    """The names of every type the loader can read."""
    return [t.name for t in GGMLQuantizationType if t in GGML_QUANT_SIZES and can_dequantize(t)]


def tensor_table(reader: GGUFReader, file: Path, size: int) -> dict[str, GGUFTensor]:
    """Every tensor of the file, checked to lie inside it and to be of a type the loader
    can dequantize (all offenders named at once)."""
    tensors: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = GGUFTensor(
            t.name, GGMLQuantizationType(t.tensor_type), shape, int(t.data_offset), int(t.n_bytes)
        )
    past = [t for t in tensors.values() if t.offset + t.nbytes > size]
    if past:
        first = min(past, key=lambda t: t.offset)
        raise ValueError(
            f"{file} is truncated: tensor {first.name} ends at byte {first.offset + first.nbytes}"
            f" but the file has {size} bytes ({len(past)} tensor(s) past its end)"
        )
    check_dequantizable(tensors.values(), file)
    return tensors


def check_dequantizable(tensors: Iterable[GGUFTensor], file: Path) -> None:
    """Raise one ValueError naming every tensor of a type the loader cannot read."""
    unreadable = [t for t in tensors if not can_dequantize(t.qtype)]
    if unreadable:
        listed = ", ".join(f"{t.name} ({t.qtype.name})" for t in unreadable[:8])
        more = f" and {len(unreadable) - 8} more" if len(unreadable) > 8 else ""
        raise ValueError(
            f"{file}: cannot dequantize tensor {listed}{more}; the gguf library reads "
            f"{', '.join(dequantizable_types())}"
        )


def hf_config(reader: GGUFReader, tensors: Mapping[str, GGUFTensor], file: Path) -> dict[str, Any]:
    """config.json for the file (without the token ids, which the tokenizer writer
    settles), from llama.cpp's metadata keys.

    ``torch_dtype`` is float32 whatever the file stores: every type dequantizes to
    float32 (exactly, BF16 and F16 included), and float32 is the fast dtype of tandem's
    CPU kernels; ``--dtype bfloat16`` still halves the weights' memory.
    """
    meta = _Metadata(reader, file)
    arch = meta.get("general.architecture")
    if arch != ARCHITECTURE:
        raise ValueError(
            f"{file}: architecture {arch!r} is not supported; tandem loads GGUF files of "
            f"the {ARCHITECTURE!r} architecture only (Llama 2/3, Mistral-style, SmolLM...)"
        )
    experts = meta.get_int(f"{arch}.expert_count", 0)
    if experts:
        raise ValueError(f"{file}: a mixture of {experts} experts is not supported")
    hidden = meta.get_int(f"{arch}.embedding_length")
    heads = meta.get_int(f"{arch}.attention.head_count")
    kv_heads = meta.get_int(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get_int(f"{arch}.attention.key_length", hidden // heads)
    value_dim = meta.get_int(f"{arch}.attention.value_length", head_dim)
    rotary = meta.get_int(f"{arch}.rope.dimension_count", head_dim)
    if value_dim != head_dim or rotary != head_dim:
        raise ValueError(
            f"{file}: key length {head_dim}, value length {value_dim} and rotary dimensions "
            f"{rotary} differ; tandem's Llama needs them equal"
        )
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    vocab = _vocab_size(meta, tensors, file)
    names = set(tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta.get_int(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.get_int(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.get_int(f"{arch}.context_length", 2048),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(meta, reader, head_dim, theta),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in names),
        "mlp_bias": any(n.endswith(".ffn_gate.bias") for n in names),
        "torch_dtype": "float32",
    }


class _Metadata:
    """The file's metadata values by key, with errors that name the file and key."""

    def __init__(self, reader: GGUFReader, file: Path) -> None:
        self.reader = reader
        self.file = file

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.file} lacks the metadata key {key!r}")
            return default
        return field.contents()

    def get_int(self, key: str, default: Any = ...) -> int:
        """An integer; a per-layer list of them must repeat one value."""
        value = self.get(key, default)
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise ValueError(f"{self.file}: per-layer {key} {value} is not supported")
            value = value[0]
        return int(value)


def _vocab_size(meta: _Metadata, tensors: Mapping[str, GGUFTensor], file: Path) -> int:
    """The embedding's rows (a padded embedding may have more than there are tokens),
    else ``llama.vocab_size``, else the token list's length."""
    tokens = meta.reader.get_field("tokenizer.ggml.tokens")
    listed = len(tokens.data) if tokens is not None else None
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        vocab = meta.get_int(f"{ARCHITECTURE}.vocab_size", listed)
        if vocab is None:
            raise ValueError(f"{file} has no vocabulary size, token list or token_embd.weight")
        return vocab
    rows = embedding.shape[0]
    if listed is not None and listed > rows:
        raise ValueError(f"{file}: token_embd.weight has {rows} rows for {listed} tokens")
    return rows


def _rope_scaling(
    meta: _Metadata, reader: GGUFReader, head_dim: int, theta: float
) -> dict[str, Any] | None:
    """The config's ``rope_scaling``: none, or Llama 3's, recovered from the
    ``rope_freqs`` tensor llama.cpp's converter writes for it (the per-frequency
    divisors). Linear and YaRN scaling are refused: tandem's rotary has no such type."""
    kind = meta.get(f"{ARCHITECTURE}.rope.scaling.type", "none")
    factor = float(meta.get(f"{ARCHITECTURE}.rope.scaling.factor", 1.0))
    linear = float(meta.get(f"{ARCHITECTURE}.rope.scale_linear", 1.0))
    if (kind != "none" and factor != 1.0) or linear != 1.0:
        raise ValueError(
            f"{meta.file}: rope scaling {kind!r} (factor {factor if linear == 1 else linear}) "
            "is not supported; tandem's rotary embedding knows plain and llama3 scaling"
        )
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    divisors = dequantize(np.asarray(freqs.data), GGMLQuantizationType(freqs.tensor_type))
    context = meta.get_int(f"{ARCHITECTURE}.rope.scaling.original_context_length", 8192)
    return llama3_scaling(divisors.reshape(-1), head_dim, theta, context, where=str(meta.file))


def llama3_scaling(
    divisors: np.ndarray, head_dim: int, theta: float, context: int, *, where: str
) -> dict[str, Any] | None:
    """Llama 3's rope scaling parameters that give these per-frequency divisors, or
    None for all ones.

    Only ``context / low_freq_factor`` and ``context / high_freq_factor`` shape the
    frequencies, so ``context`` is taken as given and the two factors are fitted to the
    band blended between them; the result is kept only if tandem's own
    ``compute_inv_freq`` reproduces the divisors (else a ValueError).
    """
    base = compute_inv_freq(head_dim, theta, None).double().numpy()
    f = divisors.astype(np.float64)
    if f.shape != base.shape:
        raise ValueError(f"{where}: rope_freqs has {f.size} values for {base.size} frequencies")
    if np.allclose(f, 1.0, rtol=0.0, atol=1e-6):
        return None
    factor = float(f.max())
    wavelen = 2 * math.pi / base
    candidates = [(1.0, 4.0)]  # Llama 3.1, 3.2 and 3.3
    band = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if band.sum() >= 2:
        smooth = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[band], smooth, 1)
        low = -intercept * context / slope
        high = low + context / slope
        candidates += [(float(f"{low:.6g}"), float(f"{high:.6g}")), (low, high)]
    elif band.sum() == 0 and (f <= 1 + 1e-6).any():
        # No blended band: any boundaries between the last kept and the first slowed
        # wavelength give the same frequencies.
        kept, slowed = wavelen[f <= 1 + 1e-6].max(), wavelen[f > 1 + 1e-6].min()
        high_wavelen = math.sqrt(kept * slowed)
        candidates.append((context / math.sqrt(high_wavelen * slowed), context / high_wavelen))
    for low, high in candidates:
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": context,
        }
        if low < high and np.allclose(
            compute_inv_freq(head_dim, theta, scaling).double().numpy(), base / f, rtol=1e-5
        ):
            return scaling
    raise ValueError(f"{where}: rope_freqs matches no llama3 rope scaling; cannot honour it")


def hf_name(gguf_name: str) -> str | None:
    """The model's parameter name for a llama.cpp tensor name; None for a tensor the
    model has no parameter for and that is safe to skip (``rope_freqs``, ...); the name
    itself when it is unknown (so the loader reports it as unexpected)."""
    if _IGNORED.fullmatch(gguf_name):
        return None
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return gguf_name


def is_permuted(gguf_name: str) -> bool:
    """Whether the tensor's rows are in llama.cpp's rotary layout (q and k)."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    return match is not None and match.group(2) in _PERMUTED


def unpermute_heads(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's converter's ``permute``, which stores each head's rows of q and k
    with the two rotary halves interleaved (row ``2i + t`` of a head is Hugging Face's
    row ``t * head_dim / 2 + i``). Works on any whole number of heads, so a rank's block
    of heads is unpermuted on its own."""
    shape = rows.shape
    split = rows.reshape(-1, head_dim // 2, 2, *shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(shape)


def dequantize_rows(data: np.ndarray, tensor: GGUFTensor, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of ``tensor`` in float32, read from the mapped file
    ``data``; only their bytes are touched. A 1-D tensor is one row: ``(0, 1)`` gives it
    whole.

    The rows go to the library as one long row of blocks: it dequantizes in groups of 16
    rows, which for short rows costs more in calls than in arithmetic, and blocks are
    dequantized one by one either way (the values are the same bits).
    """
    begin = tensor.offset + start * tensor.row_bytes
    raw = data[begin : begin + (stop - start) * tensor.row_bytes].view(np.ndarray)
    values = dequantize(raw.reshape(1, -1), tensor.qtype)
    return values.reshape(-1) if len(tensor.shape) == 1 else values.reshape(stop - start, -1)


def gguf_shapes(source: GGUFSource) -> dict[str, Shape]:
    """The GGUF file's tensors under the model's names (unknown ones under their own, to
    be reported), without the ones the model has no use for."""
    shapes = {}
    for gguf_name, tensor in source.tensors.items():
        name = hf_name(gguf_name)
        if name is not None:
            shapes[name] = tensor.shape
    return shapes


def kept_quantized(source: GGUFSource, config: ModelConfig) -> set[str]:
    """The model's names of the weights that stay in their blocks: each product's
    (q/k/v, o, gate/up, down; the embedding; the head) whose tensors all have a kernel
    (``quant_rows.KERNEL_TYPES``). A quantized type without one is dequantized, with a
    warning naming the tensors; float tensors (F32, F16, BF16) are dequantized as ever."""
    tensors = source.tensors
    groups = [("token_embd",), ("output",)]
    groups += [
        tuple(f"blk.{i}.{part}" for part in parts)
        for i in range(config.num_hidden_layers)
        for parts in _PRODUCTS
    ]
    kept: set[str] = set()
    slow: dict[str, list[str]] = {}
    for group in groups:
        members = [tensors.get(f"{stem}.weight") for stem in group]
        if any(t is None for t in members):
            continue  # a tied head (no output.weight); check_checkpoint refused the rest
        types = [t.qtype.name for t in members if t is not None]
        for t in members:
            if t is not None and t.qtype.name not in KERNEL_TYPES | _FLOAT_TYPES:
                slow.setdefault(t.qtype.name, []).append(t.name)
        if all(kind in KERNEL_TYPES for kind in types):
            kept.update(hf_name(t.name) or t.name for t in members if t is not None)
    for kind, names in slow.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        log.warning(
            "%s: %s tensors (%s%s) have no tandem kernel: dequantized to the model's dtype "
            "at load, as are the products they share",
            source.file.name, kind, ", ".join(names[:3]), more,
        )  # fmt: skip
    return kept


@torch.no_grad()
def copy_gguf_weights(
    model: CausalLM,
    source: GGUFSource,
    config: ModelConfig,
    quantized: Mapping[str, QuantizedLinear] | None = None,
) -> None:
    """Dequantize each GGUF tensor the model expects straight into its parameter, in the
    parameter's dtype, one tensor (and at most ``CHUNK_VALUES`` float32 values) at a
    time: never the model in float32 beside it. The weights in ``quantized`` (by the
    model's names) are decoded into their layer's row form instead."""
    params = dict(model.named_parameters())
    data = source.open()
    for gguf_name, tensor in source.tensors.items():
        name = hf_name(gguf_name)
        if quantized is not None and name in quantized:
            quantized[name].load(decode_tensor(data, tensor, config))
        elif name in params:
            _copy_tensor(params[name], data, tensor, name, model.tp, config)


def decode_tensor(data: np.ndarray, tensor: GGUFTensor, config: ModelConfig) -> RowQuant:
    """A 2-D GGUF tensor in row form (``quant_rows.decode_gguf``), q/k's rows in Hugging
    Face's order; a block layout that does not fit its type is refused naming it."""
    rows, cols = tensor.shape
    raw = data[tensor.offset : tensor.offset + tensor.nbytes].view(np.ndarray)
    quant = decode_gguf(raw, tensor.qtype, rows, cols, tensor.name)
    if not is_permuted(tensor.name):
        return quant
    order = torch.from_numpy(unpermute_heads(np.arange(rows), config.head_dim))
    offsets = None if quant.offsets is None else quant.offsets[order]
    return RowQuant(quant.codes[order], quant.scales[order], offsets, quant.block, quant.qtype)


def _copy_tensor(
    param: torch.Tensor,
    data: np.ndarray,
    tensor: GGUFTensor,
    name: str,
    tp: TensorParallel,
    config: ModelConfig,
) -> None:
    """Fill ``param`` with its rank's part of the GGUF ``tensor`` (``TensorParallel.shard_rule``).

    A split over the rows (q/k/v, gate/up, the vocabulary) dequantizes only the rank's
    rows: rows of quantized blocks are independent, and q/k's rotary layout is undone per
    head, which a rank's block of heads is made of. A split over the input dimension
    (o_proj, down_proj) has to dequantize whole rows, which are then narrowed to the
    rank's columns. 1-D tensors (norms, biases) are small: read whole, then sliced as
    ``copy_shard`` does.
    """
    permuted = is_permuted(tensor.name)
    rule = tp.shard_rule(name, config)
    if len(tensor.shape) == 1 or isinstance(rule, str):
        whole = dequantize_rows(data, tensor, 0, 1 if len(tensor.shape) == 1 else tensor.shape[0])
        if permuted:
            whole = unpermute_heads(whole, config.head_dim)
        copy_shard(param, torch.from_numpy(whole), name, tp, config)
        return
    rows, cols = tensor.shape
    start, stop, columns = 0, rows, slice(0, cols)
    if rule is not None:
        dim, indices = rule
        if dim == 0:
            start, stop = indices.start, max(indices.start, min(indices.stop, rows))
            short = stop - start < len(indices)
        else:
            columns = slice(indices.start, min(indices.stop, cols))
            short = columns.stop - columns.start < len(indices)
        if short:
            param.zero_()  # the padded end of the vocabulary
    width = columns.stop - columns.start
    unit = config.head_dim if permuted else 1
    step = max(unit, CHUNK_VALUES // cols // unit * unit)
    for first in range(start, stop, step):
        last = min(first + step, stop)
        part = dequantize_rows(data, tensor, first, last)
        if permuted:
            part = unpermute_heads(part, config.head_dim)
        param[first - start : last - start, :width].copy_(torch.from_numpy(part[:, columns]))


# Files of the sidecar folder a Hugging Face folder of the same model carries too.
_HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def export_safetensors(gguf_file: Path, target: Path, root: Path, dtype: torch.dtype) -> Path:
    """A Hugging Face folder of ``gguf_file``'s model at ``target``: its sidecar folder's
    config and tokenizer, and ``model.safetensors`` with every weight dequantized to
    ``dtype`` under Hugging Face's names, q/k back in Hugging Face's row order. Engines
    that read only safetensors (vLLM's CPU build, transformers without ``gguf``) load
    it; tied embeddings stay tied (no ``lm_head`` written). Built aside and renamed
    into place like the sidecar; an existing complete ``target`` is kept."""
    from safetensors.torch import save_file

    folder = gguf_folder(gguf_file, root)
    source = GGUFSource.read(folder)
    head_dim = json.loads((folder / "config.json").read_text(encoding="utf-8"))["head_dim"]
    marker = f"export {folder.name} {dtype}\n"

    def write(staging: Path) -> None:
        data = source.open()
        weights = {}
        for gguf_name, tensor in source.tensors.items():
            name = hf_name(gguf_name)
            if name is None:
                continue
            rows = 1 if len(tensor.shape) == 1 else tensor.shape[0]
            values = dequantize_rows(data, tensor, 0, rows)
            if is_permuted(gguf_name):
                values = unpermute_heads(values, head_dim)
            weights[name] = torch.from_numpy(values).to(dtype).contiguous()
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        for name in _HF_FILES:
            (staging / name).write_bytes((folder / name).read_bytes())
        write_json(staging / "config.json", config)
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / _MARKER).write_text(marker, encoding="utf-8")

    return build_once(target, write, functools.partial(_has_marker, text=marker))
