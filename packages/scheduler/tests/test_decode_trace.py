"""The decode trace (a CPU decode step that continues its decode stage, replayed as one
TorchScript graph): the engine's tokens equal the eager engine's while the batch
shrinks and its sequences grow (one trace, recorded at one batch size and length,
replays them all), in both loops and with seeded sampling; the trace shares the
model's weights; and it is off when disabled (and with speculative decoding, see
the spec-eagle tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tandem.scheduler import Engine
from tandem.scheduler.attention.torch_backend import StagedDecode
from tandem.scheduler.runner.decode_trace import DecodeTrace

# Lengths that differ, so requests leave one by one and the replayed batch shrinks;
# the longest outgrows a stage's capacity (128 keys of room) twice.
INPUTS = [[(11 * i + 5 * j) % 250 + 4 for j in range(3 + 13 * i)] for i in range(5)]
MAX_NEW = [2, 60, 17, 290, 33]


def _engine(**options: Any) -> Engine:
    return Engine(
        model_path="tandem-tiny",
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        disable_progress_bar=True,
        **options,
    )


def _generate(trace: bool, overlap: bool) -> tuple[list[list[int]], DecodeTrace | None]:
    engine = _engine(disable_decode_trace=not trace, disable_overlap_schedule=not overlap)
    params: list[dict[str, Any]] = [
        {"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in MAX_NEW
    ]
    # One request samples (seeded): the trace changes the forward, not the sampler.
    params[2].update(temperature=0.8, top_p=0.9, sampling_seed=7)
    try:
        results = engine.generate(input_ids=INPUTS, sampling_params=params)
        return [r["output_ids"] for r in results], engine.scheduler.runner.decode_trace
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_traced_tokens_equal_eager_tokens(overlap: bool) -> None:
    traced, trace = _generate(trace=True, overlap=overlap)
    eager, none = _generate(trace=False, overlap=overlap)
    assert none is None
    assert traced == eager
    assert [len(ids) for ids in traced] == MAX_NEW
    assert trace is not None
    assert trace.traced
    # Most decode steps continue a stage and replay; the others (a stage's first step,
    # prefills) ran eagerly.
    assert 250 < trace.replays < sum(MAX_NEW)


@pytest.fixture
def recorded() -> Iterator[tuple[Engine, DecodeTrace]]:
    """An engine whose decode trace a short generate has recorded."""
    engine = _engine()
    try:
        engine.generate(input_ids=INPUTS[:2], sampling_params={"max_new_tokens": 4})
        trace = engine.scheduler.runner.decode_trace
        assert trace is not None
        assert trace._traced is not None
        yield engine, trace
    finally:
        engine.shutdown()


def test_the_trace_shares_the_models_weights(recorded: tuple[Engine, DecodeTrace]) -> None:
    engine, trace = recorded
    assert trace._traced is not None
    model_storage = {p.data_ptr() for p in engine.scheduler.runner.model.parameters()}
    traced = [p.data_ptr() for p in trace._traced.parameters()]
    assert traced
    assert all(ptr in model_storage for ptr in traced)


class _Spy:
    """Stands in for the recorded forward: calls it, keeps what went in and out."""

    def __init__(self, traced: Any) -> None:
        self.traced = traced
        self.calls: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self.traced(*inputs)
        self.calls.append((inputs, outputs))
        return outputs


def test_the_replay_hands_back_its_inputs(recorded: tuple[Engine, DecodeTrace]) -> None:
    """The traced forward returns the very tensors it was given after the hidden
    states, so it holds them until the call has retaken the GIL: an input dropped
    mid-replay would make torch take the GIL there (docs/concepts/overlap-loop.md)."""
    engine, trace = recorded
    spy = _Spy(trace._traced)
    trace._traced = spy  # type: ignore[assignment]
    engine.generate(input_ids=INPUTS[:3], sampling_params={"max_new_tokens": 8})
    assert spy.calls
    for inputs, outputs in spy.calls:
        hidden, *returned = outputs
        assert hidden.shape[0] == inputs[0].shape[0]
        assert len(returned) == len(inputs)
        assert all(out is given for out, given in zip(returned, inputs, strict=True))


def test_the_trace_is_off_when_disabled() -> None:
    engine = _engine(disable_decode_trace=True)
    try:
        assert engine.scheduler.runner.decode_trace is None
        out = engine.generate(input_ids=INPUTS[1], sampling_params={"max_new_tokens": 3})
        assert len(out["output_ids"]) == 3
    finally:
        engine.shutdown()


def test_staged_decode_round_trips_through_its_tensors() -> None:
    t = [torch.full((1,), float(i)) for i in range(3 + 4 * 2)]
    staged = StagedDecode.from_tensors(tuple(t), num_layers=2, kernel=False)
    assert staged.k_cache == (t[3], t[4])
    assert staged.v_stage == (t[9], t[10])
    assert all(a is b for a, b in zip(staged.tensors(), t, strict=True))
    with pytest.raises(ValueError, match="not a 3-layer StagedDecode"):
        StagedDecode.from_tensors(tuple(t), num_layers=3, kernel=False)


def test_a_torch_that_cannot_record_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("tracing is not available")

    expected, _ = _generate(trace=False, overlap=True)
    monkeypatch.setattr(torch.jit, "trace", refuse)
    tokens, trace = _generate(trace=True, overlap=True)
    assert tokens == expected
    assert trace is not None
    assert not trace.traced
    assert trace.replays == 0
