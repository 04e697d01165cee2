"""The CUDA-graph runner's host-side parts, on any machine: which batch sizes are
captured, which size a batch replays, the options, and the refusal of a backend that
cannot be captured. Capture and replay themselves are checked on a GPU
(``test_cuda.py``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tandem.scheduler import Engine, EngineConfig
from tandem.scheduler.attention.torch_backend import TorchAttention
from tandem.scheduler.runner.cuda_graph import DecodeGraphRunner, capture_sizes


def test_capture_sizes_step_up_and_end_at_the_largest() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert 64 in sizes  # steps of 8 up to 64...
    assert 72 not in sizes  # ...then of 16
    assert 80 in sizes
    assert sizes[-1] == 256
    assert capture_sizes(300)[-3:] == [256, 288, 300]  # steps of 32 beyond 256
    for max_bs in (3, 17, 100, 256, 300):
        sizes = capture_sizes(max_bs)
        assert sizes == sorted(set(sizes))
        assert sizes[-1] == max_bs
        # A replay pads at most 8 rows, or a quarter of the next smaller size.
        for small, big in itertools.pairwise(sizes):
            assert big - small <= max(8, small // 4)


class _Capturable(TorchAttention):
    supports_cuda_graph = True


def test_a_batch_replays_the_smallest_size_that_fits() -> None:
    runner = DecodeGraphRunner(
        torch.nn.Module(),  # type: ignore[arg-type]
        _Capturable(None, torch.zeros(1, 1)),  # type: ignore[arg-type]
        torch.device("cpu"),
        max_bs=40,
    )
    assert runner.max_bs == 40
    assert runner.padded_size(1) == 1
    assert runner.padded_size(3) == 4
    assert runner.padded_size(9) == 16
    assert runner.padded_size(33) == 40
    assert runner.padded_size(41) is None


def test_a_backend_that_cannot_be_captured_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be captured in a CUDA graph"):
        DecodeGraphRunner(
            torch.nn.Module(),  # type: ignore[arg-type]
            TorchAttention(None, torch.zeros(1, 1)),  # type: ignore[arg-type]
            torch.device("cpu"),
            max_bs=8,
        )


def test_graph_options() -> None:
    config = EngineConfig.from_options({"disable_cuda_graph": True, "cuda_graph_max_bs": 32})
    assert config.disable_cuda_graph
    assert config.cuda_graph_max_bs == 32
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be a positive int"):
        EngineConfig.from_options({"cuda_graph_max_bs": 0})


def test_the_cpu_captures_nothing() -> None:
    with Engine(
        model_path="tandem-tiny", device="cpu", max_total_tokens=256, skip_tokenizer_init=True
    ) as engine:
        assert engine.cuda_graph_batch_sizes == []
        assert engine.scheduler.runner.copy_stream is None
