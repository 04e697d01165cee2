"""Prefill/decode disaggregation with two engines in one process: greedy tokens equal to
one engine's on both loops and both transfer backends, the decode side's radix prefix
not sent again, logprobs carried over, and every fault ending with an error and
nothing held on either side (strict accounting at idle, debug futures on)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_checks import idle_clean

from tandem.scheduler import Engine
from tandem.scheduler.disagg import Bootstrap

PROMPTS = [
    [5, 17, 42, 99, 3, 250, 11, 8, 9, 10],
    [7, 8],
    [300, 1, 64, 64, 64, 12, 9, 200, 31, 77, 18, 4, 6, 5, 5, 5, 5, 120],
]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
BASE = {
    "dtype": "float32",
    "device": "cpu",
    "debug_futures": True,
    "chunked_prefill_size": 8,
    "page_size": 4,
    "max_total_tokens": 512,
}


def _pair(path: Path, backend: str, timeout: float = 10.0, **options: Any) -> tuple[Engine, Engine]:
    common = {
        **BASE,
        "disaggregation_transfer_backend": backend,
        "disaggregation_timeout": timeout,
        **options,
    }
    prefill = Engine(
        model_path=str(path),
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=0,
        **common,
    )
    try:
        decode = Engine(model_path=str(path), disaggregation_mode="decode", **common)
    except BaseException:
        prefill.shutdown()
        raise
    return prefill, decode


@contextlib.contextmanager
def _engines(path: Path, backend: str, **options: Any) -> Iterator[tuple[Engine, Engine]]:
    prefill, decode = _pair(path, backend, **options)
    try:
        yield prefill, decode
    finally:
        decode.shutdown()
        prefill.shutdown()


_rooms = iter(range(1, 1 << 62))


def _run(
    prefill: Engine | None,
    decode: Engine,
    prompts: list[list[int]],
    params: Any = GREEDY,
    port: int | None = None,
    **kw: Any,
) -> tuple[list[Any], list[Any]]:
    """Each prompt sent to both engines at once with one room, as a gateway does;
    returns (prefill results, decode results)."""
    if port is None:
        assert prefill is not None
        port = prefill.get_server_info()["disaggregation_bootstrap_port"]
    boots = [Bootstrap("127.0.0.1", port, next(_rooms)) for _ in prompts]
    out: dict[str, Any] = {}

    def run_prefill() -> None:
        if prefill is not None:
            out["p"] = prefill.generate(
                input_ids=prompts, sampling_params=params, bootstrap=boots, **kw
            )

    thread = threading.Thread(target=run_prefill)
    thread.start()
    out["d"] = decode.generate(input_ids=prompts, sampling_params=params, bootstrap=boots, **kw)
    thread.join(60)
    return out.get("p", []), out["d"]


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> list[list[int]]:
    with Engine(model_path=str(checkpoints["llama"]), **BASE) as engine:
        return [r["output_ids"] for r in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.mark.parametrize("backend", ["mooncake", "torch"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_greedy_equals_one_engine(
    checkpoints: dict[str, Path], reference: list[list[int]], backend: str, overlap: bool
) -> None:
    loop = {"disable_overlap_schedule": not overlap}
    with _engines(checkpoints["llama"], backend, **loop) as (prefill, decode):
        pre, dec = _run(prefill, decode, PROMPTS)
        assert [r["output_ids"] for r in dec] == reference
        # The prefill server's answer is the first token, once its KV was sent.
        assert [r["output_ids"] for r in pre] == [ids[:1] for ids in reference]
        assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in pre)
        # Again: the decode server's radix cache holds the prompts' whole pages now, so
        # only the rest is sent, and the tokens stay the same.
        _, again = _run(prefill, decode, PROMPTS)
        assert [r["output_ids"] for r in again] == reference
        cached = [r["meta_info"]["cached_tokens"] for r in again]
        assert cached[0] == 8
        assert cached[2] == 16
        info = decode.get_server_info()
        assert info["prefill_steps"] == 0  # the decode server never prefilled
        idle_clean(prefill)
        idle_clean(decode)


def test_logprobs_and_stops_cross_over(checkpoints: dict[str, Path]) -> None:
    with Engine(model_path=str(checkpoints["llama"]), **BASE) as engine:
        want = engine.generate(
            input_ids=PROMPTS[0], sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
        )
    with _engines(checkpoints["llama"], "mooncake") as (prefill, decode):
        _, (got,) = _run(prefill, decode, [PROMPTS[0]], return_logprob=True, top_logprobs_num=3)
        assert got["output_ids"] == want["output_ids"]
        lp = [t[0] for t in got["meta_info"]["output_token_logprobs"]]
        ref = [t[0] for t in want["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx(ref, abs=1e-4)
        assert len(got["meta_info"]["output_top_logprobs"]) == len(want["output_ids"])
        # One token: the decode server finishes on the prefill server's token.
        _, (one,) = _run(prefill, decode, [PROMPTS[1]], {**GREEDY, "max_new_tokens": 1})
        assert len(one["output_ids"]) == 1
        idle_clean(prefill)
        idle_clean(decode)


def test_requests_need_bootstrap_fields(checkpoints: dict[str, Path]) -> None:
    with _engines(checkpoints["llama"], "torch") as (prefill, decode):
        for engine in (prefill, decode):
            with pytest.raises(ValueError, match="bootstrap_host, bootstrap_port and bootstrap"):
                engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
            with pytest.raises(ValueError, match="bootstrap_room"):
                engine.generate(
                    input_ids=PROMPTS[0],
                    sampling_params=GREEDY,
                    bootstrap=Bootstrap("127.0.0.1", 1, -1),
                )
            with pytest.raises(ValueError, match="n > 1"):
                engine.generate(
                    input_ids=PROMPTS[0],
                    sampling_params={**GREEDY, "n": 2},
                    bootstrap=Bootstrap("127.0.0.1", 1, 1),
                )
    with Engine(model_path=str(checkpoints["llama"]), **BASE) as plain:  # ignored there
        out = plain.generate(
            input_ids=PROMPTS[1], sampling_params=GREEDY, bootstrap=Bootstrap("x", 1, 1)
        )
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


def test_refused_at_start(checkpoints: dict[str, Path]) -> None:
    path = str(checkpoints["llama"])
    with pytest.raises(ValueError, match="speculative decoding"):
        Engine(
            model_path=path,
            disaggregation_mode="decode",
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=path,
            **BASE,
        )
    with pytest.raises(ValueError, match="disaggregation_mode='both'"):
        Engine(model_path=path, disaggregation_mode="both", **BASE)
    with pytest.raises(ValueError, match="tp_size=1"):
        Engine(model_path=path, disaggregation_mode="prefill", tp_size=2, **BASE)


def test_layouts_must_match(checkpoints: dict[str, Path]) -> None:
    prefill = Engine(
        model_path=str(checkpoints["llama"]),
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=0,
        disaggregation_transfer_backend="torch",
        **BASE,
    )
    decode = Engine(
        model_path=str(checkpoints["llama"]),
        disaggregation_mode="decode",
        disaggregation_transfer_backend="torch",
        disaggregation_timeout=3.0,
        **{**BASE, "page_size": 2},
    )
    try:
        _, (res,) = _run(prefill, decode, [PROMPTS[0]])
        reason = res["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert "page_size differs" in reason["message"]
        idle_clean(prefill, timeout_s=15)
        idle_clean(decode)
    finally:
        decode.shutdown()
        prefill.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_prefill_server_gone(checkpoints: dict[str, Path]) -> None:
    """Nobody at the bootstrap address: the decode request fails at once, clearly."""
    decode = Engine(
        model_path=str(checkpoints["llama"]),
        disaggregation_mode="decode",
        disaggregation_transfer_backend="torch",
        **BASE,
    )
    try:
        _, (res,) = _run(None, decode, [PROMPTS[0]], port=_free_port())
        reason = res["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert "unreachable" in reason["message"]
        idle_clean(decode)
    finally:
        decode.shutdown()


def test_timeouts_on_both_sides(checkpoints: dict[str, Path]) -> None:
    """A prefill whose decode server never asks, and a decode request whose prefill
    server never gets the request, both end with an error after the timeout."""
    with _engines(checkpoints["llama"], "mooncake", timeout=1.5) as (prefill, decode):
        port = prefill.get_server_info()["disaggregation_bootstrap_port"]
        lone = prefill.generate(
            input_ids=PROMPTS[0], sampling_params=GREEDY, bootstrap=Bootstrap("127.0.0.1", 9, 77)
        )
        assert "no decode server asked" in lone["meta_info"]["finish_reason"]["message"]
        _, (res,) = _run(None, decode, [PROMPTS[0]], port=port)
        reason = res["meta_info"]["finish_reason"]
        assert reason["type"] == "abort", reason
        assert "no request for room" in reason["message"] or "no KV" in reason["message"]
        idle_clean(prefill)
        idle_clean(decode)
        # And the pair still works afterwards.
        _, ok = _run(prefill, decode, PROMPTS[:1])
        assert len(ok[0]["output_ids"]) == GREEDY["max_new_tokens"]


def test_decode_server_full(checkpoints: dict[str, Path]) -> None:
    """No row on the decode server for longer than the timeout: an error on both sides."""
    # Each step slowed (the forward stream's random delays), so the holder holds long.
    slow = {"max_running_requests": 1, "host_stream_max_delay_ms": 40, "host_stream_seed": 1}
    with _engines(checkpoints["llama"], "torch", timeout=1.5, **slow) as pair:
        prefill, decode = pair
        port = prefill.get_server_info()["disaggregation_bootstrap_port"]
        # A plain request holds the decode server's only row for a while.
        blocker = {"max_new_tokens": 220, "temperature": 0, "ignore_eos": True}
        holder = Bootstrap("127.0.0.1", port, next(_rooms))
        box: dict[str, Any] = {}
        first = threading.Thread(
            target=lambda: box.update(
                p=prefill.generate(input_ids=PROMPTS[1], sampling_params=blocker, bootstrap=holder)
            )
        )
        first.start()
        held = decode.generate(
            input_ids=PROMPTS[1], sampling_params=blocker, bootstrap=holder, stream=True,
            rid="holder",
        )  # fmt: skip
        next(iter(held))  # it runs
        pre, (res,) = _run(prefill, decode, [PROMPTS[0]])
        reason = res["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert "decode server is full" in reason["message"]
        assert pre[0]["meta_info"]["finish_reason"]["type"] == "abort"
        decode.abort("holder")
        for _ in held:
            pass
        first.join(30)
        idle_clean(prefill)
        idle_clean(decode)


def test_aborts_on_either_side(checkpoints: dict[str, Path]) -> None:
    with _engines(checkpoints["llama"], "mooncake", timeout=2.0) as (prefill, decode):
        port = prefill.get_server_info()["disaggregation_bootstrap_port"]
        # Aborted on the decode side while it waits for its KV (no prefill request yet).
        boot = Bootstrap("127.0.0.1", port, next(_rooms))
        stream = decode.generate(
            input_ids=PROMPTS[0], sampling_params=GREEDY, bootstrap=boot, stream=True,
            rid="waits",
        )  # fmt: skip
        time.sleep(0.3)
        decode.abort("waits")
        chunks = list(stream)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        # Its prefill request, arriving late, is told by nobody: it times out cleanly,
        # or hears the cancel; either way it ends and holds nothing.
        late = prefill.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, bootstrap=boot)
        assert late["meta_info"]["finish_reason"]["type"] == "abort"
        # Aborted on the prefill side before its KV: the decode request fails at once.
        boot = Bootstrap("127.0.0.1", port, next(_rooms))
        long = [1 + i % 200 for i in range(200)]
        box: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: box.update(
                d=decode.generate(input_ids=long, sampling_params=GREEDY, bootstrap=boot)
            )
        )
        t.start()
        pstream = prefill.generate(
            input_ids=long, sampling_params=GREEDY, bootstrap=boot, stream=True, rid="pre"
        )
        prefill.abort("pre")
        list(pstream)
        t.join(30)
        reason = box["d"]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort", reason
        idle_clean(prefill)
        idle_clean(decode)


@pytest.mark.parametrize("backend", ["mooncake", "torch"])
def test_prefill_server_dies_during_the_hand_over(
    checkpoints: dict[str, Path], backend: str
) -> None:
    """The decode server asked for the KV, then its prefill server went away: the
    request fails at once with the reason, and the decode server holds nothing."""
    prefill, decode = _pair(checkpoints["llama"], backend, timeout=20.0)
    try:
        port = prefill.get_server_info()["disaggregation_bootstrap_port"]
        boot = Bootstrap("127.0.0.1", port, next(_rooms))
        stream = decode.generate(
            input_ids=PROMPTS[2], sampling_params=GREEDY, bootstrap=boot, stream=True
        )
        deadline = time.monotonic() + 10
        while not decode.scheduler.stages.transferring:  # it holds pages, its want is out
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        started = time.monotonic()
        prefill.shutdown()
        chunks = list(stream)
        assert time.monotonic() - started < 5  # not the 20 s timeout
        reason = chunks[-1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert f"prefill server 127.0.0.1:{port}" in reason["message"]
        idle_clean(decode)
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_constrained_output_crosses_over() -> None:
    """A grammar on both halves (the tiny model has the tokenizer it needs): the
    prefill server samples the first token under it, the decode server's matcher takes
    that token and goes on; the output equals one engine's."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)}
    options = {
        "model_path": "tandem-tiny", "device": "cpu", "debug_futures": True,
        "disaggregation_transfer_backend": "torch",
    }  # fmt: skip
    with Engine(**options) as engine:
        want = engine.generate("Give json:", params)
    prefill = Engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **options)
    decode = Engine(disaggregation_mode="decode", **options)
    try:
        port = prefill.get_server_info()["disaggregation_bootstrap_port"]
        boot = Bootstrap("127.0.0.1", port, next(_rooms))
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: box.update(p=prefill.generate("Give json:", params, bootstrap=boot))
        )
        thread.start()
        got = decode.generate("Give json:", params, bootstrap=boot)
        thread.join(30)
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        idle_clean(prefill)
        idle_clean(decode)
    finally:
        decode.shutdown()
        prefill.shutdown()


