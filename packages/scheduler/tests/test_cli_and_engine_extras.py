"""The offline command line, the progress bar, and requests in flight while another
call is refused."""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import pytest
import torch
from reference_models import VOCAB

from tandem.futuremap import create_stream
from tandem.scheduler import Engine
from tandem.scheduler.engine.cli import main
from tandem.scheduler.engine.wiring import (
    INT8_LONG_FROM_TOKENS,
    LONG_STEP_WEIGHTS,
    LONG_TOKEN_WEIGHTS,
    default_forward_threads,
)
from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models import ModelConfig
from tandem.scheduler.models.tiny import cache_root, default_model_path
from tandem.scheduler.runner.cpu_step import CpuStep, ForwardThreads

PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _engine(path: Path, **options: object) -> Engine:
    opts = {"dtype": "float32", "device": "cpu", "disable_overlap_schedule": True}
    opts.update(options)
    return Engine(model_path=str(path), **opts)


def test_cli_generates_with_the_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The CPU kernels from this machine's cache, not built anew into the empty one.
    assert cpu_build.load_cpu_kernels(cache_root() / "kernels")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    tiny = ["--model-path", "tandem-tiny"]
    assert main([*tiny, "--prompt", "Hello", "--max-new-tokens", "5", "--device", "cpu"]) == 0
    assert main([*tiny, "--chat", "--prompt", "Hi", "--max-new-tokens", "3", "--no-stream"]) == 0
    out = capsys.readouterr().out
    assert "--- 'Hello'" in out
    assert "--- 'Hi'" in out
    assert (tmp_path / "tandem").is_dir()  # the tiny model was built in the cache


def test_cli_reports_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert main(["--model-path", "tandem-tiny", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["--model-path", str(tmp_path / "missing")]) == 2


def test_progress_bar_only_in_a_terminal_and_can_be_disabled(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    created: list[int] = []
    import tqdm

    real = tqdm.tqdm

    def spy(*args: object, **kwargs: object) -> object:
        created.append(int(kwargs.get("total", 0)))
        return real(*args, **kwargs)

    monkeypatch.setattr(tqdm, "tqdm", spy)
    batch = [[3, 4, 5], [6, 7]]
    with _engine(checkpoints["llama"]) as engine:
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
        engine.generate(input_ids=batch, sampling_params=PARAMS)
        assert created == [2]
        engine.generate(input_ids=batch[0], sampling_params=PARAMS)  # one prompt: no bar
        assert created == [2]
    with _engine(checkpoints["llama"], disable_progress_bar=True) as quiet:
        quiet.generate(input_ids=batch, sampling_params=PARAMS)
    assert created == [2]


def test_a_refused_request_leaves_requests_in_flight_alone(checkpoints: dict[str, Path]) -> None:
    long = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    prompt = [(5 * i) % VOCAB for i in range(20)]
    with _engine(checkpoints["qwen2"]) as engine:
        reference = engine.generate(input_ids=prompt, sampling_params=long)
        result: dict[str, object] = {}
        stream = engine.generate(input_ids=prompt, sampling_params=long, stream=True)
        first = next(stream)  # the request is running now

        def finish() -> None:
            result["ids"] = first["output_ids"] + [t for c in stream for t in c["output_ids"]]

        worker = threading.Thread(target=finish)
        worker.start()
        for bad in ({"temperature": -2}, {"top_k": -5}, {"max_new_tokens": -1}):
            with pytest.raises(ValueError, match=next(iter(bad))):
                engine.generate(input_ids=prompt, sampling_params=bad)
        with pytest.raises(ValueError, match="input_ids"):
            engine.generate(input_ids=[VOCAB + 1])
        worker.join(60)
        info = engine.get_server_info()
    assert result["ids"] == reference["output_ids"]
    assert info["free_rows"] == info["max_running_requests"]


@pytest.mark.parametrize("overlap", [True, False])
def test_flush_cache_empties_the_radix_cache_only_when_idle(
    checkpoints: dict[str, Path], overlap: bool
) -> None:
    prompt = [(7 * i) % VOCAB for i in range(30)]
    long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    with _engine(checkpoints["llama"], disable_overlap_schedule=not overlap) as engine:
        engine.generate(input_ids=prompt, sampling_params=PARAMS)
        assert engine.get_server_info()["cached_kv_tokens"] > 0
        stream = engine.generate(input_ids=prompt, sampling_params=long, stream=True)
        next(stream)  # the request is running now
        assert engine.flush_cache() is False
        assert engine.get_server_info()["cached_kv_tokens"] > 0
        for _ in stream:
            pass
        for _ in range(3):  # right after the answer, its last batch maybe still in flight
            assert engine.flush_cache() is True
            info = engine.get_server_info()
            assert info["cached_kv_tokens"] == 0
            assert info["available_kv_tokens"] == info["max_total_tokens"]
            again = engine.generate(input_ids=prompt, sampling_params=PARAMS)
            assert again["meta_info"]["cached_tokens"] == 0  # nothing left to match
    with _engine(checkpoints["llama"], disable_radix_cache=True) as engine:
        assert engine.flush_cache() is True  # nothing to flush


def test_n_samples_per_prompt(checkpoints: dict[str, Path]) -> None:
    params = {"max_new_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": True}
    with _engine(checkpoints["llama3"]) as engine:
        outs = engine.generate(input_ids=[4, 5, 6], sampling_params=params)
        again = engine.generate(input_ids=[4, 5, 6], sampling_params=params)
        two = engine.generate(input_ids=[[4, 5, 6], [9, 9]], sampling_params=params)
    assert len(outs) == 3
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in again]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    assert len(two) == 6
    assert [o["output_ids"] for o in two[:3]] == [o["output_ids"] for o in outs]


def test_context_length_beyond_the_model_is_refused(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="context_length"):
        _engine(checkpoints["llama"], context_length=10_000)


@pytest.mark.parametrize("threads", [None, 1])
def test_the_cpu_forward_thread_leaves_a_core_to_the_scheduler(threads: int | None) -> None:
    caller = torch.get_num_threads()
    options = {} if threads is None else {"cpu_forward_threads": threads}
    with Engine(
        model_path="tandem-tiny", device="cpu", skip_tokenizer_init=True, **options
    ) as engine:
        short = threads or max(1, caller - 1)
        stream = engine.scheduler.runner.stream
        assert stream.submit(torch.get_num_threads).result() == short
        info = engine.get_server_info()
        assert info["forward_threads_short"] == short
        assert info["forward_threads"] == (threads or caller)
        policy = engine.forward_threads
        assert policy is not None
        assert info["forward_threads_long_from_tokens"] == policy.long_from_tokens
        out = engine.generate(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 3})
        assert len(out["output_ids"]) == 3
        # Every step of the tiny model is short: a prefill as well as a decode.
        assert stream.submit(torch.get_num_threads).result() == short
    assert torch.get_num_threads() == caller, "the caller's threads are its own"


