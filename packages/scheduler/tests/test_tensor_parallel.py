"""Tensor parallelism on the CPU (gloo, two ranks on loopback) against one rank and
transformers: greedy tokens for every family, both loops, radix and chunked prefill on;
seeded sampling; sharded loading; the refusals at start; a rank that dies."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import idle_clean
from reference_models import FAMILIES, load_reference, make_llama
from safetensors import safe_open
from safetensors.torch import load_file

from tandem.scheduler import Engine
from tandem.scheduler.config import EngineConfig
from tandem.scheduler.models import ModelConfig, load_model
from tandem.scheduler.models import weights as weights_module
from tandem.scheduler.models.tensor_parallel import TensorParallel
from tandem.scheduler.parallel.distributed import join

PROMPTS = [[5, 17, 42, 99, 3, 250, 11], [7, 8], [300, 1, 64, 64, 64, 12, 9, 200, 31, 77, 18, 4, 6]]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
BASE = {"dtype": "float32", "device": "cpu", "debug_futures": True, "chunked_prefill_size": 4}


def _outputs(path: Path, params: Any = GREEDY, **options: Any) -> list[list[int]]:
    with Engine(model_path=str(path), **{**BASE, **options}) as engine:
        first = engine.generate(input_ids=PROMPTS, sampling_params=params)
        # Again: the prompts' prefixes now come from the radix cache.
        again = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert all(r["meta_info"]["cached_tokens"] > 0 for r in again[::2])
        idle_clean(engine)
    # Greedy and seeded requests repeat themselves; the others draw on.
    each = params if isinstance(params, list) else [params] * len(PROMPTS)
    for p, a, b in zip(each, first, again, strict=True):
        if p.get("temperature") == 0 or "seed" in p:
            assert a["output_ids"] == b["output_ids"]
    return [r["output_ids"] for r in first]


def _hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = load_reference(path).generate(  # type: ignore[operator]
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        min_new_tokens=n, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return list(out[0, len(prompt) :].tolist())


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_equals_tp1_and_transformers(checkpoints: dict[str, Path], family: str) -> None:
    path = checkpoints[family]
    sharded = _outputs(path, tp_size=2)
    assert sharded == _outputs(path, tp_size=1)
    assert sharded == [_hf_greedy(path, p, GREEDY["max_new_tokens"]) for p in PROMPTS]


def test_tp2_on_the_normal_loop_and_with_one_kv_head(tmp_path: Path) -> None:
    # Four query heads over one KV head: each rank keeps a copy of it.
    path = make_llama(tmp_path / "mqa", seed=7, kv_ratio=4)
    sharded = _outputs(path, tp_size=2, disable_overlap_schedule=True)
    assert sharded == _outputs(path, tp_size=1)
    assert sharded == [_hf_greedy(path, p, GREEDY["max_new_tokens"]) for p in PROMPTS]


def test_seeded_sampling_is_the_same_in_two_tp_runs(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["mistral"]
    params = [
        {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": 1234},
        {"max_new_tokens": 10, "temperature": 1.3, "ignore_eos": True},  # the engine's seed
        {"max_new_tokens": 8, "temperature": 0.7, "top_k": 20, "seed": 7},
    ]
    first = _outputs(path, params, tp_size=2, random_seed=5)
    assert first == _outputs(path, params, tp_size=2, random_seed=5)
    assert len(set(map(tuple, first))) == 3


class _ReadLog:
    """Wraps ``safe_open`` to count the elements each tensor read returns."""

    def __init__(self) -> None:
        self.reads: dict[str, list[int]] = {}

    def open(self, *args: Any, **kwargs: Any) -> Any:
        log = self

        class Handle:
            def __init__(self) -> None:
                self.inner = safe_open(*args, **kwargs)

            def __enter__(self) -> Handle:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                self.inner.__exit__(*exc)

            def keys(self) -> Any:
                return self.inner.keys()

            def get_slice(self, name: str) -> Any:
                stored = self.inner.get_slice(name)

                class Slice:
                    def get_shape(self) -> Any:
                        return stored.get_shape()

                    def __getitem__(self, index: Any) -> torch.Tensor:
                        part = stored[index]
                        log.reads.setdefault(name, []).append(part.numel())
                        return part

                return Slice()

        return Handle()


def test_sharded_loading_reads_each_slice_once(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoints["qwen2"]  # tied embeddings, q/k/v biases
    mc = ModelConfig.from_pretrained(path)
    whole = load_file(str(path / "model.safetensors"))
    shards = []
    for rank in range(2):
        log = _ReadLog()
        monkeypatch.setattr(weights_module, "safe_open", log.open)
        tp = TensorParallel(rank, 2)
        model = load_model(path, mc, dtype=torch.float32, device="cpu", tp=tp)
        params = dict(model.named_parameters())
        for name, counts in log.reads.items():
            assert len(counts) == 1, f"{name} read {len(counts)} times"
            assert counts[0] == params[name].numel() <= whole[name].numel()
        assert set(log.reads) == set(params)
        shards.append(params)
    for name, full in whole.items():
        rule = TensorParallel(0, 2).shard_rule(name, mc)
        parts = [shards[r][name].detach() for r in range(2)]
        if rule is None:
            assert all(torch.equal(part, full) for part in parts), name
        else:
            assert isinstance(rule, tuple), name
            assert torch.equal(torch.cat(parts, dim=rule[0]), full), name


def test_a_tp_size_that_does_not_divide_is_refused_with_the_numbers(
    checkpoints: dict[str, Path],
) -> None:
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide .*num_attention_heads=4"):
        Engine(model_path=str(checkpoints["llama"]), device="cpu", tp_size=3)


def test_more_ranks_than_cores_is_refused(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.raises(ValueError, match="puts 2 ranks on 1 CPU cores"):
        Engine(model_path=str(checkpoints["llama"]), device="cpu", tp_size=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_dist_init_addr_fails_within_the_timeout(
    checkpoints: dict[str, Path],
) -> None:
    addr = f"127.0.0.1:{_free_port()}"  # nobody listens there
    cfg = EngineConfig.from_options(
        {"model_path": str(checkpoints["llama"]), "device": "cpu", "tp_size": 2, "nnodes": 2,
         "node_rank": 1, "dist_init_addr": addr, "dist_timeout": 2}
    )  # fmt: skip
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 1 could not reach dist_init_addr {addr}"):
        join(cfg, 1)
    assert time.monotonic() - start < 30


def test_rank_zero_without_its_other_node_fails_within_the_timeout(
    checkpoints: dict[str, Path],
) -> None:
    addr = f"127.0.0.1:{_free_port()}"
    with pytest.raises(RuntimeError, match="only 1 of tp_size=2 ranks reached"):
        Engine(
            model_path=str(checkpoints["llama"]), device="cpu", tp_size=2, nnodes=2,
            dist_init_addr=addr, dist_timeout=3,
        )  # fmt: skip


def test_two_nodes_on_loopback(checkpoints: dict[str, Path]) -> None:
    """``nnodes=2``: node 1's rank is started apart (as ``tandem serve --node-rank 1``
    would on another machine) and meets rank 0 at ``dist_init_addr``."""
    path = checkpoints["qwen3"]
    options = {"tp_size": 2, "nnodes": 2, "dist_init_addr": f"127.0.0.1:{_free_port()}"}
    cfg = EngineConfig.from_options({"model_path": str(path), **BASE, **options, "node_rank": 1})
    code = (
        "import sys, json; from tandem.scheduler.config import EngineConfig; "
        "from tandem.scheduler.parallel.distributed import start_node; "
        "sys.exit(start_node(EngineConfig.from_options(json.loads(sys.argv[1]))))"
    )
    node = subprocess.Popen([sys.executable, "-c", code, json.dumps(cfg.as_dict())])
    try:
        assert _outputs(path, **options) == _outputs(path, tp_size=1)
        assert node.wait(timeout=30) == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_rank_that_dies_fails_the_engine_clearly(checkpoints: dict[str, Path]) -> None:
    engine = Engine(model_path=str(checkpoints["llama"]), **{**BASE, "tp_size": 2})
    try:
        assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
        ranks = engine._ranks
        assert ranks is not None
        follower = ranks.procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.failure is not None
        assert f"rank 1 (pid {follower.pid}) exited" in engine.failure
        with pytest.raises(RuntimeError, match=r"rank 1 .* exited"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    finally:
        engine.shutdown()


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="nnodes=2 needs dist_init_addr"):
        EngineConfig.from_options({"tp_size": 2, "nnodes": 2})
    with pytest.raises(ValueError, match="tp_size=3 does not spread evenly over nnodes=2"):
        EngineConfig.from_options({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"})
    with pytest.raises(ValueError, match="dist_init_addr must be host:port"):
        EngineConfig.from_options({"tp_size": 2, "dist_init_addr": "nohost"})
    with pytest.raises(ValueError, match="node_rank must be in"):
        EngineConfig.from_options({"node_rank": 1})
    assert dataclasses.asdict(EngineConfig())["tp_size"] == 1


def test_a_rank_that_hangs_fails_the_engine_after_dist_timeout(
    checkpoints: dict[str, Path],
) -> None:
    engine = Engine(
        model_path=str(checkpoints["llama"]), **{**BASE, "tp_size": 2, "dist_timeout": 8}
    )
    ranks = engine._ranks
    assert ranks is not None
    follower = ranks.procs[0]
    try:
        os.kill(follower.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert time.monotonic() - start < 60
        assert engine.failure is not None
    finally:
        os.kill(follower.pid, signal.SIGKILL)
        engine.shutdown()


def test_tp2_retraction_and_abort(checkpoints: dict[str, Path]) -> None:
    """A pool too small for every request (retraction), then a stream aborted midway:
    the same tokens as one rank, and every row and page back on rank 0's books."""
    path = checkpoints["llama"]
    prompts = [[5 + i, 17, 42, 99, 3, 250, 11, 64] for i in range(6)]
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    small = {**BASE, "max_total_tokens": 120, "page_size": 4}
    outs = []
    for tp_size in (1, 2):
        with Engine(model_path=str(path), **{**small, "tp_size": tp_size}) as engine:
            outs.append(
                [
                    r["output_ids"]
                    for r in engine.generate(input_ids=prompts, sampling_params=params)
                ]
            )
            assert engine.scheduler.counters.retracted_requests > 0
            stream = engine.generate(
                input_ids=prompts[0], sampling_params=params, stream=True, rid="cut"
            )
            next(iter(stream))
            engine.abort("cut")
            chunks = list(stream)
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert (
                engine.generate(input_ids=prompts[1], sampling_params=params)["output_ids"]
                == outs[-1][1]
            )
            idle_clean(engine)
    assert outs[0] == outs[1]
