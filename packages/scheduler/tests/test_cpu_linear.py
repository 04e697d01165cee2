"""tandem's float32 product for a few tokens (``torch.ops.tandem.linear_few_rows``, built
from ``models/cpu_linear.cpp`` on CPUs with AVX-512): against ``F.linear`` on the
column-major weights the model keeps, at both row counts it takes and with row tails
that are not a multiple of its vectors; the inputs it refuses; the packed projections
that take it (``packing.with_few_rows``) and only for one or two tokens; and an engine's
tokens with it equal to its tokens without, in both loops, through the decode trace.
On a CPU without AVX-512 the op does not exist and nothing takes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference_models import DenseCausalAttention, tiny_model_config

from tandem.scheduler import Engine
from tandem.scheduler.attention import cpu_kernel
from tandem.scheduler.default_model import cache_root, default_model_path
from tandem.scheduler.models import CausalLM, load_model, packing
from tandem.scheduler.models.packing import FEW_ROWS_UP_TO, few_rows_available

AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernel.load_cpu_kernels(cache_root() / "kernels")


def _column_major(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A ``[rows, cols]`` float32 weight stored column-major, as ``pack`` leaves it."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(cols, rows, generator=gen).t()


def test_the_op_exists_exactly_on_avx512() -> None:
    assert few_rows_available() == AVX512


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize(("rows", "cols"), [(9000, 768), (1280, 768), (100, 2048), (17, 5), (1, 3)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_few_rows_equals_f_linear(tokens: int, rows: int, cols: int, bias: bool) -> None:
    if not AVX512:
        return  # test_the_op_exists_exactly_on_avx512 checks it is absent
    weight = _column_major(rows, cols, seed=rows + cols)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, cols, generator=gen)
    b = torch.randn(rows, generator=gen) if bias else None
    got = torch.ops.tandem.linear_few_rows(x, weight, b)
    # float32 sums in another order: within a few units in the last place of |x| |w|.
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=2e-5 * cols**0.5)


def test_linear_few_rows_keeps_leading_dimensions_and_reads_strided_rows() -> None:
    if not AVX512:
        return
    weight = _column_major(40, 24, seed=1)
    x = torch.randn(2, 48)[:, ::2]  # rows strided
    got = torch.ops.tandem.linear_few_rows(x, weight, None)
    torch.testing.assert_close(got, F.linear(x, weight))
    x3 = torch.randn(1, 1, 24)
    got = torch.ops.tandem.linear_few_rows(x3, weight, None)
    assert got.shape == (1, 1, 40)
    torch.testing.assert_close(got, F.linear(x3, weight))


def test_linear_few_rows_refuses_what_it_does_not_take() -> None:
    if not AVX512:
        return
    weight = _column_major(8, 4, seed=2)
    op = torch.ops.tandem.linear_few_rows
    with pytest.raises(RuntimeError, match="column-major"):
        op(torch.randn(1, 4), weight.contiguous(), None)
    with pytest.raises(RuntimeError, match="1 or 2 tokens"):
        op(torch.randn(3, 4), weight, None)
    with pytest.raises(RuntimeError, match="takes float32"):
        op(torch.randn(1, 4).bfloat16(), weight.bfloat16(), None)
    with pytest.raises(RuntimeError, match="x has 3 features"):
        op(torch.randn(1, 3), weight, None)
    with pytest.raises(RuntimeError, match="the bias"):
        op(torch.randn(1, 4), weight, torch.randn(7))
    with pytest.raises(RuntimeError, match="an empty weight"):
        op(torch.randn(1, 4), torch.empty(4, 0).t(), None)


def _packed(model: CausalLM) -> list[packing.PackedLinear]:
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    found = [attn.qkv, attn.o, mlp.gate_up, mlp.down, model.head]
    assert all(p is not None for p in found)
    return [p for p in found if p is not None]


@torch.no_grad()
def _logits_and_ops(model: CausalLM, n: int) -> tuple[torch.Tensor, set[str]]:
    ids = torch.randint(96, (n,), generator=torch.Generator().manual_seed(n))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        hidden = model(ids, torch.arange(n), DenseCausalAttention([n]))
        logits = model.compute_logits(hidden)
    return logits, {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_products_take_the_op_for_one_or_two_tokens(dtype: torch.dtype) -> None:
    config = tiny_model_config(architectures=["LlamaForCausalLM"])
    model = load_model(None, config, dtype=dtype, device="cpu", load_format="dummy")
    model.pack(onednn=True, forward_threads=2)
    plain = CausalLM(model.config).to(dtype).eval()
    plain.load_state_dict(model.state_dict())
    model.use_fused_cpu_ops()
    plain.use_fused_cpu_ops()  # the same element-wise ops, unpacked products
    takes = AVX512 and dtype == torch.float32
    assert {p.few_rows_up_to for p in _packed(model)} == {FEW_ROWS_UP_TO if takes else 0}
    for n in (1, 2, 3, 9):
        logits, ops = _logits_and_ops(model, n)
        want, _ = _logits_and_ops(plain, n)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(logits, want, rtol=tol, atol=tol)
        assert ("tandem::linear_few_rows" in ops) == (takes and n <= FEW_ROWS_UP_TO)


def test_a_tied_head_keeps_onednn() -> None:
    config = tiny_model_config(architectures=["LlamaForCausalLM"], tie_word_embeddings=True)
    model = load_model(None, config, dtype=torch.float32, device="cpu", load_format="dummy")
    model.pack(onednn=True, forward_threads=2)
    model.use_fused_cpu_ops()
    assert model.head is not None
    assert model.head.few_rows_up_to == 0  # the embedding's rows are not column-major
    assert model.model.layers[0].mlp.down is not None
    assert model.model.layers[0].mlp.down.few_rows_up_to == (FEW_ROWS_UP_TO if AVX512 else 0)


def _wide_checkpoint(folder: Path) -> Path:
    """The default model's config at hidden 256 (the smallest with oneDNN copies);
    its weights come from ``load_format="dummy"``."""
    base = default_model_path()
    config = json.loads((base / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, num_hidden_layers=2)  # fmt: skip
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _tokens(path: Path, overlap: bool) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        model_path=str(path),
        load_format="dummy",
        dtype="float32",
        skip_tokenizer_init=True,
        disable_progress_bar=True,
        disable_overlap_schedule=not overlap,
    )
    prompts = [[(7 * i + 3 * j) % 200 + 4 for j in range(5 + 9 * i)] for i in range(3)]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (40, 12, 25)]
    try:
        # One request alone (one token a step), then three (three, then two, then one).
        alone = engine.generate(input_ids=prompts[:1], sampling_params=params[:1])
        together = engine.generate(input_ids=prompts, sampling_params=params)
        return [r["output_ids"] for r in alone + together], engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_engine_tokens_with_the_op_equal_tokens_without(
    overlap: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _wide_checkpoint(tmp_path / "wide")
    with_op, engine = _tokens(path, overlap)
    model = engine.scheduler.runner.model
    assert {p.few_rows_up_to for p in _packed(model)} == {FEW_ROWS_UP_TO if AVX512 else 0}
    # The forward runs on the engine's worker thread, out of the profiler's sight: the
    # engine's own packed product, called here, shows that it takes the op.
    down = _packed(model)[3]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        down(torch.randn(1, down.weight.shape[1]))
    ops = {event.key for event in prof.key_averages()}
    assert ("tandem::linear_few_rows" in ops) == AVX512
    trace = engine.scheduler.runner.decode_trace
    assert trace is not None
    assert trace.replays > 0
    monkeypatch.setattr(packing, "FEW_ROWS_UP_TO", 0)
    without, reference = _tokens(path, overlap)
    assert {p.few_rows_up_to for p in _packed(reference.scheduler.runner.model)} == {0}
    assert with_op == without
    assert [len(ids) for ids in with_op] == [40, 40, 12, 25]
