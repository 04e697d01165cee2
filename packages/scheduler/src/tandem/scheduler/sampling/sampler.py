"""Turn one step's logits into next tokens, on the device, without the host waiting.

``Sampler.sample`` runs on the forward stream while the host builds the next batch, so
it never reads a device value on the host: everything the host must decide (which
filters run, whether logprobs are wanted, seeded random numbers) is decided when
``SamplingBatchInfo`` is built on the schedule side, from ``SamplingParams`` alone.
Each sampled row draws its token by inverse CDF over its filtered probabilities, in
vocabulary order, at one uniform number. docs/guides/offline-engine.md, "How a token
is chosen", describes every step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.scheduler.sampling.params import SamplingParams
from tandem.scheduler.sampling.penalties import PenaltyParams, PenaltyState

_TOP_K_OFF = 1 << 30
"""Top-k for rows without one: larger than any vocabulary, so the mask keeps all."""

_UNIFORM_BITS = 53
"""Bits of a float64 mantissa: the finest uniform a double can hold exactly."""


@dataclass(frozen=True)
class SamplingBatchInfo:
    """One batch's sampling configuration: device tensors plus host flags.

    Built on the schedule side by ``build``; the host flags let ``Sampler.sample``
    skip work no row needs without looking at the device.

    Attributes:
        rows: ``[B]`` int64 request rows (index the penalty state).
        temperatures: ``[B, 1]`` float32; 1 for greedy rows (they never divide).
        top_ps: ``[B]`` float32; 1 where off.
        top_ks: ``[B]`` int64; a huge value where off.
        min_ps: ``[B]`` float32; 0 where off.
        greedy: ``[B]`` bool, rows decoded by argmax.
        uniforms: ``[B]`` float64 in [0, 1), the random number of each seeded row
            (0 elsewhere).
        seeded: ``[B]`` bool, rows whose random number is in ``uniforms``; the others
            draw theirs from the sampler's generator.
        penalty_params: penalty coefficients, or None when no row has a penalty.
        seeds: per-request seeds (None: no seed).
        steps: per-request step index (tokens the request sampled before this one).
        all_greedy: whether every row is greedy.
        any_greedy: whether some row is greedy.
        any_unseeded: whether some sampled row draws from the sampler's generator.
        need_top_p: whether some sampled row uses top-p.
        need_top_k: whether some sampled row uses top-k.
        need_min_p: whether some sampled row uses min-p.
        need_penalties: whether some row has a penalty.
        need_logprobs: whether some row wants logprobs (chosen or top alternatives).
        max_top_logprobs: the most top alternatives any row wants.
    """

    rows: torch.Tensor
    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    greedy: torch.Tensor
    uniforms: torch.Tensor
    seeded: torch.Tensor
    penalty_params: PenaltyParams | None
    seeds: tuple[int | None, ...]
    steps: tuple[int, ...]
    all_greedy: bool
    any_greedy: bool
    any_unseeded: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    need_penalties: bool
    need_logprobs: bool
    max_top_logprobs: int

    @property
    def batch_size(self) -> int:
        return len(self.steps)

    @property
    def need_filters(self) -> bool:
        return self.need_top_k or self.need_top_p or self.need_min_p

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        rows: Sequence[int] | torch.Tensor,
        steps: Sequence[int],
        device: torch.device | str,
        *,
        return_logprob: Sequence[bool] | None = None,
        top_logprobs_num: Sequence[int] | None = None,
    ) -> SamplingBatchInfo:
        """Build from host data only; the device tensors are copied without blocking.

        Args:
            params: each request's (validated) parameters, in batch order.
            rows: each request's row, host ints or a ``[B]`` int64 device tensor.
            steps: each request's step index: how many tokens it has sampled before
                this step (the overlap loop counts launched steps, not received ones).
            device: the logits' device.
            return_logprob: per-request logprob requests given to ``generate`` outside
                the params (SGLang's way); either this or the params' own field asking
                is enough.
            top_logprobs_num: per-request top-alternative counts given to ``generate``;
                the larger of this and the params' own count wins.
        """
        n = len(params)
        if not n == len(steps) == len(rows):
            raise ValueError(
                f"params, rows and steps differ in length: {n}, {len(rows)}, {len(steps)}"
            )
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        want_lp = _merge(return_logprob, [p.return_logprob for p in params], n, "return_logprob")
        top_n = _merge(
            top_logprobs_num, [p.top_logprobs_num for p in params], n, "top_logprobs_num"
        )
        any_penalty = any(p.uses_penalties for p in params)
        if cls.is_plain_greedy(params, want_lp, top_n):
            return cls._plain_greedy(rows, steps, tuple(p.seed for p in params), device)
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        seeded = [not g and p.seed is not None for p, g in zip(params, greedy, strict=True)]
        pairs = list(zip(params, greedy, strict=True))
        floats = _to_device([_float_columns(p, g) for p, g in pairs], 6, torch.float32, device)
        ints = _to_device(
            [[int(g), int(s), _top_k(p, g)] for (p, g), s in zip(pairs, seeded, strict=True)],
            3,
            torch.int64,
            device,
        )
        uniforms = [
            [_seeded_uniform(p.seed, step) if s and p.seed is not None else 0.0]
            for p, s, step in zip(params, seeded, steps, strict=True)
        ]
        return cls(
            rows=_rows_tensor(rows, device),
            temperatures=floats[0].unsqueeze(1),
            top_ps=floats[1],
            min_ps=floats[2],
            greedy=ints[0].bool(),
            seeded=ints[1].bool(),
            top_ks=ints[2],
            uniforms=_to_device(uniforms, 1, torch.float64, device)[0],
            penalty_params=_penalty_params(params, floats) if any_penalty else None,
            seeds=tuple(p.seed for p in params),
            steps=tuple(steps),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_unseeded=any(not g and not s for g, s in zip(greedy, seeded, strict=True)),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_top_k=any(p.top_k_enabled for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            need_penalties=any_penalty,
            need_logprobs=any(want_lp) or any(k > 0 for k in top_n),
            max_top_logprobs=max(top_n, default=0),
        )

    @staticmethod
    def is_plain_greedy(
        params: Sequence[SamplingParams],
        return_logprob: Sequence[bool] | Sequence[int] | None = None,
        top_logprobs_num: Sequence[int] | None = None,
    ) -> bool:
        """Every row greedy, without penalties or logprobs: sampling is an argmax
        (``Sampler.sample_greedy``), and most batches are like this."""
        return (
            all(p.is_greedy and not p.uses_penalties for p in params)
            and not any(p.return_logprob or p.top_logprobs_num for p in params)
            and not any(return_logprob or ())
            and not any(top_logprobs_num or ())
        )

    @classmethod
    def _plain_greedy(
        cls,
        rows: Sequence[int] | torch.Tensor,
        steps: Sequence[int],
        seeds: tuple[int | None, ...],
        device: torch.device,
    ) -> SamplingBatchInfo:
        """Every row greedy, without penalties or logprobs (the common batch): the
        neutral columns ``build`` would copy, made by factory calls instead of per-row
        Python, since this runs on the forward stream every step."""
        n = len(steps)
        ones = torch.ones(n, dtype=torch.float32, device=device)
        return cls(
            rows=_rows_tensor(rows, device),
            temperatures=ones.unsqueeze(1),
            top_ps=ones,
            min_ps=torch.zeros(n, dtype=torch.float32, device=device),
            greedy=torch.ones(n, dtype=torch.bool, device=device),
            seeded=torch.zeros(n, dtype=torch.bool, device=device),
            top_ks=torch.full((n,), _TOP_K_OFF, dtype=torch.int64, device=device),
            uniforms=torch.zeros(n, dtype=torch.float64, device=device),
            penalty_params=None,
            seeds=seeds,
            steps=tuple(steps),
            all_greedy=True,
            any_greedy=n > 0,
            any_unseeded=False,
            need_top_p=False,
            need_top_k=False,
            need_min_p=False,
            need_penalties=False,
            need_logprobs=False,
            max_top_logprobs=0,
        )


@dataclass(frozen=True)
class SampleOutput:
    """One step's sampling result, all on the device.

    Attributes:
        next_token_ids: ``[B]`` int64 chosen tokens.
        logprobs: ``[B]`` log-softmax of the raw logits (before penalties and
            temperature) at the chosen tokens, or None if no row asked.
        top_logprobs: ``(values[B, k], indices[B, k])``, the ``k = max_top_logprobs``
            most likely tokens of the raw distribution, or None if no row asked; each
            request keeps its own first ``top_logprobs_num`` columns.
    """

    next_token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


class Sampler:
    """Samples next tokens; owns the generator of requests without a seed.

    Args:
        seed: seeds that generator (one per device, created on first use), so a whole
            run is reproducible; None seeds it nondeterministically.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The device generator of unseeded requests (device work draws from it)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        penalties: PenaltyState | None = None,
    ) -> SampleOutput:
        """Pick each row's next token from ``logits[B, V]``; device work only.

        ``logits`` is not modified. Penalties are applied, not recorded: after this,
        the runner calls ``penalties.record(info.rows, out.next_token_ids)`` on the
        forward stream (speculative decoding records its accepted tokens instead).
        """
        _check_inputs(logits, info, penalties)
        if info.batch_size == 0:
            return _empty_output(logits, info)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if info.need_logprobs else None
        work = logits
        if penalties is not None and info.penalty_params is not None:
            work = logits.clone()
            penalties.apply(work, info.rows, info.penalty_params)
        next_ids = _choose(work, info, self._uniforms(info, logits.device))
        return SampleOutput(next_ids, *_logprobs(raw_logprobs, next_ids, info.max_top_logprobs))

    @staticmethod
    def sample_greedy(logits: torch.Tensor) -> SampleOutput:
        """``sample`` for a batch that ``SamplingBatchInfo.is_plain_greedy`` accepts:
        the argmax, without building the batch's sampling columns."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
        return SampleOutput(torch.argmax(logits, dim=-1), None, None)

    def _uniforms(self, info: SamplingBatchInfo, device: torch.device) -> torch.Tensor:
        if not info.any_unseeded:
            return info.uniforms
        # Drawn for the whole batch and overridden where seeded: one kernel, and the
        # generator advances by the batch size whatever the seeds.
        drawn = torch.rand(
            info.batch_size, dtype=torch.float64, device=device, generator=self.generator(device)
        )
        return torch.where(info.seeded, info.uniforms, drawn)


def _check_inputs(
    logits: torch.Tensor, info: SamplingBatchInfo, penalties: PenaltyState | None
) -> None:
    # Shapes, dtypes and devices are host metadata: checking them never syncs.
    if logits.dim() != 2 or logits.shape[0] != info.batch_size:
        raise ValueError(f"logits must be [B={info.batch_size}, V], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if info.temperatures.device != logits.device:
        raise ValueError(
            f"SamplingBatchInfo is on {info.temperatures.device}, logits on {logits.device}"
        )
    if info.need_penalties and penalties is None:
        raise ValueError("a request in the batch has a penalty but no PenaltyState was given")


def _choose(work: torch.Tensor, info: SamplingBatchInfo, uniforms: torch.Tensor) -> torch.Tensor:
    if info.all_greedy:
        return torch.argmax(work, dim=-1)
    drawn = _draw(work, info, uniforms)
    if not info.any_greedy:
        return drawn
    return torch.where(info.greedy, torch.argmax(work, dim=-1), drawn)


def _draw(work: torch.Tensor, info: SamplingBatchInfo, uniforms: torch.Tensor) -> torch.Tensor:
    """Temperature -> softmax -> top-k -> top-p -> min-p -> inverse-CDF draw."""
    probs = torch.softmax(work.float() / info.temperatures, dim=-1)
    if info.need_filters:
        probs = _filter(probs, info)
    return _inverse_cdf(probs, uniforms)


def _filter(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the tokens that top-k, top-p and min-p drop; the rest keep their values.

    Top-p is measured on the top-k survivors renormalised (like vLLM and FlashInfer's
    top-k-first order), and min-p against the most likely token, which no filter
    drops. Renormalising is left to the draw, whose CDF is scale-free.
    """
    # A stable sort orders ties by token id, so equal probabilities are cut the same
    # way whatever the batch.
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    vocab = probs.shape[-1]
    if info.need_top_k:
        rank = torch.arange(vocab, device=probs.device)
        sorted_p = sorted_p.masked_fill(rank >= info.top_ks.unsqueeze(1), 0.0)
    if info.need_top_p:
        cdf = torch.cumsum(sorted_p, dim=-1, dtype=torch.float64)
        mass_before = cdf - sorted_p.double()
        sorted_p = sorted_p.masked_fill(mass_before > info.top_ps.unsqueeze(1) * cdf[:, -1:], 0.0)
    if info.need_min_p:
        floor = sorted_p[:, :1] * info.min_ps.unsqueeze(1)
        sorted_p = sorted_p.masked_fill(sorted_p < floor, 0.0)
    # Back to vocabulary order, so the draw below is the same whichever filters ran.
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def filtered_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, softmax, then top-k,
    top-p and min-p, renormalised. Speculative rejection sampling verifies drafts
    against exactly this, so it preserves what non-speculative sampling would draw."""
    probs = torch.softmax(logits.float() / info.temperatures, dim=-1)
    if info.need_filters:
        probs = _filter(probs, info)
    return probs / probs.sum(dim=-1, keepdim=True)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from unnormalised ``weights`` with ``uniforms`` in [0, 1)."""
    return _inverse_cdf(weights, uniforms)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative weight exceeds ``u * total``.

    A zero-weight token never satisfies that (its CDF equals its predecessor's), so
    filtered tokens are never drawn. float64 keeps the tail of a large vocabulary from
    being rounded away.
    """
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # u < 1, but u * total can round up to total; stay strictly below it.
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, total * 0))
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Only NaN logits can push the index past the end; keep it a valid token anyway.
    return index.clamp_(max=weights.shape[-1] - 1)


def _logprobs(
    raw_logprobs: torch.Tensor | None, next_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    if raw_logprobs is None:
        return None, None
    chosen = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    if k <= 0:
        return chosen, None
    values, indices = torch.topk(raw_logprobs, min(k, raw_logprobs.shape[-1]), dim=-1)
    return chosen, (values, indices)


def _empty_output(logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
    # An idle batch launches nothing (empty batches touch nothing: docs/concepts/futuremap.md).
    ids = torch.empty(0, dtype=torch.int64, device=logits.device)
    if not info.need_logprobs:
        return SampleOutput(ids, None, None)
    chosen = logits.new_empty(0)
    if info.max_top_logprobs <= 0:
        return SampleOutput(ids, chosen, None)
    k = min(info.max_top_logprobs, logits.shape[-1])
    top = (logits.new_empty(0, k), torch.empty(0, k, dtype=torch.int64, device=logits.device))
    return SampleOutput(ids, chosen, top)


def _float_columns(p: SamplingParams, greedy: bool) -> list[float]:
    # Greedy rows get neutral sampling values: they are drawn and discarded when they
    # share a batch with sampled rows, and must neither divide by 0 nor set flags.
    head = [1.0, 1.0, 0.0] if greedy else [p.temperature, p.top_p, p.min_p]
    return [*head, p.frequency_penalty, p.presence_penalty, p.repetition_penalty]


def _top_k(p: SamplingParams, greedy: bool) -> int:
    return p.top_k if p.top_k_enabled and not greedy else _TOP_K_OFF


def _penalty_params(params: Sequence[SamplingParams], floats: torch.Tensor) -> PenaltyParams:
    return PenaltyParams(
        frequency=floats[3].unsqueeze(1),
        presence=floats[4].unsqueeze(1),
        repetition=floats[5].unsqueeze(1),
        need_frequency_presence=any(
            p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
        ),
        need_repetition=any(p.repetition_penalty != 1.0 for p in params),
    )


def _seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) from ``(seed, step)`` alone, so a request's draw at a step is
    the same in any batch, on any device, in either loop."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    bits = int.from_bytes(digest, "little") >> (64 - _UNIFORM_BITS)
    return bits / (1 << _UNIFORM_BITS)


def _merge(
    extra: Sequence[bool] | Sequence[int] | None, own: list[bool] | list[int], n: int, name: str
) -> list[int]:
    if extra is None:
        return [int(v) for v in own]
    if len(extra) != n:
        raise ValueError(f"{name}: expected {n} values, got {len(extra)}")
    return [max(int(a), int(b)) for a, b in zip(extra, own, strict=True)]


def _rows_tensor(rows: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):
        return rows.to(device=device, dtype=torch.int64, non_blocking=True)
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _to_device(
    columns_per_row: Sequence[Sequence[float]],
    width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Rows of host values -> a ``[columns, B]`` device tensor, in one copy.

    One packed transfer instead of one per field; from pinned memory on CUDA so the
    copy is asynchronous and the schedule side does not wait for it.
    """
    host = torch.tensor(columns_per_row, dtype=dtype).reshape(-1, width).T.contiguous()
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
