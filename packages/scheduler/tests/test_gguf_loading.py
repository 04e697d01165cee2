"""GGUF files (llama.cpp's format) against references no one here wrote.

Synthetic GGUFs are written with the ``gguf`` library's own writer from tiny random
Llamas made by transformers, the way llama.cpp's converter does (q/k rows permuted into
its rotary layout, matrices quantized with ``gguf.quants.quantize``; K-quant blocks the
library cannot make are crafted with sane scales). tandem's parameters must equal the
library's ``dequantize`` of the stored bytes with transformers' un-permutation (exactly),
the float32 file must give back the original weights and transformers' tokens and
logits, and the real SmolLM2 file transformers' own GGUF loading. Then tensor
parallelism, and the bad files that must be refused before anything is written.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from accelerate import init_empty_weights
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from reference_models import DenseCausalAttention, load_reference, randomize
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tandem.scheduler import Engine
from tandem.scheduler.models import CausalLM, ModelConfig, gguf_file, load_model
from tandem.scheduler.models.gguf_file import (
    GGUFSource,
    dequantizable_types,
    gguf_folder,
    llama3_scaling,
    sidecar_path,
)
from tandem.scheduler.models.rope import compute_inv_freq
from tandem.scheduler.models.tensor_parallel import TensorParallel
from tandem.scheduler.models.tiny import cache_root
from tandem.scheduler.models.weights import GGUF_JSON
from tandem.scheduler.text.tokenizer import byte_alphabet

Q = GGMLQuantizationType
# Every row length a multiple of 256, the K-quants' block.
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}
VOCAB = 320
BOS, EOS = 1, 2
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
PROMPTS = [[5, 17, 42, 99, 3, 250, 11], [7, 8], [300, 1, 64, 64, 64, 12, 9, 200, 31, 77, 18, 4, 6]]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
LOGIT_TOLERANCE = 1e-4  # float32 tandem against float32 eager transformers, as test_engine

# The f16 scales of the K-quant blocks the library cannot quantize (byte offsets in a
# block, from ggml's block_q*_K structs): set to sane values, the rest random bytes.
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
LISTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
LISTED += ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


# -- writing GGUFs as llama.cpp's converter does -----------------------------------------------


def make_llama(path: Path, *, seed: int, tied: bool, vocab: int = VOCAB, rope: Any = None) -> Path:
    config = LlamaConfig(
        **SHAPE, vocab_size=vocab, tie_word_embeddings=tied, bos_token_id=BOS,
        eos_token_id=EOS, rope_theta=500000.0 if rope else 10000.0, rope_scaling=rope,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    model.save_pretrained(path)
    return path


def _gguf_name(hf: str) -> str:
    """The converter's tensor names."""
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in names:
        return names[hf]
    parts = hf.split(".")  # model.layers.N.module.proj.weight
    block, module = parts[2], ".".join(parts[3:5])
    gg = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm.weight": "attn_norm",
        "post_attention_layernorm.weight": "ffn_norm",
    }  # fmt: skip
    return f"blk.{block}.{gg[module]}.weight"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's ``LlamaModel.permute``."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _crafted(values: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Valid blocks of a type the library cannot quantize: random bytes, with the known
    f16 scales of the K-quants set to small values; other types get bytes below 0x3c,
    so that any f16/e8m0 field in them is finite and small."""
    rows, cols = values.shape
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype in K_QUANT_SCALES:
        for at in K_QUANT_SCALES[qtype]:
            scale = rng.uniform(0.002, 0.02, (rows, cols // block, 1)).astype(np.float16)
            raw[..., at : at + 2] = scale.view(np.uint8)
    else:
        raw %= 0x3C
    return raw.reshape(rows, -1)


def _stored(values: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    try:
        return quantize(values, qtype)
    except NotImplementedError:
        return _crafted(values, qtype, seed)


def _tokens(vocab: int) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary of ``vocab`` tokens: GPT-2's byte alphabet, letter-pair
    merges, and three control tokens at the end."""
    tokens, types = byte_alphabet(), [1] * 256
    merges = []
    letters = "etaoinshrdlu"
    pairs = ((a, b) for a in letters for b in letters)
    while len(tokens) < vocab - 3:
        a, b = next(pairs)
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    return tokens, merges, types


