"""How a request leaves scheduling: its tokens arrive, it finishes (one path for
stop, length and abort) or is retracted, and its row and pages come back once no
launched batch still reads them (``Request.in_flight == 0``). A retracted request
then goes back to the front of the queue.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from tandem.scheduler.kv.resources import Resources
from tandem.scheduler.messages import ScheduledBatch, StepResult, Update
from tandem.scheduler.request import FinishReason, Request, Stages
from tandem.scheduler.schedule.counters import Counters
from tandem.scheduler.schedule.spec_policy import SpecPolicy
from tandem.scheduler.text.stop import token_stop


class Release:
    """Tokens in, finishes, retractions and the release of what requests hold."""

    def __init__(
        self,
        stages: Stages,
        resources: Resources,
        counters: Counters,
        eos_ids: Collection[int],
        spec: SpecPolicy | None,
    ) -> None:
        self.stages = stages
        self.resources = resources
        self.counters = counters
        self.eos_ids = frozenset(eos_ids)
        self.spec = spec
        self.processed_at = 0.0  # when the step being processed came back (token times)

    def receive(self, req: Request, tokens: list[int], result: StepResult, k: int) -> Update:
        """Append ``req``'s new tokens (sampling row ``k`` of ``result``) one by one
        until one ends it."""
        update = Update(req)
        for token in tokens:
            update.new_ids.append(token)
            req.output_ids.append(token)
            if req.token_times is not None:
                req.token_times.append(self.processed_at)
            self.counters.generated_tokens += 1
            if req.return_logprob and result.logprobs is not None:
                self._logprobs(req, result, k)
            if req.grammar is not None:
                req.grammar.accept(token)  # the mask allowed it, so it is accepted
            reason = self._finish_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
                update.finished = True
                break
        return update

    def _logprobs(self, req: Request, result: StepResult, k: int) -> None:
        assert result.logprobs is not None
        req.output_logprobs.append(float(result.logprobs[k]))
        if req.top_logprobs_num and result.top_logprob_values is not None:
            assert result.top_logprob_ids is not None
            values = result.top_logprob_values[k, : req.top_logprobs_num].tolist()
            ids = result.top_logprob_ids[k, : req.top_logprobs_num].tolist()
            req.output_top_logprobs.append(list(zip(values, ids, strict=True)))

    def input_logprobs(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Append the prompt logprobs ``batch`` computed to their requests (in the order
        ``ScheduledBatch.add_input_logprobs`` laid them out); a request that ended
        meanwhile gets none."""
        assert result.input_logprobs is not None
        chosen = result.input_logprobs.tolist()
        top = result.input_top_values is not None and result.input_top_ids is not None
        values = result.input_top_values.tolist() if top else None  # type: ignore[union-attr]
        ids = result.input_top_ids.tolist() if top else None  # type: ignore[union-attr]
        start = 0
        for req, count in zip(batch.input_logprob_reqs, batch.input_logprob_counts, strict=True):
            end = start + count
            if not req.finished:
                req.input_logprobs.extend(chosen[start:end])
                k = req.top_logprobs_num
                if k and values is not None and ids is not None:
                    req.input_top_logprobs.extend(
                        list(zip(v[:k], i[:k], strict=True))
                        for v, i in zip(values[start:end], ids[start:end], strict=True)
                    )
            start = end

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token_stop(token, req.stop_ids, self.eos_ids, params.ignore_eos):
            return FinishReason("stop", matched=token)
        if req.grammar is not None and req.grammar.terminated:
            return FinishReason("stop", matched=token)  # the grammar is complete
        matched = req.stop.feed([token])
        if matched is not None:
            return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= req.max_samples:
            return FinishReason("length", length=len(req.output_ids))
        return None

    def finish(self, req: Request, reason: FinishReason) -> Update:
        """The one way a request ends: its text is completed and it leaves scheduling."""
        req.finish = reason
        req.stop.finish_text()
        if reason.kind == "abort":
            self.counters.aborted_requests += 1
        self.leave(req)
        return Update(req, [], True)

    def retract(self, req: Request) -> bool:
        """Take ``req`` out to requeue it; True when its pages came back at once."""
        self.leave(req)
        req.retracting = True
        self.counters.retracted_requests += 1
        return self.release(req)

    def leave(self, req: Request) -> None:
        """Out of scheduling; its resources wait in ``retiring`` for its batches."""
        stages = self.stages
        for stage in (stages.running, stages.prefilling):
            if req in stage:
                stage.remove(req)
        if req not in stages.retiring:
            stages.retiring.append(req)

    def settle(self, batch: ScheduledBatch) -> None:
        """``batch`` is processed: its requests' resources may go back."""
        self.resources.settle(batch)
        for req in batch.reqs:
            req.in_flight -= 1
            self.release(req)

    def release(self, req: Request) -> bool:
        """Give back ``req``'s row and pages once nothing in flight reads them.
        True when released (or already free)."""
        if req not in self.stages.retiring:
            return True
        if req.in_flight > 0:
            return False
        if self.spec is not None:
            self.spec.truth(req)
        self.resources.free(req)
        # Out of ``retiring`` only once freed: ``has_work`` stays true until the row and
        # pages are back, for a reader on another thread too.
        self.stages.retiring.remove(req)
        if req.finished:
            self.counters.finished_requests += 1
        elif req.retracting:
            self._requeue(req)
        return True

    def _requeue(self, req: Request) -> None:
        """Back to the front of the queue, to prefill its prompt and the tokens it
        produced (its next sample continues the same seeded stream, since
        ``scheduled_samples`` equals what was received)."""
        req.retracting = False
        req.retractions += 1
        req.fill_ids = req.prompt_ids + req.output_ids
        req.kv_len = 0
        req.spec_committed = 0
        req.spec_drafts = True  # its prefill drafts over every token again
        req.scheduled_samples = len(req.output_ids)
        self.stages.waiting.appendleft(req)

    def stamp(self) -> None:
        """The step now processed came back now (one time for all its tokens)."""
        self.processed_at = time.perf_counter()
