"""Decode rows and retraction: every decodable request gets one more token per step,
and when KV pages run out the newest requests go back to the queue."""

from __future__ import annotations

from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.kv.resources import Resources
from tandem.scheduler.messages import ScheduledBatch
from tandem.scheduler.request import Request, Stages
from tandem.scheduler.schedule.counters import Counters
from tandem.scheduler.schedule.release import Release
from tandem.scheduler.schedule.spec_policy import SpecPolicy


class DecodeManager:
    """Builds decode batches (or speculative ones, as ``SpecPolicy.drafts`` says)
    from the running requests."""

    def __init__(
        self,
        stages: Stages,
        resources: Resources,
        release: Release,
        counters: Counters,
        spec: SpecPolicy | None,
    ) -> None:
        self.stages = stages
        self.resources = resources
        self.release = release
        self.counters = counters
        self.spec = spec
        self.lookahead = spec.lookahead if spec is not None else 1

    def decodable(self) -> list[Request]:
        """Running requests with a token left to schedule: never past a predictable
        end, so a length limit causes no overshoot."""
        return [r for r in self.stages.running if r.scheduled_samples < r.max_samples]

    def schedule(self) -> ScheduledBatch | None:
        decodable = self._make_room()
        if decodable is None:
            return None
        spec = self.spec
        if spec is not None:
            drafts = spec.drafts(decodable)
            if drafts is None:  # the step in flight lands first
                return None
            if drafts:
                return spec.schedule(decodable)
        batch = ScheduledBatch(ForwardMode.DECODE)
        if not self.add_rows(batch, decodable):
            return None
        if spec is not None:
            spec.decoded_plainly(batch)
        return batch

    def add_rows(self, batch: ScheduledBatch, decodable: list[Request] | None = None) -> bool:
        """Append every decodable request that gets its KV as one decode row (after
        any prefill rows: decode rows come last); False if none fits."""
        slots = self.resources.kv_pool.slots
        added = False
        for req in self.decodable() if decodable is None else decodable:
            if req in batch.reqs or not self.resources.reserve(req, req.kv_len + 1):
                continue
            pos = req.kv_len
            batch.sample_indices.append(batch.add(req, pos, 1, slots(req.pages, pos, pos + 1)))
            batch.num_decode += 1
            batch.positions.append(pos)
            req.kv_len = pos + 1
            req.scheduled_samples += 1
            added = True
        return added

    def _make_room(self) -> list[Request] | None:
        """Retract the newest requests until every decodable one gets its next page;
        returns the decodable requests, or None when pages only come back after a batch
        in flight is processed."""
        stages = self.stages
        short = self.resources.pages_short
        while True:
            decodable = self.decodable()
            need = sum(short(r, r.kv_len + self.lookahead) for r in decodable)
            if need <= self.resources.available_pages():
                return decodable
            victims = sorted((*stages.running, *stages.prefilling), key=lambda r: r.admit_seq)
            if len(victims) <= 1:
                if stages.retiring:
                    return None  # finished requests' pages come back after processing
                raise RuntimeError("KV pool too small for a single request")
            if not self.release.retract(victims[-1]):
                return None
