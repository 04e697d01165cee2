"""The speculative-decoding interface: what the scheduler knows of a draft/verify worker.

The scheduler never imports an implementation (a layer never imports the layers above
it). A ``SpeculativeWorker`` is found by the ``speculative_algorithm`` name, either
registered explicitly (``register_speculative_algorithm``) or published by an
installed package under the ``tandem.speculative_algorithms`` entry-point group
(``tandem-spec-eagle`` publishes ``EAGLE`` and ``EAGLE3``). ``SpeculativeWorker``
states what the scheduler relies on; docs/guides/speculative-decoding.md explains it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tandem.futuremap import FutureMap, RelayField
from tandem.scheduler.sampling import SamplingBatchInfo, SamplingParams

if TYPE_CHECKING:
    from tandem.scheduler.attention import AttentionBackend
    from tandem.scheduler.config import EngineConfig
    from tandem.scheduler.forward_batch import ForwardBatch
    from tandem.scheduler.kv.pools import PagedKVPool, ReqToTokenPool
    from tandem.scheduler.messages import GrammarMasks
    from tandem.scheduler.models import CausalLM, ModelConfig
    from tandem.scheduler.sampling import Sampler

ENTRY_POINT_GROUP = "tandem.speculative_algorithms"


@dataclass(frozen=True)
class TargetHandle:
    """The target side a worker drafts for: built by the ``Engine``, shared, not owned."""

    model: CausalLM
    model_config: ModelConfig
    attention: AttentionBackend
    req_pool: ReqToTokenPool
    kv_pool: PagedKVPool
    future_map: FutureMap
    sampler: Sampler
    device: torch.device
    dtype: torch.dtype


@dataclass(frozen=True)
class PrefillDraftInput:
    """A target prefill just ran; the worker drafts over the same tokens.

    Attributes:
        batch: the prefill's forward batch (positions, slots, lengths).
        next_ids: ``[T]`` the token *after* each new token (the prompt shifted by
            one; at a chunk's end the next prompt token, or the sampled token).
        features: ``[T, F]`` the target's features the draft reads (``capture_layers``).
        sample_rows: rows whose prompt is complete and sampled a token now.
        sample_last: ``[S]`` index in ``[T]`` of those rows' last new token.
        sample_seq_lens: committed length of each sampling row (its whole prompt).
    """

    batch: ForwardBatch
    next_ids: torch.Tensor
    features: torch.Tensor
    sample_rows: torch.Tensor
    sample_last: torch.Tensor
    sample_seq_lens: list[int]


@dataclass(frozen=True)
class SpecDecodeInput:
    """One speculative step over decoding rows (host data snapshotted at schedule time
    plus the sampling tensors built on the forward stream).

    Attributes:
        rows: ``[B]`` int64 rows on the device.
        bounds: per row, an upper bound of its committed length at this step's start
            (host truth plus ``max_accept`` per step still in flight).
        sampling: the rows' sampling configuration.
        steps: per row, how many speculative steps it ran before (keys seeded draws).
        grammar: the constrained rows' matchers, handed over by the host once it has
            processed every step before (``ready``); the worker masks each tree node's
            target logits by what the grammar allows after the node's path.
    """

    rows: torch.Tensor
    bounds: list[int]
    sampling: SamplingBatchInfo
    steps: list[int]
    grammar: GrammarMasks | None = None


@dataclass
class SpecDecodeOutput:
    """Device results of one speculative step, indexed like the batch's rows.

    Attributes:
        tokens: ``[B, max_accept]`` int64: the accepted draft tokens then the bonus
            token; entries past ``accept_lens`` are padding.
        accept_lens: ``[B]`` int64 tokens committed by the step (accepted drafts + 1).
    """

    tokens: torch.Tensor
    accept_lens: torch.Tensor


class SpeculativeWorker(Protocol):
    """A draft/verify worker plugged into the scheduler.

    What the scheduler relies on, and nothing more:

    * a step commits between 1 and ``max_accept`` tokens per request, and the host
      learns how many one step late: it sizes each step from an upper bound of the
      committed length (``SpecDecodeInput.bounds``), while the device reads the truth
      from the FutureMap's ``new_seq_lens``, published by the previous step;
    * a step writes KV at positions ``[L, L + lookahead)`` of a request whose committed
      length is ``L``; the scheduler reserves pages (mapped in ``req_to_token``) for the
      positions below ``bound + lookahead`` before launching it;
    * after a target prefill that completes a prompt, ``extend_after_prefill`` drafts
      over it and stashes the relay fields the next step resolves; the prefill's
      sampled token is the first bonus token;
    * a plain decode step (a request's draft state left behind, ``SpecPolicy``) is
      the runner's: the worker is not called, and that request drafts no more.
    """

    relay_fields: tuple[RelayField, ...]
    """Per-row draft state it stashes and resolves through the FutureMap."""
    max_accept: int
    """Most tokens one step commits per request (accepted drafts + the bonus)."""
    lookahead: int
    """KV positions past the committed length one step may write."""
    capture_layers: tuple[int, ...]
    """Target layers whose outputs the draft reads; ``()`` means the final hidden."""

    def check_request(self, params: SamplingParams, return_logprob: bool) -> None:
        """Raise ``ValueError`` naming what this worker cannot serve."""
        ...

    def extend_after_prefill(self, data: PrefillDraftInput) -> None:
        """On the forward stream after a target prefill: draft over its tokens (draft
        KV), and stash the relay fields of the rows that sampled."""
        ...

    def decode(self, data: SpecDecodeInput) -> SpecDecodeOutput:
        """On the forward stream: draft, verify, publish, draft-extend, stash."""
        ...


WorkerFactory = Callable[["EngineConfig", TargetHandle], SpeculativeWorker]

_REGISTRY: dict[str, WorkerFactory] = {}


def register_speculative_algorithm(name: str, factory: WorkerFactory) -> None:
    """Make ``speculative_algorithm=name`` build its worker with ``factory``."""
    _REGISTRY[name.upper()] = factory


def speculative_algorithms() -> list[str]:
    """Every name known now: registered ones and installed entry points."""
    names = set(_REGISTRY)
    names |= {ep.name.upper() for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def create_speculative_worker(config: EngineConfig, target: TargetHandle) -> SpeculativeWorker:
    """The worker of ``config.speculative_algorithm``; a clear error when no installed
    package provides it."""
    name = (config.speculative_algorithm or "").upper()
    factory = _REGISTRY.get(name)
    if factory is None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name.upper() == name:
                factory = ep.load()
                break
    if factory is None:
        known = ", ".join(speculative_algorithms()) or "none installed"
        raise ValueError(
            f"speculative_algorithm={config.speculative_algorithm!r} is not available "
            f"(known: {known}); EAGLE and EAGLE3 come with `pip install tandem-spec-eagle`"
        )
    return factory(config, target)
