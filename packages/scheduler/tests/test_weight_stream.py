"""The weight stream (``kernels/cpu_stream.cpp``, ``models/weight_stream.py``): products of
few rows over its weights tell it where the step is and it reads ahead of them, products
of many rows and over other weights do not; it never changes a product; a product
reports to the last stream opened that holds its weight; closing stops it; bad
arguments are refused.
Then through the engine: on by default for the default model's quantized weights where
a short step leaves a core free, off under ``disable_cpu_weight_stream`` or with one
thread for every step, the same greedy tokens either way, closed at shutdown."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.scheduler.engine.engine import Engine
from tandem.scheduler.engine.wiring import _weight_stream
from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models.quant_panels import QuantPanels, to_quant_panels
from tandem.scheduler.models.quant_rows import RowQuant
from tandem.scheduler.models.tiny import cache_root
from tandem.scheduler.models.weight_stream import WeightStream, WeightStreamStats
from tandem.scheduler.runner.cpu_step import ForwardThreads


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_build.load_cpu_kernels(cache_root() / "kernels")


def _panels(rows: int, cols: int, seed: int) -> QuantPanels:
    gen = torch.Generator().manual_seed(seed)
    groups = (rows, cols // 32)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scales = torch.rand(groups, generator=gen) * 0.02
    offsets = (torch.rand(groups, generator=gen) - 0.5) * 0.1
    return to_quant_panels(RowQuant(codes, scales, offsets, 32, "Q4_1"))


def _read_some(stream: WeightStream, products: list[QuantPanels], x: torch.Tensor) -> None:
    """Products of one row until the stream has read something: its thread runs beside
    them, so how much it reads by a given point is up to the OS (milliseconds; the
    deadline only turns a stream that never reads into a failure rather than a hang)."""
    deadline = time.monotonic() + 120
    while stream.stats().lines_read == 0:
        assert time.monotonic() < deadline, "the weight stream read nothing"
        for panels in products:
            panels(x)
        time.sleep(0.001)


def test_short_products_move_the_stream_and_it_reads_ahead() -> None:
    products = [_panels(96, 64, seed) for seed in range(4)]
    stream = WeightStream(products, rows_below=4, window_bytes=1 << 16)
    try:
        x = torch.randn(1, 64)
        _read_some(stream, products, x)
        before = stream.stats()
        assert before.short_products >= len(products)
        assert before.long_products == 0
        for panels in products:
            panels(torch.randn(4, 64))  # a long step: at rows_below
        after = stream.stats()
        assert after.long_products == before.long_products + len(products)
        assert after.short_products == before.short_products
        _panels(96, 64, 9)(x)  # a weight it does not hold
        assert stream.stats().short_products == after.short_products
    finally:
        stream.close()


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_the_stream_never_changes_a_product(tokens: int) -> None:
    products = [_panels(130, 96, seed) for seed in range(3)]
    x = torch.randn(tokens, 96)
    bias, residual = torch.randn(130), torch.randn(tokens, 130)
    alone = [p(x, bias, residual) for p in products]
    stream = WeightStream(products, rows_below=4, window_bytes=4096)
    try:
        _read_some(stream, products, torch.randn(1, 96))
        for _ in range(3):
            for panels, want in zip(products, alone, strict=True):
                assert torch.equal(panels(x, bias, residual), want)
    finally:
        stream.close()


def test_a_product_reports_to_the_last_stream_opened_that_holds_its_weight() -> None:
    """Of two streams over the same weights the later one hears of them; a stream over
    other weights opened after both (a second engine in the process, as under ``tandem
    bench --compare-speculative``) takes none of their reports."""
    products = [_panels(48, 32, seed) for seed in range(2)]
    others = [_panels(48, 32, seed) for seed in range(2, 5)]
    first = WeightStream(products, rows_below=2)
    second = WeightStream(products, rows_below=2)
    third = WeightStream(others, rows_below=2)
    streams = (first, second, third)
    try:
        x = torch.randn(1, 32)
        for panels in [*products, *others]:
            panels(x)
        assert [s.stats().short_products for s in streams] == [0, len(products), len(others)]
        second.close()
        for panels in products:
            panels(x)
        assert first.stats().short_products == len(products)
        assert third.stats().short_products == len(others)
    finally:
        for stream in streams:
            stream.close()


def test_close_stops_the_stream_and_is_idempotent() -> None:
    products = [_panels(48, 32, 0)]
    stream = WeightStream(products, rows_below=2)
    stream.close()
    stream.close()
    assert stream.closed
    assert stream.stats() == WeightStreamStats(0, 0, 0)
    products[0](torch.randn(1, 32))  # no stream to report to: nothing happens


def test_an_empty_stream_reads_nothing() -> None:
    stream = WeightStream([], rows_below=2)
    try:
        assert stream.stats() == WeightStreamStats(0, 0, 0)
    finally:
        stream.close()


def test_bad_arguments_are_refused() -> None:
    panels = _panels(48, 32, 0)
    tensors = [panels.codes, panels.scales, panels.offsets]
    with pytest.raises(RuntimeError, match="window_bytes and rows_below must be positive"):
        torch.ops.tandem.weight_stream_open(tensors, [0], 0, 2)
    with pytest.raises(RuntimeError, match="is not one of 3"):
        torch.ops.tandem.weight_stream_open(tensors, [3], 1024, 2)
    with pytest.raises(RuntimeError, match="contiguous CPU tensors"):
        torch.ops.tandem.weight_stream_open([torch.randn(8, 8).t()], [0], 1024, 2)
    with pytest.raises(RuntimeError, match="no open stream"):
        torch.ops.tandem.weight_stream_stats(-1)


def test_no_stream_without_a_core_left_free() -> None:
    from tandem.scheduler.config import EngineConfig

    class Model:
        def quant_products(self) -> list[QuantPanels]:
            return [_panels(48, 32, 0)]

    model = Model()
    cfg = EngineConfig()
    assert _weight_stream(cfg, model, None) is None  # type: ignore[arg-type]
    assert _weight_stream(cfg, model, ForwardThreads.fixed(2)) is None  # type: ignore[arg-type]
    off = EngineConfig(disable_cpu_weight_stream=True)
    assert _weight_stream(off, model, ForwardThreads(1, 2, 4)) is None  # type: ignore[arg-type]
    stream = _weight_stream(cfg, model, ForwardThreads(1, 2, 4))  # type: ignore[arg-type]
    assert stream is not None
    assert stream.rows_below == 4
    stream.close()


def _greedy(engine: Engine) -> list[list[int]]:
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    return [out["output_ids"] for out in engine.generate(prompts, params)]


def test_the_default_model_streams_its_weights_with_the_same_tokens() -> None:
    with Engine(device="cpu") as engine:
        tokens_on = _greedy(engine)
        info = engine.get_server_info()
        stream = engine._parts.weight_stream
    with Engine(device="cpu", disable_cpu_weight_stream=True) as engine:
        tokens_off = _greedy(engine)
        assert engine.get_server_info()["cpu_weight_stream"] is False
    assert tokens_on == tokens_off
    # A core left free by a short step: every machine the suite runs on has two.
    free_core = info["forward_threads_short"] < info["forward_threads"]
    assert info["cpu_weight_stream"] is free_core
    if free_core:
        assert info["cpu_weight_stream_short_products"] > 0  # every decode step reported
        assert info["cpu_weight_stream_long_products"] > 0  # and the prompts' prefills
        assert stream is not None
        assert stream.closed  # the shutdown closed it
