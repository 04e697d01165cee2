"""Models whose weights stay quantized (``--quantization``): the loader keeps a GGUF
file's blocks exactly (every kernel type, q/k un-permuted, a tied head sharing the
embedding's table, mixed types in one product), dequantizes a type without a kernel
with a warning, refuses a block layout that does not fit its type naming the tensor,
makes weight-only int8 from float weights; and on the real default model the
quantized engine against the dequantized one: greedy tokens over chat prompts (equal
but at near-ties), perplexity over a fixed text as llama.cpp's ``llama-perplexity``
scores it (within 0.5 %; with x in one 8-bit part, and weight-only int8, within 1 %),
and the memory held.

A near-tie: where the two engines' greedy tokens first differ, the dequantized engine's
log-probabilities of the two tokens differ by at most ``TIE`` (the quantized product
sums the same float32 values in another order, a few units in the last place)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_gguf_loading import SHAPE, make_llama, write_gguf

from tandem.scheduler import Engine
from tandem.scheduler.engine.wiring import INT8_LONG_FROM_TOKENS
from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models import ModelConfig, gguf_file, load_model
from tandem.scheduler.models.gguf_file import GGUFTensor, gguf_folder
from tandem.scheduler.models.quant_rows import KERNEL_TYPES
from tandem.scheduler.models.quantized import (
    QuantizedEmbedding,
    QuantizedLinear,
    quant_kernel,
    quantize_layers_int8,
)
from tandem.scheduler.models.tiny import cache_root
from tandem.scheduler.text.tokenizer import Tokenizer

Q = gguf_file.GGMLQuantizationType
TIE = 1e-3
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_build.load_cpu_kernels(cache_root() / "kernels")


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("quantized") / "tied", seed=21, tied=True)


def _load(folder: Path, quantization: str) -> Any:
    config = ModelConfig.from_pretrained(folder)
    return load_model(folder, config, dtype=torch.float32, device="cpu", quantization=quantization)


def _linears(model: Any) -> dict[str, torch.nn.Module]:
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name in PROJECTIONS:
            module = layer.self_attn if name[0] in "qkvo" else layer.mlp
            out[f"{i}.{name}"] = getattr(module, name)
    return out


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
def test_a_gguf_files_blocks_stay_quantized_and_compute_what_dequantized_ones_do(
    tmp_path: Path, tied: Path, qtype: str
) -> None:
    if not quant_kernel():
        return  # test_cpu_quant checks the op is absent exactly below AVX2
    file = write_gguf(tmp_path / f"{qtype}.gguf", tied, Q[qtype])
    folder = gguf_folder(file, tmp_path / "cache")
    quantized, plain = _load(folder, "gguf"), _load(folder, "none")
    for name, module in _linears(quantized).items():
        assert isinstance(module, QuantizedLinear), name
    # The packed products keep the codes; their panels dequantize to the plain weights.
    attn = quantized.model.layers[0].self_attn
    assert attn.qkv.quant[0].qtype == qtype
    q_rows = plain.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(attn.qkv.quant[0].dequantize()[: q_rows.shape[0]], q_rows)  # unpermuted
    embedding = quantized.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    assert embedding.head is quantized.lm_head
    assert torch.equal(embedding.head.dequantized(), plain.model.embed_tokens.weight)
    ids = torch.tensor([5, 17, 42, 99, 3, 250, 11])
    positions = torch.arange(len(ids))
    with torch.no_grad():
        got = quantized.compute_logits(_forward(quantized, ids, positions))
        want = plain.compute_logits(_forward(plain, ids, positions))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=_atol(want))


def _atol(want: torch.Tensor) -> float:
    """The same float32 weights, summed in another order through two layers, x rounded
    for the int8 dot products to 1 / 65,000 of each block's largest value: 1e-3 of the
    largest logit (the crafted K-quant blocks make large weights)."""
    return 1e-3 * want.abs().max().item()


def _forward(model: Any, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    from reference_models import DenseCausalAttention

    return model(ids, positions, DenseCausalAttention([len(ids)]))


def test_a_type_without_a_kernel_is_dequantized_with_a_warning(
    tmp_path: Path, tied: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = write_gguf(tmp_path / "q5k.gguf", tied, Q.Q5_K)
    folder = gguf_folder(file, tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        model = _load(folder, "gguf")
    assert "Q5_K tensors (" in caplog.text
    assert "have no tandem kernel" in caplog.text
    assert "blk.0.attn_q.weight" in caplog.text or "token_embd.weight" in caplog.text
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)


def test_one_product_of_two_types_keeps_both(tmp_path: Path, tied: Path) -> None:
    if not quant_kernel():
        return
    # llama.cpp's Q4_K_M mix: v and down in Q6_K, the rest in Q4_K.
    types = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}
    file = write_gguf(tmp_path / "mix.gguf", tied, Q.Q4_K, mix=types)
    folder = gguf_folder(file, tmp_path / "cache")
    quantized, plain = _load(folder, "gguf"), _load(folder, "none")
    qkv = quantized.model.layers[0].self_attn.qkv
    assert [p.qtype for p in qkv.quant] == ["Q4_K", "Q6_K"]  # q+k stacked, then v
    x = torch.randn(5, SHAPE["hidden_size"])
    want = plain.model.layers[0].self_attn.qkv(x)
    for got, expected in zip(qkv(x), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=_atol(expected))


def test_a_block_layout_that_does_not_fit_its_type_is_refused_naming_the_tensor(
    tied: Path,
) -> None:
    config = ModelConfig.from_pretrained(tied)
    data = np.zeros(4096, dtype=np.uint8)
    odd = GGUFTensor("blk.3.ffn_up.weight", Q.Q4_1, (4, 48), 0, 4 * 30)
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_up\.weight"):
        gguf_file.decode_tensor(data, odd, config)
    short = GGUFTensor("blk.1.attn_v.weight", Q.Q8_0, (4, 64), 0, 100)
    with pytest.raises(ValueError, match=r"blk\.1\.attn_v\.weight"):
        gguf_file.decode_tensor(data, short, config)


def test_weight_only_int8_from_float_weights(checkpoints: dict[str, Path]) -> None:
    if not quant_kernel():
        return
    path = checkpoints["llama"]
    config = ModelConfig.from_pretrained(path)
    plain = load_model(path, config, dtype=torch.float32, device="cpu")
    int8 = load_model(path, config, dtype=torch.float32, device="cpu", quantization="int8")
    for name, module in _linears(int8).items():
        assert isinstance(module, QuantizedLinear), name
        assert module.qtype == "int8", name
    assert isinstance(int8.lm_head, torch.nn.Linear)  # the head keeps its dtype
    weight = plain.model.layers[0].mlp.down_proj.weight
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    packed = int8.model.layers[0].mlp.down.quant[0].dequantize()
    assert ((packed - weight).abs() <= step / 2 + 1e-7).all()  # one rounding per weight
    with pytest.raises(ValueError, match="needs a GGUF file"):
        load_model(path, config, dtype=torch.float32, device="cpu", quantization="gguf")


# -- the real default model ------------------------------------------------------------------

SYSTEM = "You are a helpful assistant. Answer briefly and precisely."
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What does a CPU do?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
)
NEW_TOKENS = 32
# Perplexity as llama.cpp's llama-perplexity scores it: chunks of the text, each scored
# over its second half (every token given at least half a chunk before it).
TEXT = Path(__file__).parents[3] / "tools" / "data" / "tinyshakespeare.txt"
CHUNK, CHUNKS = 512, 4


@pytest.fixture(scope="module")
def chat(smollm2_gguf: Path) -> list[list[int]]:
    from tandem.scheduler.models.source import resolve_model

    tokenizer = Tokenizer.from_pretrained(resolve_model(str(smollm2_gguf)))
    out = []
    for question in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    text = tokenizer.encode(TEXT.read_text(encoding="utf-8")[:40000], add_special_tokens=False)
    out += [text[i * CHUNK : (i + 1) * CHUNK] for i in range(CHUNKS)]
    return out


def _run(
    model: Path, quantization: str, prompts: list[list[int]], **options: Any
) -> dict[str, Any]:
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with Engine(
        model_path=str(model), quantization=quantization, dtype="float32", **options
    ) as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params=greedy, return_logprob=True, top_logprobs_num=5,
            logprob_start_len=0,
        )  # fmt: skip
        info = engine.get_server_info()
        threads = engine.forward_threads
    return {"outs": outs, "info": info, "threads": threads}


@pytest.fixture(scope="module")
def runs(smollm2_gguf: Path, chat: list[list[int]]) -> dict[str, dict[str, Any]]:
    out = {q: _run(smollm2_gguf, q, chat) for q in ("gguf", "none", "int8")}
    out["gguf-one-part"] = _run(smollm2_gguf, "gguf", chat, cpu_int8_activations=True)
    return out


def _perplexity(outs: list[dict[str, Any]]) -> float:
    scored = []
    for out in outs[-CHUNKS:]:
        scored += [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][CHUNK // 2 :]]
    return math.exp(-sum(scored) / len(scored))


def test_the_quantized_engines_greedy_tokens_are_the_dequantized_ones_but_near_ties(
    runs: dict[str, dict[str, Any]],
) -> None:
    quantized, plain = runs["gguf"]["outs"][:-CHUNKS], runs["none"]["outs"][:-CHUNKS]
    exact = 0
    for got, want in zip(quantized, plain, strict=True):
        if got["output_ids"] == want["output_ids"]:
            exact += 1
            continue
        pairs = zip(got["output_ids"], want["output_ids"], strict=True)
        j = next(i for i, (a, b) in enumerate(pairs) if a != b)
        top = {t: lp for lp, t, _ in want["meta_info"]["output_top_logprobs"][j]}
        wanted, other = want["output_ids"][j], got["output_ids"][j]
        assert other in top, f"step {j}: {other} is not among the dequantized engine's top 5"
        assert top[wanted] - top[other] <= TIE, f"step {j}: gap {top[wanted] - top[other]:.2e}"
    assert exact >= len(plain) - 1


def test_the_quantized_engines_perplexity_is_within_half_a_percent(
    runs: dict[str, dict[str, Any]],
) -> None:
    plain = _perplexity(runs["none"]["outs"])
    assert 20 < plain < 60  # a small model reading Shakespeare (llama.cpp's figure: 40.3)
    assert abs(_perplexity(runs["gguf"]["outs"]) / plain - 1) <= 0.005
    # Weight-only int8 of the same weights: one more rounding per weight, still close.
    assert abs(_perplexity(runs["int8"]["outs"]) / plain - 1) <= 0.01
    # x in one 8-bit part (``--cpu-int8-activations``), as llama.cpp rounds it: within
    # 1 % too, its offsets multiplying x as rounded (test_cpu_quant; the figures before
    # and after: docs/benchmarks.md).
    assert abs(_perplexity(runs["gguf-one-part"]["outs"]) / plain - 1) <= 0.01


def test_int8_leaves_a_layer_whose_inputs_4_does_not_divide_in_float(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The kernel reads 8-bit codes in fours: such a layer keeps its float weight (the
    same module), with a warning naming it; its neighbour is converted."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].odd = torch.nn.Linear(6, 8)
    model.layers[0].even = torch.nn.Linear(8, 8)
    odd = model.layers[0].odd
    with caplog.at_level(logging.WARNING):
        assert quantize_layers_int8(model) == 1
    assert model.layers[0].odd is odd
    assert isinstance(model.layers[0].even, QuantizedLinear)
    assert "layers.0.odd keeps its float weight" in caplog.text


def test_the_quantized_engine_holds_a_fraction_of_the_weights_memory(
    runs: dict[str, dict[str, Any]],
) -> None:
    held = {q: run["info"]["weights_bytes"] for q, run in runs.items() if q != "gguf-one-part"}
    assert held["gguf"] < 0.3 * held["none"]  # Q4_1 and Q8_0 blocks against float32
    assert held["int8"] < 0.6 * held["none"]  # the layers in int8, the table in float32


def test_the_int8_products_decode_steps_of_a_request_or_two_are_short(
    runs: dict[str, dict[str, Any]],
) -> None:
    """Kept quantized and multiplied by int8 dot products, the default model's decode
    steps of fewer than ``INT8_LONG_FROM_TOKENS`` tokens run on one core fewer, where
    dequantized every step of it is long (``wiring.default_forward_threads``)."""
    quantized, plain = runs["gguf"]["threads"], runs["none"]["threads"]
    assert plain.long_from_tokens == 1
    if quant_kernel():
        assert quantized.long_from_tokens == INT8_LONG_FROM_TOKENS
        assert (quantized.short, quantized.long) == (plain.short, plain.long)
    else:  # no kernel for them (no AVX2): the weights are dequantized
        assert quantized == plain


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_engine_tokens_with_quantized_weights_equal_dequantized_ones(
    tmp_path: Path, tied: Path, overlap: bool
) -> None:
    if not quant_kernel():
        return
    folder = gguf_folder(write_gguf(tmp_path / "q8.gguf", tied, Q.Q8_0), tmp_path / "cache")
    prompts = [[5, 17, 42, 99, 3], [7, 8], [300, 1, 64, 64, 64, 12, 9, 200]]
    # Different lengths: the decode batch shrinks, and the decode trace replays each size.
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (9, 3, 6)]
    outs = {}
    for quantization in ("gguf", "none"):
        options = {"disable_overlap_schedule": not overlap, "quantization": quantization}
        with Engine(model_path=str(folder), dtype="float32", **options) as engine:
            outs[quantization] = [o["output_ids"] for o in engine.generate(
                input_ids=prompts, sampling_params=params
            )]  # fmt: skip
    assert outs["gguf"] == outs["none"]