def _until(check: Any) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _second_is_refused(engine: Engine, boot: Bootstrap) -> None:
    second = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, bootstrap=boot)
    reason = second["meta_info"]["finish_reason"]
    assert reason["type"] == "abort"
    assert "already in use" in reason["message"]


def test_a_room_in_use_is_refused(checkpoints: dict[str, Path]) -> None:
    """Two requests with one room on a server: the second ends at once, the first is
    unharmed."""
    with _engines(checkpoints["llama"], "torch", timeout=10.0) as (prefill, decode):
        port = prefill.get_server_info()["disaggregation_bootstrap_port"]
        boot = Bootstrap("127.0.0.1", port, next(_rooms))
        first = decode.generate(
            input_ids=PROMPTS[0], sampling_params=GREEDY, bootstrap=boot, stream=True
        )
        _until(lambda: boot.room in decode.scheduler.disagg.transfers)
        _second_is_refused(decode, boot)
        prefill.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, bootstrap=boot)
        assert sum(len(c["output_ids"]) for c in first) == GREEDY["max_new_tokens"]

        boot = Bootstrap("127.0.0.1", port, next(_rooms))
        first = prefill.generate(
            input_ids=PROMPTS[0], sampling_params=GREEDY, bootstrap=boot, stream=True
        )
        _until(lambda: boot.room in prefill.scheduler.disagg.in_use)
        _second_is_refused(prefill, boot)
        done = decode.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, bootstrap=boot)
        assert len(done["output_ids"]) == GREEDY["max_new_tokens"]
        assert list(first)[-1]["meta_info"]["finish_reason"]["type"] == "length"
        idle_clean(prefill)
        idle_clean(decode)
