"""When speculation turns off (``SpecPolicy.drafts``): the host-side rule alone; the
engine-level switch is tested with a trained pair in tandem-spec-eagle."""

from __future__ import annotations

import pytest

from tandem.scheduler.config import CPU_SPECULATIVE_DISABLE_BY_BATCH_SIZE, EngineConfig
from tandem.scheduler.request import Request
from tandem.scheduler.sampling import SamplingParams
from tandem.scheduler.schedule.counters import Counters
from tandem.scheduler.schedule.spec_policy import SpecPolicy
from tandem.scheduler.text.stop import StopChecker


def _policy(limit: int | None) -> SpecPolicy:
    return SpecPolicy(4, 4, resources=None, counters=Counters(), batch_limit=limit)  # type: ignore[arg-type]


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(), StopChecker([], None)) for i in range(n)]


def test_drafts_below_the_limit_only() -> None:
    policy = _policy(3)
    assert policy.drafts(_requests(1))
    assert policy.drafts(_requests(2))
    assert not policy.drafts(_requests(3))
    assert _policy(None).drafts(_requests(64))


def test_a_request_decoded_plainly_keeps_the_batch_plain() -> None:
    reqs = _requests(2)
    reqs[0].spec_drafts = False
    assert not _policy(3).drafts(reqs)
    assert _policy(3).drafts(reqs[1:])


def test_a_plain_step_never_follows_a_speculative_one_in_flight() -> None:
    """The length a plain step starts from must be known: with a speculative step in
    flight it is only a bound, so that batch is refused loudly, not decoded wrongly."""
    reqs = _requests(3)
    reqs[1].spec_launched = 1  # launched, not yet processed
    with pytest.raises(RuntimeError, match="r1"):
        _policy(3).drafts(reqs)


def test_the_default_limit_depends_on_the_device() -> None:
    config = EngineConfig(model_path="m", speculative_algorithm="EAGLE3")
    assert config.speculative_batch_limit("cpu") == CPU_SPECULATIVE_DISABLE_BY_BATCH_SIZE
    assert config.speculative_batch_limit("cuda") is None
    config = EngineConfig(
        model_path="m", speculative_algorithm="EAGLE3", speculative_disable_by_batch_size=5
    )
    assert config.speculative_batch_limit("cpu") == config.speculative_batch_limit("cuda") == 5
    assert EngineConfig(model_path="m").speculative_batch_limit("cpu") is None


def test_admitted_requests_draft_only_if_their_first_step_would() -> None:
    """A request admitted where its first decode step will be plain (the batch at the
    limit, or a request in it already plain) skips the draft's work over its prompt."""
    from tandem.scheduler.request import Stages

    stages = Stages()
    running, new = _requests(1), _requests(2)
    stages.running.extend(running)
    stages.prefilling.append(new[0])
    _policy(3).admitted(new[:1], stages)
    assert new[0].spec_drafts  # two requests, under the limit of 3
    stages.prefilling.append(new[1])
    _policy(3).admitted(new, stages)
    assert not any(req.spec_drafts for req in new)  # three: plain from the first step
    running[0].spec_drafts = False
    stages.prefilling.remove(new[1])
    _policy(None).admitted(new[:1], stages)
    assert not new[0].spec_drafts  # the batch stays plain while a plain request runs
