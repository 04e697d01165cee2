"""The CPU handoff of a batch's copy-done: held while a later batch is queued, set when
that batch reaches its forward or ends (failed or not), set at once otherwise; and the
engine's overlap loop, which uses it, gives the normal loop's tokens and reports a
failed step instead of waiting forever on the batch before it."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tandem.futuremap import HostStream
from tandem.scheduler import Engine
from tandem.scheduler.runner.cpu_step import Handoff, StepDone
from tandem.scheduler.runner.model_runner import ModelRunner


def test_nothing_queued_sets_the_event_when_the_batch_ends() -> None:
    handoff = Handoff()
    done = handoff.launch()
    handoff.start()
    assert not done.query()
    handoff.finish(done)
    assert done.query()
    done.synchronize()  # returns at once


def test_a_queued_batch_holds_the_event_until_its_forward() -> None:
    handoff = Handoff()
    first, second = handoff.launch(), handoff.launch()
    handoff.start()
    handoff.finish(first)
    assert not first.query(), "the second batch is queued: the first one's event waits"
    handoff.start()
    handoff.release()  # the second batch reached its forward
    assert first.query()
    assert not second.query()
    handoff.finish(second)
    assert second.query()


def test_a_batch_that_ends_without_a_forward_still_releases() -> None:
    handoff = Handoff()
    first, second = handoff.launch(), handoff.launch()
    handoff.start()
    handoff.finish(first)
    handoff.start()
    handoff.finish(second)  # e.g. the second batch failed before its forward
    assert first.query()
    assert second.query()


def test_a_failed_batch_never_holds_its_event() -> None:
    """The host stream skips what is queued behind a failure, so nothing would set it."""
    handoff = Handoff()
    first, _ = handoff.launch(), handoff.launch()
    handoff.start()
    handoff.finish(first, hold=False)
    assert first.query()


def test_a_step_done_is_set_not_recorded() -> None:
    with pytest.raises(TypeError, match="set by the forward stream"):
        StepDone().record(None)  # type: ignore[arg-type]


def _generate(overlap: bool) -> list[list[int]]:
    with Engine(
        model_path="tandem-tiny",
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        disable_progress_bar=True,
        disable_overlap_schedule=not overlap,
    ) as engine:
        prompts = [[(3 * i + 17 * j) % 300 + 2 for j in range(4 + 7 * i)] for i in range(7)]
        params = [{"max_new_tokens": 5 + 11 * i, "ignore_eos": True} for i in range(7)]
        return [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]


def test_the_overlap_loop_with_the_handoff_gives_the_normal_loops_tokens() -> None:
    assert _generate(overlap=True) == _generate(overlap=False)


def test_a_failed_step_does_not_hang_the_held_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    forward_step = ModelRunner._forward_step
    calls = {"n": 0}

    def fail_once(self: ModelRunner, *args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 12:  # a decode step, with the previous one's event held
            raise RuntimeError("injected forward failure")
        return forward_step(self, *args)

    monkeypatch.setattr(ModelRunner, "_forward_step", fail_once)
    engine = Engine(
        model_path="tandem-tiny", device="cpu", skip_tokenizer_init=True, disable_progress_bar=True
    )
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 40})
        except RuntimeError as exc:
            errors.append(exc)

    # In a daemon thread with a deadline: a held event that is never set would hang it
    # (and the engine with it, which is then left to the interpreter's exit).
    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():
        pytest.fail("generate hung after a failed step")
    try:
        assert calls["n"] >= 12  # the failure was injected (a queued step may follow it)
        assert [str(e) for e in errors] == ["generation failed"]
        # The engine stops on a failed step; it reports that, it does not hang.
        with pytest.raises(RuntimeError):
            engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 4})
    finally:
        engine.shutdown()


def test_a_stream_can_wait_on_a_step_done() -> None:
    done = StepDone()
    with HostStream(name="test-handoff") as stream:
        stream.wait_event(done)
        after = stream.submit(lambda: "ran")
        assert not after.done()
        done.set()
        assert after.result(timeout=10) == "ran"
