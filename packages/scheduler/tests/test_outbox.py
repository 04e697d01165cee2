"""``Engine.add_requests``: a step's output for many requests in one outbox call, with
the caller's ids, new ids and only new logprobs, the same tokens as ``generate``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tandem.scheduler import Engine
from tandem.scheduler.engine.delivery import Delta

PROMPTS = [[5, 17, 42, 99, 3, 250, 11], [7, 8], [300, 1, 64, 64, 64, 12, 9, 200, 31, 77]]


class Collect:
    """An outbox that records every call, and wakes a waiter when ``want`` rids ended."""

    def __init__(self, want: int) -> None:
        self.calls: list[list[dict[str, Any]]] = []
        self.failed: dict[str, BaseException] = {}
        self.want = want
        self.done = threading.Event()
        self._ended = 0

    def send(self, deltas: list[dict[str, Any]]) -> None:
        self.calls.append(deltas)
        self._ended += sum(d.meta.get("finish_reason") is not None for d in deltas)
        if self._ended >= self.want:
            self.done.set()

    def fail(self, rid: str, error: BaseException) -> None:
        self.failed[rid] = error

    def by_rid(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for call in self.calls:
            for delta in call:
                out.setdefault(delta.rid, []).append(delta)
        return out


@pytest.fixture(params=[False, True], ids=["normal", "overlap"])
def engine(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> Any:
    eng = Engine(
        model_path=str(checkpoints["llama"]), dtype="float32", device="cpu",
        disable_overlap_schedule=not request.param,
    )  # fmt: skip
    yield eng
    eng.shutdown()


def _params(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def test_one_call_per_step_with_every_request(engine: Engine) -> None:
    box = Collect(len(PROMPTS))
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    engine.add_requests(PROMPTS, [_params(6)] * 3, rids, box, return_logprob=True)
    assert box.done.wait(60)
    want = engine.generate(
        input_ids=PROMPTS, sampling_params=_params(6), return_logprob=True
    )  # fmt: skip
    got = box.by_rid()
    assert sorted(got) == rids
    for rid, prompt, ref in zip(rids, PROMPTS, want, strict=True):
        deltas = got[rid]
        assert [t for d in deltas for t in d.ids] == ref["output_ids"]
        # Only the new logprobs travel, and together they are the request's logprobs.
        logprobs = [pair for d in deltas for pair in d.logprobs]
        assert [tok for _, tok in logprobs] == ref["output_ids"]
        ref_lps = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        assert [lp for lp, _ in logprobs] == pytest.approx(ref_lps, abs=1e-5)
        last = deltas[-1].meta
        assert last["finish_reason"] == {"type": "length", "length": 6}
        assert last["completion_tokens"] == 6
        assert last["prompt_tokens"] == len(prompt)
        assert all(d.meta.get("finish_reason") is None for d in deltas[:-1])
        assert deltas[0].text == ""  # ids only: the API process decodes them
        assert [Delta.from_wire(d.wire()) for d in deltas] == deltas  # what the server reads
    # A step that advanced several requests reached the outbox as one call.
    assert max(len(call) for call in box.calls) > 1
    assert all(len({d.rid for d in call}) == len(call) for call in box.calls)
    engine.scheduler.resources.check_idle()


def test_a_bad_request_queues_none_of_the_batch(engine: Engine) -> None:
    box = Collect(1)
    with pytest.raises(ValueError, match="request 1"):
        engine.add_requests([[1, 2], [10**9]], [_params(2)] * 2, ["a", "b"], box)
    with pytest.raises(ValueError, match="one rid each"):
        engine.add_requests([[1, 2]], [{**_params(2), "n": 2}], ["a"], box)
    assert engine.get_server_info()["num_waiting_requests"] == 0
    engine.add_requests([[1, 2]], [_params(2)], ["a"], box)
    assert box.done.wait(30)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_requests([[1, 2], [3]], [_params(50)] * 2, ["x", "x"], box)


def test_abort_by_the_callers_id(engine: Engine) -> None:
    box = Collect(2)
    engine.add_requests([[1, 2, 3], [4, 5]], [_params(200)] * 2, ["keep", "drop"], box)
    engine.abort("drop")
    assert box.done.wait(60)
    got = box.by_rid()
    assert got["drop"][-1].meta["finish_reason"]["type"] == "abort"
    assert got["keep"][-1].meta["finish_reason"]["type"] == "length"
    engine.scheduler.resources.check_idle()


def test_shutdown_fails_open_requests_through_the_outbox(checkpoints: dict[str, Path]) -> None:
    eng = Engine(model_path=str(checkpoints["llama"]), dtype="float32", device="cpu")
    box = Collect(1)
    eng.add_requests([[1, 2, 3]], [_params(240)], ["long"], box)
    eng.shutdown()
    assert "long" in box.failed or box.done.is_set()
