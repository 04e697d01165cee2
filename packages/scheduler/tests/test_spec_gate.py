"""Speculative decoding's measured gate (``SpecGate``): the rule on given step times,
and through ``SpecPolicy``; the engine-level gate is tested in tandem-spec-eagle."""

from __future__ import annotations

import pytest

from tandem.scheduler.request import Request, Stages
from tandem.scheduler.sampling import SamplingParams
from tandem.scheduler.schedule.counters import Counters
from tandem.scheduler.schedule.spec_gate import MIN_STEPS, SpecGate
from tandem.scheduler.schedule.spec_policy import SpecPolicy
from tandem.scheduler.text.stop import StopChecker


def _measure(gate: SpecGate, n: int, spec_s: float, plain_s: float, accepted: int) -> None:
    for _ in range(MIN_STEPS):
        gate.step_timed(True, n, spec_s)
        for _ in range(n):
            gate.committed(accepted)
    for _ in range(MIN_STEPS):
        gate.step_timed(False, n, plain_s)


def test_speculation_is_measured_first_then_one_plain_probe_then_the_gain_decides() -> None:
    gate = SpecGate()
    for _ in range(MIN_STEPS):
        assert gate.drafts(1)  # too few speculative times: draft
        gate.step_timed(True, 1, 0.020)
        gate.committed(2)
    assert gate.gain(1) is None
    assert not gate.drafts(1)  # too few plain times: a plain step measures them
    for _ in range(MIN_STEPS):
        gate.step_timed(False, 1, 0.008)
    # 2 tokens in 20 ms against 1 in 8 ms: drafting loses
    assert gate.gain(1) == pytest.approx(2 * 0.008 / 0.020)
    assert not gate.drafts(1)


@pytest.mark.parametrize(
    ("spec_s", "plain_s", "accepted", "drafts"),
    [(0.012, 0.010, 3, True), (0.031, 0.010, 3, False), (0.010, 0.010, 1, False)],
)
def test_drafting_pays_while_accept_length_times_plain_exceeds_speculative(
    spec_s: float, plain_s: float, accepted: int, drafts: bool
) -> None:
    gate = SpecGate()
    _measure(gate, 4, spec_s, plain_s, accepted)
    assert gate.drafts(4) is drafts


def test_batch_sizes_of_one_class_share_their_times_and_others_do_not() -> None:
    gate = SpecGate()
    _measure(gate, 4, 0.031, 0.010, 3)  # loses at 4-7 requests
    assert not gate.drafts(7)
    assert gate.drafts(8)  # 8-15: nothing measured yet
    assert gate.drafts(3)


def test_the_median_ignores_a_slow_first_step() -> None:
    gate = SpecGate()
    gate.step_timed(True, 1, 5.0)  # a warm-up
    _measure(gate, 1, 0.012, 0.010, 2)
    assert gate.drafts(1)
    assert gate.gain(1) == pytest.approx(2 * 0.010 / 0.012)


def test_a_losing_class_measures_speculation_again_after_reprobe_after_plain_steps() -> None:
    gate = SpecGate(reprobe_after=50)
    _measure(gate, 1, 0.030, 0.010, 2)
    assert not gate.drafts(1)
    for _ in range(50 - MIN_STEPS - 1):
        gate.step_timed(False, 1, 0.010)
    assert not gate.drafts(1)
    gate.step_timed(False, 1, 0.010)
    assert gate.drafts(1)  # the next requests that can draft measure it again
    _measure(gate, 1, 0.012, 0.010, 3)  # the prompts changed: now drafting pays
    assert gate.drafts(1)
    for _ in range(200):  # a winning class is not re-probed by plain steps
        gate.step_timed(True, 1, 0.012)
    assert gate.drafts(1)


def test_the_accept_length_follows_the_latest_commits() -> None:
    gate = SpecGate()
    assert gate.accept_length is None
    for accepted in (1, 2, 3):
        gate.committed(accepted)
    assert gate.accept_length == pytest.approx(2.0)


def test_the_policy_asks_the_gate_and_feeds_it() -> None:
    gate = SpecGate()
    counters = Counters()
    policy = SpecPolicy(4, 4, resources=None, counters=counters, gate=gate)  # type: ignore[arg-type]
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(), StopChecker([], None)) for i in range(2)]
    policy.steps_timed([((True, 2), 0.030)] * MIN_STEPS + [((False, 2), 0.010)] * MIN_STEPS)
    for req in reqs:
        req.kv_len = 8
        policy.commit(req, [5, 6, 7, 8], 2)
    assert gate.accept_length == 2.0
    assert not policy.drafts(reqs)  # 2 tokens in 30 ms against 1 in 10 ms
    assert SpecPolicy(4, 4, None, counters).drafts(reqs)  # type: ignore[arg-type]
    stages = Stages()
    stages.prefilling.extend(reqs)
    policy.admitted(reqs, stages)
    assert not any(req.spec_drafts for req in reqs)  # admitted there: no draft prefill


def test_the_summary_names_each_class_by_its_smallest_batch() -> None:
    gate = SpecGate()
    _measure(gate, 5, 0.031, 0.010, 3)
    gate.step_timed(True, 1, 0.02)
    summary = gate.summary()
    assert summary["accept_length"] == 3.0
    assert summary["classes"] == {
        "1": {"drafting_s": 0.02, "plain_s": None, "gain": None},
        "4": {"drafting_s": 0.031, "plain_s": 0.010, "gain": pytest.approx(3 * 0.010 / 0.031)},
    }


def test_no_decoding_request_is_the_class_of_one() -> None:
    """``drafts`` may be asked about an empty batch; the summary still names classes."""
    gate = SpecGate()
    assert gate.drafts(0)
    gate.step_timed(True, 1, 0.02)
    assert list(gate.summary()["classes"]) == ["1"]  # type: ignore[call-overload]
