"""Building a ``CausalLM`` with its weights: from a Hugging Face safetensors folder, from
a GGUF file's folder (``gguf_file.gguf_folder``), or reproducible dummy weights from the
config alone.

The model is built on the ``meta`` device (shapes only) and materialized once on the
target device in the target dtype, so a checkpoint never costs a float32 copy or a
random init that is overwritten anyway. A checkpoint is checked against the model by
name and shape before anything is allocated, and every mismatch is reported at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import safe_open

from tandem.scheduler.config import QUANTIZATIONS
from tandem.scheduler.models.decoder import CausalLM, RMSNorm
from tandem.scheduler.models.model_config import ModelConfig
from tandem.scheduler.models.quantized import (
    QuantizedLinear,
    quant_kernel,
    quantize_layers_int8,
    replace_with_quantized,
)
from tandem.scheduler.models.tensor_parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)

LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "gguf", "dummy")
DUMMY_STD = 0.02

_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
    }
)
GGUF_JSON = "gguf.json"
"""The file that makes a folder a GGUF file's (``gguf_file.gguf_folder``)."""
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"

Shape = tuple[int, ...]


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """The dtype to run in. ``"auto"`` follows the checkpoint's recorded dtype (bf16 runs
    as bf16 even on a CPU: slower than float32 there, but what the user asked for) and
    float32 when the checkpoint records none. A GGUF file's folder records float32 (see
    ``gguf_file.hf_config``): its weights are dequantized to it exactly."""
    if name == "auto":
        if config.dtype is None:
            return torch.float32
        if config.dtype not in _DTYPES:
            raise ValueError(f"checkpoint dtype {config.dtype!r} is not supported; pass a dtype")
        return _DTYPES[config.dtype]
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_model(
    model_path: str | Path | None,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    tp: TensorParallel = SINGLE,
    forward_threads: int | None = None,
    quantization: str = "none",
    int8_activations: bool = False,
) -> CausalLM:
    """A ``CausalLM`` on ``device`` in ``dtype``, in eval mode, without gradients.

    ``load_format``: ``"auto"``/``"safetensors"`` read ``model_path`` (one
    ``model.safetensors`` or shards listed by ``model.safetensors.index.json``);
    ``"auto"``/``"gguf"`` read the GGUF file a folder's ``gguf.json`` points at,
    dequantized (``gguf_file.copy_gguf_weights``); ``"dummy"`` ignores it and draws
    weights from ``seed`` (see ``dummy_tensor``).
    ``tp``: build this rank's shard, reading only its slice of each tensor (dummy
    weights are the same values as one rank's, sliced).
    ``forward_threads``: the CPU forward's intra-op threads (see ``CausalLM.pack``).
    ``quantization``: ``none`` (every weight in ``dtype``), ``gguf`` (a GGUF file's
    blocks kept, see ``keeps_blocks``) or ``int8`` (``quantized.quantize_layers_int8``);
    ``int8_activations``: their int8 products round x to one 8-bit part, not two.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose from {LOAD_FORMATS}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose from {', '.join(QUANTIZATIONS)}"
        )
    device = torch.device(device)
    parts = 1 if int8_activations else 2
    if quantization == "int8":
        _check_int8(device, tp)
    model = _build_on_meta(config, dtype, tp)
    whole = expected_shapes(_build_on_meta(config, dtype) if tp.size > 1 else model)
    if quantization == "gguf" and load_format in ("dummy", "safetensors"):
        raise ValueError(f"quantization 'gguf' needs a GGUF file, not load_format {load_format!r}")
    if load_format == "dummy":
        model = _materialize(model, device)
        _fill_dummy(model, seed, whole, config)
        if quantization == "int8":
            quantize_layers_int8(model, parts)
        return _for_inference(model, forward_threads)
    if model_path is None:
        raise ValueError(f"load_format {load_format!r} needs a model_path")
    path = Path(model_path)
    if load_format == "gguf" or (load_format == "auto" and is_gguf_folder(path)):
        if not is_gguf_folder(path):
            raise ValueError(
                f"load_format 'gguf' needs a GGUF file's folder; {path} has no {GGUF_JSON}"
            )
        # Imported here: the gguf library is slow to import.
        from tandem.scheduler.models import gguf_file

        source = gguf_file.GGUFSource.read(path)
        gguf_file.check_dequantizable(source.tensors.values(), source.file)
        check_checkpoint(whole, gguf_file.gguf_shapes(source), config, where=str(source.file))
        keep = set()
        if keeps_blocks(quantization, device, tp):
            keep = gguf_file.kept_quantized(source, config)
        tied = config.tie_word_embeddings
        quantized = replace_with_quantized(model, keep, dtype, tied, parts)
        model = _materialize(model, device)
        gguf_file.copy_gguf_weights(model, source, config, quantized)
        if quantization == "int8":
            quantize_layers_int8(model, parts)
        return _for_inference(model, forward_threads)
    if quantization == "gguf":
        raise ValueError(f"quantization 'gguf' needs a GGUF file; {path} is not one's folder")
    files = checkpoint_files(path)
    found = _tensor_shapes(files)
    check_checkpoint(whole, found, config, where=str(model_path))
    model = _materialize(model, device)
    _copy_checkpoint(model, files, config)
    if quantization == "int8":
        quantize_layers_int8(model, parts)
    return _for_inference(model, forward_threads)


def keeps_blocks(quantization: str, device: torch.device, tp: TensorParallel) -> bool:
    """Whether a GGUF file's quantized weights stay in their blocks: with ``gguf``, on
    one CPU rank whose kernels have ``linear_quant``; otherwise they are dequantized to
    the dtype, with a warning saying why."""
    if quantization != "gguf":
        return False
    why = None
    if device.type != "cpu":
        why = f"on {device.type} GGUF weights are dequantized at load"
    elif tp.size > 1:
        why = "under tensor parallelism GGUF weights are dequantized at load"
    elif not quant_kernel():
        why = "tandem's CPU kernels are not loaded, so GGUF weights are dequantized at load"
    if why is not None:
        log.warning("--quantization gguf: %s", why)
    return why is None


def _check_int8(device: torch.device, tp: TensorParallel) -> None:
    """Weight-only int8 runs on tandem's CPU kernel, on one rank."""
    if device.type != "cpu" or tp.size > 1 or not quant_kernel():
        raise ValueError(
            "quantization 'int8' runs on the CPU, on one rank, with tandem's CPU kernels "
            "(a compiler and a CPU with AVX2 and FMA or AVX-512)"
        )