def test_a_large_model_forward_takes_every_core() -> None:
    small = ModelConfig.from_pretrained(default_model_path())
    assert small.matmul_weights_per_token < LONG_TOKEN_WEIGHTS
    threads = default_forward_threads(small, 2)
    assert (threads.short, threads.long) == (1, 2)
    # A prefill long enough is long: the weights it multiplies by reach LONG_STEP_WEIGHTS.
    assert threads.for_tokens(threads.long_from_tokens - 1) == 1
    assert threads.for_tokens(threads.long_from_tokens) == 2
    assert threads.long_from_tokens * small.matmul_weights_per_token >= LONG_STEP_WEIGHTS
    assert (threads.long_from_tokens - 1) * small.matmul_weights_per_token < LONG_STEP_WEIGHTS
    assert default_forward_threads(small, 1) == ForwardThreads(1, 1, threads.long_from_tokens)
    # A ~100M-parameter Llama: hidden 768, 12 layers, 4 of 12 heads for K/V, vocab 9000.
    large = dataclasses.replace(
        small, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=9000,
    )  # fmt: skip
    per_layer = 768 * (768 + 2 * 256) + 768 * 768 + 3 * 768 * 2048
    assert large.matmul_weights_per_token == 12 * per_layer + 768 * 9000
    assert default_forward_threads(large, 2) == ForwardThreads(1, 2, 1)
    assert default_forward_threads(large, 16).for_tokens(1) == 16
    # Kept quantized, multiplied by int8 dot products: a decode step of a request or two
    # is short at any size, a step of INT8_LONG_FROM_TOKENS long; a small model's rule
    # for its prefills stands.
    int8 = default_forward_threads(large, 2, int8_products=True)
    assert int8 == ForwardThreads(1, 2, INT8_LONG_FROM_TOKENS)
    assert int8.for_tokens(INT8_LONG_FROM_TOKENS - 1) == 1
    assert default_forward_threads(small, 2, int8_products=True) == threads


def test_a_cpu_step_runs_on_the_threads_its_tokens_call_for() -> None:
    seen: list[int] = []

    class Model:
        def forward_capture(self, input_ids, positions, attention, capture):
            seen.append(torch.get_num_threads())
            return input_ids, []

    stream = create_stream(torch.device("cpu"), name="test-forward")
    try:
        step = CpuStep(stream, Model(), None, None, ForwardThreads(1, 2, long_from_tokens=4))
        assert stream.submit(torch.get_num_threads).result() == 1, "set before any step"
        for tokens in (3, 4, 9, 1):
            fb = type("Batch", (), {"input_ids": torch.zeros(tokens), "positions": None})()
            stream.submit(step.forward, fb, []).result()
        assert seen == [1, 2, 2, 1]
    finally:
        stream.close()
    with pytest.raises(ValueError, match="positive"):
        ForwardThreads(0, 2)


def test_cpu_forward_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cpu_forward_threads"):
        Engine(model_path="tandem-tiny", device="cpu", cpu_forward_threads=0)