def write_gguf(
    file: Path,
    checkpoint: Path,
    qtype: GGMLQuantizationType = Q.F32,
    *,
    architecture: str = "llama",
    tokenizer: bool = True,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
    raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    mix: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """``checkpoint`` as llama.cpp's converter writes it: metadata, q/k permuted, matrices
    stored as ``qtype`` (norms float32), llama3 rope as ``rope_freqs``. ``edit`` changes
    the tensors before writing; ``raw`` adds tensors stored as given; ``mix`` stores
    the matrices of a kind (``attn_v``) as another type, as llama.cpp's mixes do."""
    config = json.loads((checkpoint / "config.json").read_text())
    state = {k: v.numpy() for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    tensors = {}
    for name, value in state.items():
        if name.endswith("q_proj.weight"):
            value = _permute(value, heads)
        elif name.endswith("k_proj.weight"):
            value = _permute(value, kv)
        tensors[_gguf_name(name)] = value
    # transformers 5 writes the rotary settings under rope_parameters, 4 at the top level.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_factors(theta, head_dim, rope)
    if edit is not None:
        edit(tensors)

    w = gguf.GGUFWriter(str(file), architecture)
    a = architecture
    w.add_uint32(f"{a}.block_count", config["num_hidden_layers"])
    w.add_uint32(f"{a}.context_length", config["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", config["hidden_size"])
    w.add_uint32(f"{a}.feed_forward_length", config["intermediate_size"])
    w.add_uint32(f"{a}.attention.head_count", heads)
    w.add_uint32(f"{a}.attention.head_count_kv", kv)
    w.add_float32(f"{a}.rope.freq_base", theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    w.add_uint32(f"{a}.vocab_size", config["vocab_size"])
    w.add_uint32(f"{a}.rope.dimension_count", head_dim)
    if tokenizer:
        tokens, merges, types = _tokens(config["vocab_size"])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(len(tokens) - 2)
        w.add_eos_token_id(len(tokens) - 3)
    for i, (name, value) in enumerate(tensors.items()):
        if value.ndim == 1:
            w.add_tensor(name, value.astype(np.float32))
            continue
        kind = (mix or {}).get(name.split(".")[-2], qtype)
        stored = _stored(value, kind, seed=i)
        w.add_tensor(name, stored, raw_dtype=kind if stored.dtype == np.uint8 else None)
    for name, (data, kind) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return file


def _llama3_factors(theta: float, dim: int, rope: dict[str, Any]) -> np.ndarray:
    """The converter's ``rope_freqs``: per frequency, the divisor Llama 3's scaling
    applies (a plain loop over the frequencies, as it is written there)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints (transformers' save_pretrained): untied, tied, and llama3 rope."""
    root = tmp_path_factory.mktemp("gguf-checkpoints")
    return {
        "untied": make_llama(root / "untied", seed=11, tied=False),
        "tied": make_llama(root / "tied", seed=12, tied=True),
        "llama3": make_llama(root / "llama3", seed=13, tied=False, rope=LLAMA3),
    }


def _folder(tmp_path: Path, checkpoint: Path, qtype: GGMLQuantizationType = Q.F32) -> Path:
    file = write_gguf(tmp_path / f"{checkpoint.name}-{qtype.name}.gguf", checkpoint, qtype)
    return gguf_folder(file, tmp_path / "cache")


def _load(folder: Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> CausalLM:
    return load_model(
        folder, ModelConfig.from_pretrained(folder), dtype=dtype, device="cpu", **kwargs
    )


def _reference_weights(file: Path, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """The library's dequantization of every tensor, un-permuted by transformers."""
    processor = LlamaTensorProcessor(
        config={"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    )
    reader = gguf.GGUFReader(file)
    out = {}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        values = processor.process(weights=values, name=t.name).weights
        out[t.name] = torch.from_numpy(np.array(values))
    return out


def _hf_names() -> dict[str, str]:
    names = {
        _gguf_name(n): n
        for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    }
    for i in range(SHAPE["num_hidden_layers"]):
        for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        ):  # fmt: skip
            names[_gguf_name(f"model.layers.{i}.{m}.weight")] = f"model.layers.{i}.{m}.weight"
        for m in ("input_layernorm", "post_attention_layernorm"):
            names[_gguf_name(f"model.layers.{i}.{m}.weight")] = f"model.layers.{i}.{m}.weight"
    return names


# -- the folder ---------------------------------------------------------------------------


def test_the_folder_holds_the_files_config_tokenizer_and_a_pointer(
    tmp_path: Path, tiny: dict[str, Path]
) -> None:
    folder = _folder(tmp_path, tiny["untied"], Q.Q8_0)
    file = tmp_path / "untied-Q8_0.gguf"
    assert folder == sidecar_path(file, tmp_path / "cache")
    assert folder.parent == tmp_path / "cache" / "gguf"
    assert folder.name.startswith("untied-Q8_0-")
    assert {p.name for p in folder.iterdir()} >= {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        GGUF_JSON,
    }  # fmt: skip
    ours = ModelConfig.from_pretrained(folder)
    hf = ModelConfig.from_pretrained(tiny["untied"])
    for field in (
        "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
        "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
    ):  # fmt: skip
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.rms_norm_eps == float(np.float32(1e-5))  # stored as float32 by llama.cpp
    assert ours.dtype == "float32"
    assert ours.bos_token_id == VOCAB - 2
    assert ours.eos_token_id == (VOCAB - 3,)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert VOCAB - 3 in generation["eos_token_id"]  # <|endoftext|>
    assert VOCAB - 1 in generation["eos_token_id"]  # <|im_end|>, an end of turn for llama.cpp
    pointer = json.loads((folder / GGUF_JSON).read_text())
    stat = file.stat()
    assert (pointer["file"], pointer["size"], pointer["mtime_ns"]) == (
        str(file.resolve()), stat.st_size, stat.st_mtime_ns,
    )  # fmt: skip
    assert pointer["tensors"]["blk.0.attn_q.weight"]["type"] == "Q8_0"
    assert pointer["tensors"]["blk.0.attn_q.weight"]["shape"] == [256, 256]
    assert pointer["tensors"]["blk.0.ffn_down.weight"]["shape"] == [256, 512]


def test_the_folder_is_made_once_and_a_changed_file_gets_a_new_one(
    tmp_path: Path, tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    file = write_gguf(tmp_path / "m.gguf", tiny["tied"])
    root = tmp_path / "cache"
    first = gguf_folder(file, root)

    def never(*_: Any) -> None:
        raise AssertionError("the file was read again")

    with monkeypatch.context() as m:
        m.setattr(gguf_file, "open_reader", never)
        assert gguf_folder(file, root) == first
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ValueError, match="changed after"):
        GGUFSource.read(first)
    second = gguf_folder(file, root)
    assert second != first
    assert sorted(p.name for p in (root / "gguf").iterdir()) == sorted([first.name, second.name])


# -- weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_float32_weights_are_the_original_ones(
    tmp_path: Path, tiny: dict[str, Path], tied: bool
) -> None:
    checkpoint = tiny["tied" if tied else "untied"]
    model = _load(_folder(tmp_path, checkpoint))
    original = load_file(str(checkpoint / "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(params) == set(original)
    for name, value in original.items():
        assert torch.equal(params[name], value), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("qtype", dequantizable_types())
def test_weights_are_the_librarys_dequantization_unpermuted(
    tmp_path: Path, tiny: dict[str, Path], qtype: str
) -> None:
    kind = Q[qtype]
    folder = _folder(tmp_path, tiny["untied"], kind)
    file = tmp_path / f"untied-{qtype}.gguf"
    reference = _reference_weights(file, SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"])
    assert gguf.GGUFReader(file).tensors[0].tensor_type == kind
    params = dict(_load(folder).named_parameters())
    for gguf_name, hf_name in _hf_names().items():
        expected = reference[gguf_name]
        assert torch.isfinite(expected).all(), gguf_name
        assert torch.equal(params[hf_name], expected), f"{hf_name} ({qtype})"


def test_every_listed_type_is_dequantized() -> None:
    assert set(LISTED) <= set(dequantizable_types())


def test_bfloat16_weights_are_the_dequantization_rounded(
    tmp_path: Path, tiny: dict[str, Path]
) -> None:
    folder = _folder(tmp_path, tiny["tied"], Q.Q4_K)
    reference = _reference_weights(
        tmp_path / "tied-Q4_K.gguf", SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    )
    params = dict(_load(folder, torch.bfloat16).named_parameters())
    for gguf_name, hf_name in _hf_names().items():
        if gguf_name in reference:
            assert params[hf_name].dtype == torch.bfloat16
            assert torch.equal(params[hf_name], reference[gguf_name].bfloat16()), hf_name


def test_every_bad_tensor_is_named_before_anything_is_allocated(
    tmp_path: Path, tiny: dict[str, Path]
) -> None:
    def edit(tensors: dict[str, np.ndarray]) -> None:
        del tensors["blk.1.ffn_up.weight"]
        tensors["blk.0.ffn_gate.weight"] = tensors["blk.0.ffn_gate.weight"][:256]
        tensors["blk.0.attn_sinks.weight"] = np.zeros(4, dtype=np.float32)

    file = write_gguf(tmp_path / "bad.gguf", tiny["untied"], edit=edit)
    folder = gguf_folder(file, tmp_path / "cache")
    with pytest.raises(ValueError, match="does not fit LlamaForCausalLM") as err:
        _load(folder)
    message = str(err.value)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "model.layers.0.mlp.gate_proj.weight (expected [512, 256], got [256, 256])" in message
    assert "unexpected: blk.0.attn_sinks.weight" in message


def test_load_formats(tmp_path: Path, tiny: dict[str, Path]) -> None:
    folder = _folder(tmp_path, tiny["untied"])
    assert torch.equal(
        dict(_load(folder, load_format="gguf").named_parameters())["model.norm.weight"],
        load_file(str(tiny["untied"] / "model.safetensors"))["model.norm.weight"],
    )
    with pytest.raises(ValueError, match=f"has no {GGUF_JSON}"):
        _load(tiny["untied"], load_format="gguf")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        _load(folder, load_format="safetensors")


# -- the engine against transformers ------------------------------------------------------------


def _teacher_forced(model: Any, prompt: list[int], out: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + out[:-1]])
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1 :].float()


@pytest.mark.parametrize("which", ["untied", "tied", "llama3"])
def test_engine_on_the_float32_file_equals_transformers_on_the_original(
    tmp_path: Path, tiny: dict[str, Path], which: str
) -> None:
    folder = _folder(tmp_path, tiny[which])
    reference = load_reference(tiny[which])
    if which == "llama3":
        scaling = ModelConfig.from_pretrained(folder).rope_scaling
        assert scaling is not None
        assert scaling["rope_type"] == "llama3"
        theirs = reference.model.rotary_emb.inv_freq
        ours = compute_inv_freq(64, 500000.0, scaling)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    with Engine(model_path=str(folder), dtype="auto", device="cpu") as engine:
        assert engine.dtype == torch.float32  # a GGUF's auto dtype
        engine.scheduler.record_logits = True
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        logs = engine.scheduler.recorded_logits
    for prompt, result in zip(PROMPTS, results, strict=True):
        ours_logits = torch.stack(logs[result["meta_info"]["id"]])
        ref = _teacher_forced(reference, prompt, result["output_ids"])
        assert ref.std() > 0.5, "logits too flat for the comparison to mean much"
        assert (ours_logits - ref).abs().max().item() <= LOGIT_TOLERANCE
        ids = torch.tensor([prompt])
        expected = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert result["output_ids"] == expected


@pytest.mark.parametrize(
    ("head_dim", "context", "factor"),
    [(128, 8192, 8.0), (64, 8192, 32.0), (64, 32, 8.0), (16, 32, 8.0), (16, 8192, 8.0)],
)
def test_llama3_rope_is_recovered_from_rope_freqs(
    head_dim: int, context: int, factor: float
) -> None:
    """Llama 3.1/3.2's own parameters, and contexts whose blended band holds several
    frequencies or none: the recovered scaling gives transformers' frequencies."""
    rope = {**LLAMA3, "factor": factor, "original_max_position_embeddings": context}
    scaling = llama3_scaling(
        _llama3_factors(500000.0, head_dim, rope), head_dim, 500000.0, 8192, where="f"
    )
    assert scaling is not None
    hf = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=131072,
        rope_parameters={**rope, "rope_theta": 500000.0},
    )  # fmt: skip
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    torch.testing.assert_close(
        compute_inv_freq(head_dim, 500000.0, scaling), theirs, rtol=1e-6, atol=0
    )
    if context == 8192:
        assert (scaling["low_freq_factor"], scaling["high_freq_factor"]) == (1.0, 4.0)
    ones = np.ones(head_dim // 2, dtype=np.float32)
    assert llama3_scaling(ones, head_dim, 500000.0, 8192, where="f") is None
    noise = np.random.default_rng(0).uniform(1, 8, head_dim // 2).astype(np.float32)
    with pytest.raises(ValueError, match="matches no llama3 rope scaling"):
        llama3_scaling(noise, head_dim, 500000.0, 8192, where="f")


# -- the real model ------------------------------------------------------------------------------


def _transformers_smollm2(file: Path) -> Any:
    """transformers' Llama of SmolLM2-135M's known shape with the file's weights as its
    own GGUF loading gets them: the library's reader and ``dequantize``, llama.cpp's name
    map (``gguf.get_tensor_name_map``) and transformers' q/k un-permutation. (Its
    ``from_pretrained(dir, gguf_file=...)`` gives the same tensors bit for bit but reads
    the metadata twice and builds its name map per module: 15 s and more here.)"""
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=8192,
    )  # fmt: skip
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tensors = {t.name: t for t in gguf.GGUFReader(file).tensors}
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    state = {}
    for name, _ in model.named_parameters():
        if name == "lm_head.weight":
            continue  # tied
        t = tensors[names.get_name(name, try_suffixes=(".weight",))]
        values = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name).weights
        state[name] = torch.from_numpy(np.array(values))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.config._attn_implementation = "eager"
    return model.eval()


def test_the_real_smollm2_file_equals_transformers(smollm2_gguf: Path) -> None:
    # The folder users get (in tandem's cache, beside the file): made once per machine.
    folder = gguf_folder(smollm2_gguf, cache_root())
    config = ModelConfig.from_pretrained(folder)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.rope_scaling) == (49152, 100000.0, None)
    assert config.tie_word_embeddings
    assert config.max_position_embeddings == 8192
    model = _load(folder)
    prompt = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1])
    with torch.no_grad():
        ours = model.compute_logits(
            model(prompt, torch.arange(len(prompt)), DenseCausalAttention([len(prompt)]))
        )
        theirs = _transformers_smollm2(smollm2_gguf)(input_ids=prompt[None]).logits[0]
    assert theirs.std() > 1.0
    # The same dequantized weights; the sums run in another order over 30 layers
    # (measured: 1e-4 at logits of magnitude up to 35).
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


# -- tensor parallelism -----------------------------------------------------------------------


def test_two_ranks_generate_what_one_does(tmp_path: Path, tiny: dict[str, Path]) -> None:
    folder = _folder(tmp_path, tiny["untied"], Q.Q4_1)
    outputs = []
    for tp_size in (1, 2):
        options = {"dtype": "float32", "device": "cpu", "tp_size": tp_size}
        with Engine(model_path=str(folder), **options) as engine:
            results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        outputs.append([r["output_ids"] for r in results])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("vocab", [VOCAB, VOCAB + 1])  # + 1: the last rank's rows padded
def test_a_ranks_weights_are_its_slice_of_the_whole_read_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vocab: int
) -> None:
    checkpoint = make_llama(tmp_path / "ckpt", seed=21, tied=True, vocab=vocab)
    folder = _folder(tmp_path, checkpoint, Q.Q4_K)
    config = ModelConfig.from_pretrained(folder)
    whole = dict(_load(folder).named_parameters())
    reads: list[tuple[str, int, int]] = []
    real = gguf_file.dequantize_rows

    def logged(data: Any, tensor: Any, start: int, stop: int) -> Any:
        reads.append((tensor.name, start, stop))
        return real(data, tensor, start, stop)

    monkeypatch.setattr(gguf_file, "dequantize_rows", logged)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        reads.clear()
        shard = dict(_load(folder, tp=tp).named_parameters())
        for name, full in whole.items():
            rule = tp.shard_rule(name, config)
            if rule is None:
                assert torch.equal(shard[name], full), name
                continue
            assert isinstance(rule, tuple)
            dim, indices = rule
            stop = min(indices.stop, full.shape[dim])
            part = full.narrow(dim, indices.start, stop - indices.start)
            mine = shard[name].narrow(dim, 0, stop - indices.start)
            assert torch.equal(mine, part), name
            assert (
                not shard[name]
                .narrow(dim, stop - indices.start, len(indices) - (stop - indices.start))
                .any()
            )
        rows: dict[str, set[int]] = {}
        for name, start, stop in reads:
            rows.setdefault(name, set()).update(range(start, stop))
        heads = tp.block(config.num_attention_heads)
        kv = tp.kv_heads(config)
        inner = tp.block(config.intermediate_size)
        vocab_rows = tp.vocab_rows(vocab)
        assert rows["blk.0.attn_q.weight"] == set(range(heads.start * 64, heads.stop * 64))
        assert rows["blk.1.attn_k.weight"] == set(range(kv.start * 64, kv.stop * 64))
        assert rows["blk.1.ffn_up.weight"] == set(inner)
        assert rows["token_embd.weight"] == set(
            range(vocab_rows.start, min(vocab_rows.stop, vocab))
        )
        # A split over the input dimension reads whole rows, narrowed after.
        assert rows["blk.0.ffn_down.weight"] == set(range(256))


# -- bad files ---------------------------------------------------------------------------------


def _assert_refused(file: Path, root: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gguf_folder(file, root)
    where = root / "gguf"
    assert not where.exists() or list(where.iterdir()) == []


def test_bad_files_are_refused_before_anything_is_written(
    tmp_path: Path, tiny: dict[str, Path]
) -> None:
    good = write_gguf(tmp_path / "good.gguf", tiny["untied"])
    data = good.read_bytes()
    root = tmp_path / "cache"

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])
    _assert_refused(cut, root, r"cut\.gguf is (a )?truncated")
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:200])
    _assert_refused(header, root, r"header\.gguf is (a )?truncated")

    noise = tmp_path / "noise.gguf"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _assert_refused(noise, root, r"noise\.gguf is not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _assert_refused(empty, root, r"empty\.gguf is not a GGUF file")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    _assert_refused(garbage, root, r"garbage\.gguf is a truncated or corrupt GGUF file")

    for arch in ("qwen2", "gpt2"):
        other = write_gguf(tmp_path / f"{arch}.gguf", tiny["untied"], architecture=arch)
        _assert_refused(
            other, root, f"architecture '{arch}' is not supported.*'llama' architecture only"
        )

    block, size = GGML_QUANT_SIZES[Q.Q8_K]
    odd = np.zeros((4, 256 // block * size), dtype=np.uint8)
    unsupported = write_gguf(
        tmp_path / "q8k.gguf", tiny["untied"], raw={"blk.0.extra.weight": (odd, Q.Q8_K)}
    )
    _assert_refused(unsupported, root, r"cannot dequantize tensor blk\.0\.extra\.weight \(Q8_K\)")

    bare = write_gguf(tmp_path / "bare.gguf", tiny["untied"], tokenizer=False)
    _assert_refused(bare, root, "has no tokenizer")


@pytest.mark.parametrize("tied", [False, True])
def test_the_safetensors_copy_holds_the_original_weights_and_transformers_reads_it(
    tmp_path: Path, tiny: dict[str, Path], tied: bool
) -> None:
    """An F32 file's copy is the checkpoint it was made from, tensor for tensor (q/k in
    Hugging Face's order again, no lm_head when tied); transformers loads the copy and
    gives the same logits as from the original checkpoint."""
    checkpoint = tiny["tied" if tied else "untied"]
    file = write_gguf(tmp_path / f"{checkpoint.name}.gguf", checkpoint)
    copy = gguf_file.export_safetensors(file, tmp_path / "copy", tmp_path / "cache", torch.float32)
    assert gguf_file.export_safetensors(file, copy, tmp_path / "cache", torch.float32) == copy
    exported = load_file(str(copy / "model.safetensors"))
    original = load_file(str(checkpoint / "model.safetensors"))
    assert set(exported) == set(original) - ({"lm_head.weight"} if tied else set())
    for name, value in exported.items():
        assert torch.equal(value, original[name]), name
    assert not (copy / GGUF_JSON).exists()
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    ours = AutoModelForCausalLM.from_pretrained(copy, torch_dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