def is_gguf_folder(folder: Path) -> bool:
    """Whether ``folder`` is a GGUF file's sidecar folder (``gguf_file.gguf_folder``)."""
    return (folder / GGUF_JSON).is_file()


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, shards in a stable order."""
    index = path / _INDEX_FILE
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists missing shards: {', '.join(absent)}")
        return files
    if (path / _SINGLE_FILE).is_file():
        return [path / _SINGLE_FILE]
    raise FileNotFoundError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in {path}")


def expected_shapes(model: CausalLM) -> dict[str, Shape]:
    """Every tensor a checkpoint must provide: the parameters, a tied head counted once
    (under the embedding's name, as tied checkpoints store it)."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_checkpoint(
    expected: Mapping[str, Shape],
    found: Mapping[str, Shape],
    config: ModelConfig,
    *,
    where: str,
) -> None:
    """Raise one ValueError naming every missing, mis-shaped and unexpected tensor."""
    missing = sorted(set(expected) - set(found))
    misshaped = [
        f"{n} (expected {list(expected[n])}, got {list(found[n])})"
        for n in sorted(set(expected) & set(found))
        if expected[n] != found[n]
    ]
    unexpected = sorted(n for n in set(found) - set(expected) if not _ignorable(n, config))
    problems = [
        f"{label}: {', '.join(names)}"
        for label, names in (
            ("missing", missing),
            ("mis-shaped", misshaped),
            ("unexpected", unexpected),
        )
        if names
    ]
    if problems:
        raise ValueError(
            f"checkpoint {where} does not fit {config.architecture}: " + "; ".join(problems)
        )


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Old checkpoints saved rotary ``inv_freq`` buffers (recomputed here from the
    config); some tied checkpoints also store the head they share with the embedding."""
    return name.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )


def dummy_tensor(
    name: str, shape: Shape, seed: int, *, is_norm: bool, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The float32 value of one dummy parameter, drawn on ``device``.

    It depends on (seed, name, shape, device type) only: not on dtype or the order
    parameters are created in, so two runs, two dtypes or a refactored module tree get
    the same weights. Accelerators draw on the device (an 8B model drawn on the host
    would take a minute), so their values differ from the CPU's. Norm weights are ones
    so activations keep their scale through the layers.
    """
    device = torch.device(device)
    if is_norm:
        return torch.ones(shape, device=device)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(shape, generator=generator, device=device).mul_(DUMMY_STD)


