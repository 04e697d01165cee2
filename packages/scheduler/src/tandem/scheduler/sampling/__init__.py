"""Sampling: per-request parameters, per-row penalty state, and the device sampler.

``SamplingParams`` travels with a request; the schedule side turns a batch's params
into a ``SamplingBatchInfo`` (host flags + device tensors); ``Sampler.sample`` picks
the next tokens on the forward stream without any host read of device values.
"""

from __future__ import annotations

from tandem.scheduler.sampling.params import SamplingParams
from tandem.scheduler.sampling.penalties import PenaltyParams, PenaltyState
from tandem.scheduler.sampling.sampler import SampleOutput, Sampler, SamplingBatchInfo

__all__ = [
    "PenaltyParams",
    "PenaltyState",
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParams",
]