def _build_on_meta(
    config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE
) -> CausalLM:
    """Shapes and dtypes without storage (``tp``'s shard of them); also where a bad
    config (rope type, ...) fails."""
    with torch.device("meta"):
        model = CausalLM(tp.local_config(config), tp)
    return model.to(dtype=dtype)


def _materialize(model: CausalLM, device: torch.device) -> CausalLM:
    """Allocate uninitialized storage on ``device``.

    A tied head is detached first and re-tied after: ``to_empty`` would otherwise allocate
    it a second, vocabulary-sized buffer only to drop it.
    """
    if model.config.tie_word_embeddings and not isinstance(model.lm_head, QuantizedLinear):
        model.lm_head.weight = None  # type: ignore[assignment]
    model.to_empty(device=device)
    model.tie_weights()
    return model


def _tensor_shapes(files: Iterable[Path]) -> dict[str, Shape]:
    """Names and shapes from the safetensors headers, without reading any data."""
    shapes: dict[str, Shape] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


@torch.no_grad()
def _copy_checkpoint(model: CausalLM, files: Iterable[Path], config: ModelConfig) -> None:
    """Copy each stored tensor into its parameter, converting dtype and device on the way.

    Only names the model expects are read, so ignorable extras never cost a load; under
    tensor parallelism only the rank's slice of each (``TensorParallel.shard_rule``).
    """
    params = dict(model.named_parameters())
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in params:
                    copy_shard(params[name], f.get_slice(name), name, model.tp, config)


def copy_shard(
    param: torch.Tensor, stored: Any, name: str, tp: TensorParallel, config: ModelConfig
) -> None:
    """Fill ``param`` with its rank's part of ``stored`` (a safetensors slice or a
    tensor): the whole, a slice along one dimension (zeros past the end, the padded
    vocabulary), or for a reduced product's bias the whole on rank 0, zeros elsewhere."""
    rule = tp.shard_rule(name, config)
    if rule is None:
        param.copy_(stored[:])
        return
    if rule == "first":
        if tp.rank == 0:
            param.copy_(stored[:])
        else:
            param.zero_()
        return
    assert not isinstance(rule, str)
    dim, indices = rule
    shape = stored.get_shape() if hasattr(stored, "get_shape") else stored.shape
    stop = min(indices.stop, shape[dim])
    index = (slice(None),) * dim + (slice(indices.start, stop),)
    part = stored[index]
    if stop - indices.start == len(indices):
        param.copy_(part)
        return
    param.zero_()
    param.narrow(dim, 0, max(0, stop - indices.start)).copy_(part)


@torch.no_grad()
def _fill_dummy(
    model: CausalLM, seed: int, whole: Mapping[str, Shape], config: ModelConfig
) -> None:
    """Each parameter's ``dummy_tensor`` for the whole model, then the rank's part."""
    norms = {
        f"{module_name}.weight"
        for module_name, module in model.named_modules()
        if isinstance(module, RMSNorm)
    }
    for name, param in model.named_parameters():
        value = dummy_tensor(name, whole[name], seed, is_norm=name in norms, device=param.device)
        copy_shard(param, value, name, model.tp, config)


def _for_inference(model: CausalLM, forward_threads: int | None) -> CausalLM:
    """Serving never trains: no autograd bookkeeping even if a caller forgets a no-grad.
    The weights, now loaded and placed, get their inference layout (``CausalLM.pack``)."""
    model.requires_grad_(False)
    model.pack(forward_threads=forward_threads)
    return model.eval()
