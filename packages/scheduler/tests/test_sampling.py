"""Sampling: parameter validation, greedy and logprobs exactness, filters, the sampled
distribution, seeded reproducibility across batches, penalties against reference
formulas, and the promise that ``Sampler.sample`` never reads the device on the host."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import RepetitionPenaltyLogitsProcessor

from tandem.scheduler.sampling import (
    PenaltyState,
    SampleOutput,
    Sampler,
    SamplingBatchInfo,
    SamplingParams,
)

CPU = torch.device("cpu")
HYPOTHESIS = settings(max_examples=60, deadline=None)


def build(
    params: Sequence[SamplingParams],
    rows: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
    device: torch.device = CPU,
) -> SamplingBatchInfo:
    n = len(params)
    return SamplingBatchInfo.build(
        params,
        rows=list(range(1, n + 1)) if rows is None else rows,
        steps=[0] * n if steps is None else steps,
        device=device,
    )


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    *,
    sampler: Sampler | None = None,
    penalties: PenaltyState | None = None,
    rows: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
) -> SampleOutput:
    info = build(params, rows, steps, logits.device)
    return (sampler or Sampler(seed=0)).sample(logits, info, penalties)


# -- SamplingParams -------------------------------------------------------------------------


def test_defaults_follow_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.skip_special_tokens) == (
        None,
        None,
        False,
        True,
    )
    assert (p.seed, p.n, p.return_logprob, p.top_logprobs_num) == (None, 1, False, 0)
    assert not p.is_greedy
    assert not p.uses_penalties
    p.validate(vocab_size=10)


def test_from_dict() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    p = SamplingParams.from_dict({"temperature": 0.5, "sampling_seed": 7, "stop": "x"})
    assert (p.temperature, p.seed, p.stop_strings) == (0.5, 7, ["x"])
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict({"seed": 3, "sampling_seed": 3}).seed == 3
    with pytest.raises(ValueError, match="top-p") as err:
        SamplingParams.from_dict({"top-p": 0.5, "temperature": 0.1, "bogus": 1})
    assert "bogus" in str(err.value)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams.from_dict({"seed": 1, "sampling_seed": 2})


INVALID: list[tuple[str, Any]] = [
    ("max_new_tokens", -1),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("presence_penalty", 3.0),
    ("presence_penalty", -3.0),
    ("stop", 5),
    ("stop", ["a", 1]),
    ("stop_token_ids", [3, 10]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", "3"),
    ("seed", 1.5),
    ("seed", "7"),
    ("n", 0),
    ("top_logprobs_num", -1),
    ("top_logprobs_num", 11),
    ("ignore_eos", 1),
    ("return_logprob", "yes"),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_field_is_named(field: str, value: Any) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=rf"^{field}"):
        params.validate(vocab_size=10)


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": 0},
        {"top_k": -1},
        {"top_k": 1},
        {"top_k": 1000},
        {"top_p": 1.0},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"temperature": 0.0},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0},
        {"max_new_tokens": 0},
        {"stop": ["a", "b"], "stop_token_ids": [0, 9]},
        {"seed": -5},
        {"top_logprobs_num": 10},
    ],
)
def test_valid_edges(fields: dict[str, Any]) -> None:
    SamplingParams(**fields).validate(vocab_size=10)


def test_prompt_plus_new_tokens_must_fit() -> None:
    p = SamplingParams(max_new_tokens=10)
    p.validate(vocab_size=10, context_len=20, prompt_len=10)
    p.validate(vocab_size=10, context_len=20)
    with pytest.raises(ValueError, match=r"^max_new_tokens"):
        p.validate(vocab_size=10, context_len=20, prompt_len=11)


def test_properties() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1, temperature=0.7).is_greedy
    assert not SamplingParams(top_k=0).top_k_enabled
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams().stop_strings == []
    assert SamplingParams(presence_penalty=0.1).uses_penalties


# -- greedy and logprobs --------------------------------------------------------------------

# Small integers make ties common, which is where argmax conventions differ.
tie_logits = st.integers(2, 24).flatmap(
    lambda v: st.lists(st.lists(st.integers(-3, 3), min_size=v, max_size=v), min_size=1, max_size=6)
)


@HYPOTHESIS
@given(tie_logits)
def test_greedy_equals_argmax(rows: list[list[int]]) -> None:
    logits = torch.tensor(rows, dtype=torch.float32) * 0.5
    for greedy in (SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=0.9)):
        out = sample(logits, [greedy] * len(rows))
        assert torch.equal(out.next_token_ids, torch.argmax(logits, dim=-1))
        assert out.logprobs is None
        assert out.top_logprobs is None


def test_logprobs_equal_reference_log_softmax() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 50, generator=gen) * 3
    params = [
        SamplingParams(temperature=0, return_logprob=True),
        SamplingParams(temperature=0.7, top_logprobs_num=4),
        SamplingParams(temperature=1.3, top_p=0.8, frequency_penalty=1.0, repetition_penalty=1.5),
        SamplingParams(top_k=5, seed=3, top_logprobs_num=2),
        SamplingParams(min_p=0.2, presence_penalty=-1.0),
    ]
    penalties = PenaltyState(8, 50, CPU)
    for row in range(1, 6):
        penalties.reset_row(row, torch.arange(row * 3), params[row - 1])
    penalties.record(torch.arange(1, 6), torch.arange(5))
    before = logits.clone()
    out = sample(logits, params, penalties=penalties)
    assert torch.equal(logits, before), "sample must not modify the caller's logits"
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None
    assert out.top_logprobs is not None
    chosen = reference.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    assert torch.equal(out.logprobs, chosen)
    values, indices = torch.topk(reference, 4, dim=-1)
    assert torch.equal(out.top_logprobs[0], values)
    assert torch.equal(out.top_logprobs[1], indices)


def test_logprob_requests_outside_params() -> None:
    params = [SamplingParams(), SamplingParams(top_logprobs_num=2)]
    info = SamplingBatchInfo.build(
        params, rows=[1, 2], steps=[0, 0], device=CPU, return_logprob=[True, False]
    )
    assert info.need_logprobs
    assert info.max_top_logprobs == 2
    info = SamplingBatchInfo.build(
        params, rows=[1, 2], steps=[0, 0], device=CPU, top_logprobs_num=[5, 0]
    )
    assert info.max_top_logprobs == 5
    assert not build([SamplingParams()]).need_logprobs
    with pytest.raises(ValueError, match="return_logprob"):
        SamplingBatchInfo.build(
            params, rows=[1, 2], steps=[0, 0], device=CPU, return_logprob=[True]
        )


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0), SamplingParams(top_p=0.5)] * 3
    out = sample(logits, params)
    greedy = torch.argmax(logits, dim=-1)
    assert torch.equal(out.next_token_ids[::2], greedy[::2])


def test_empty_batch_launches_nothing() -> None:
    logits = torch.empty(0, 10)
    out = sample(logits, [])
    assert out.next_token_ids.shape == (0,)
    assert out.logprobs is None
    info = SamplingBatchInfo.build([], rows=[], steps=[], device=CPU, top_logprobs_num=[])
    assert Sampler().sample(logits, info).next_token_ids.dtype == torch.int64


# -- filters --------------------------------------------------------------------------------


def allowed_tokens(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """A superset (by float tolerance) of what top-k -> top-p -> min-p may keep, ties
    at a cut counted as kept."""
    probs = torch.softmax(logits.float() / p.temperature, dim=-1).double()
    vocab = probs.shape[0]
    k = p.top_k if p.top_k > 0 else vocab
    desc = probs.sort(descending=True).values
    greater = (probs.unsqueeze(0) > probs.unsqueeze(1)).double()  # [t, s]: p_s > p_t
    n_greater = greater.sum(1)
    mass_greater = (greater * probs.unsqueeze(0)).sum(1)
    keep = n_greater < k
    keep &= mass_greater <= p.top_p * desc[:k].sum() * (1 + 1e-5) + 1e-7
    keep &= probs >= p.min_p * desc[0] * (1 - 1e-5)
    return keep


@HYPOTHESIS
@given(
    v=st.integers(2, 40),
    data=st.data(),
    temperature=st.floats(0.05, 3.0),
    top_k=st.sampled_from([-1, 0, 2, 3, 5, 17]),
    top_p=st.floats(0.01, 1.0),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_filters_never_sample_outside_the_allowed_set(
    v: int,
    data: st.DataObject,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    seed: int,
) -> None:
    row = data.draw(st.lists(st.floats(-8, 8, width=32), min_size=v, max_size=v))
    logits = torch.tensor(row, dtype=torch.float32)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    seeded = SamplingParams(**{**p.to_dict(), "seed": seed})
    params = [p] * 48 + [seeded] * 16
    out = sample(logits.expand(64, v).contiguous(), params, sampler=Sampler(seed), steps=range(64))
    keep = allowed_tokens(logits, p)
    assert bool(keep[out.next_token_ids].all()), (keep, out.next_token_ids)


# -- the sampled distribution ---------------------------------------------------------------


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum().double()
    expected = expected_probs.double() * n
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    dof = torch.tensor((counts.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


DRAWS = 40_000
LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_the_distribution(seeded: bool) -> None:
    temperature = 0.7
    seeds = range(DRAWS) if seeded else [None] * DRAWS
    params = [SamplingParams(temperature=temperature, seed=s) for s in seeds]
    out = sample(LOGITS8.expand(DRAWS, 8).contiguous(), params, sampler=Sampler(seed=1234))
    counts = torch.bincount(out.next_token_ids, minlength=8)
    expected = torch.softmax(LOGITS8.double() / temperature, dim=-1)
    assert chi_square_p_value(counts, expected) > 1e-3, counts


def test_truncated_sampling_matches_the_renormalised_distribution() -> None:
    # top-k 5 keeps tokens 0..4 (renormalised); top-p 0.8 over those keeps 0..2, whose
    # mass before token 3 is below 0.8 and whose mass before token 3 is above it.
    p = SamplingParams(temperature=1.0, top_k=5, top_p=0.8)
    probs = torch.softmax(LOGITS8.double(), dim=-1)[:5]
    probs = probs / probs.sum()
    kept = 3
    assert probs[: kept - 1].sum() < 0.8 < probs[:kept].sum()
    out = sample(LOGITS8.expand(DRAWS, 8).contiguous(), [p] * DRAWS, sampler=Sampler(seed=99))
    counts = torch.bincount(out.next_token_ids, minlength=8)
    assert int(counts[kept:].sum()) == 0
    expected = probs[:kept] / probs[:kept].sum()
    assert chi_square_p_value(counts[:kept], expected) > 1e-3, counts


def test_unseeded_sampling_reproduces_with_the_sampler_seed() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0)] * 32
    a = sample(logits, params, sampler=Sampler(seed=42)).next_token_ids
    b = sample(logits, params, sampler=Sampler(seed=42)).next_token_ids
    c = sample(logits, params, sampler=Sampler(seed=43)).next_token_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# -- seeded reproducibility -----------------------------------------------------------------

OTHERS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.1, top_k=3),
    SamplingParams(temperature=0.6, top_p=0.7, min_p=0.1),
    SamplingParams(temperature=0.9, frequency_penalty=1.5, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, seed=77),
    SamplingParams(temperature=1.0, presence_penalty=-1.0, top_logprobs_num=3),
]


def run_request_in_batches(
    target: SamplingParams,
    layout: Callable[[int], tuple[list[int], int]],
    sampler_seed: int,
    vocab: int = 64,
) -> list[int]:
    """Decode the target request for 6 steps; ``layout(step)`` says which OTHERS ride
    along and at which position the target sits. Returns the target's tokens."""
    gen = torch.Generator().manual_seed(11)
    step_logits = [torch.randn(vocab, generator=gen) * 2 for _ in range(6)]
    penalties = PenaltyState(16, vocab, CPU)
    target_row = 9
    penalties.reset_row(target_row, torch.tensor([1, 2, 3]), target)
    for i, other in enumerate(OTHERS):
        penalties.reset_row(i + 1, torch.tensor([4, 5, 6, i]), other)
    sampler = Sampler(seed=sampler_seed)
    tokens = []
    for step, row_logits in enumerate(step_logits):
        others, position = layout(step)
        params = [OTHERS[i] for i in others]
        rows = [i + 1 for i in others]
        logits = [torch.randn(vocab, generator=gen) * 2 for _ in others]
        params.insert(position, target)
        rows.insert(position, target_row)
        logits.insert(position, row_logits)
        info = build(params, rows, [step] * len(params))
        out = sampler.sample(torch.stack(logits), info, penalties)
        penalties.record(info.rows, out.next_token_ids)
        tokens.append(int(out.next_token_ids[position]))
    return tokens


LAYOUTS: list[Callable[[int], tuple[list[int], int]]] = [
    lambda step: ([], 0),
    lambda step: (list(range(len(OTHERS))), step % (len(OTHERS) + 1)),
    lambda step: (list(reversed(range(len(OTHERS)))), 0),
    lambda step: ([(step + i) % len(OTHERS) for i in range(step % 4)], step % 2 * (step % 4)),
    lambda step: ([4, 1], 1),
]


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.8, seed=1234),
        SamplingParams(temperature=1.2, top_p=0.9, top_k=20, seed=5),
        SamplingParams(temperature=1.0, min_p=0.05, frequency_penalty=0.5, seed=-3),
    ],
)
def test_seeded_tokens_do_not_depend_on_the_batch(target: SamplingParams) -> None:
    runs = [run_request_in_batches(target, layout, i) for i, layout in enumerate(LAYOUTS)]
    assert all(run == runs[0] for run in runs), runs
    other_seed = SamplingParams(**{**target.to_dict(), "seed": (target.seed or 0) + 1})
    assert run_request_in_batches(other_seed, LAYOUTS[0], 0) != runs[0]


# -- penalties ------------------------------------------------------------------------------


def reference_penalties(
    logits: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams
) -> torch.Tensor:
    """HF repetition penalty over prompt + generated (transformers' own processor),
    then OpenAI frequency/presence over generated tokens, written out plainly."""
    out = logits.clone().unsqueeze(0)
    if p.repetition_penalty != 1.0 and prompt + generated:
        processor = RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty)
        out = processor(torch.tensor([prompt + generated]), out)
    out = out.squeeze(0)
    for token in set(generated):
        count = generated.count(token)
        out[token] -= count * p.frequency_penalty + p.presence_penalty
    return out


@HYPOTHESIS
@given(
    vocab=st.integers(2, 30),
    data=st.data(),
    coefficients=st.lists(
        st.tuples(
            st.sampled_from([1.0, 0.5, 1.3, 2.0]),
            st.sampled_from([0.0, 0.7, -1.2, 2.0]),
            st.sampled_from([0.0, 0.4, -2.0]),
        ),
        min_size=1,
        max_size=5,
    ),
)
def test_penalties_match_reference(
    vocab: int, data: st.DataObject, coefficients: list[tuple[float, float, float]]
) -> None:
    tokens = st.integers(0, vocab - 1)
    params = [
        SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=pr)
        for r, f, pr in coefficients
    ]
    batch = len(params)
    rows = data.draw(st.permutations(range(1, 8)))[:batch]
    prompts = [data.draw(st.lists(tokens, max_size=8)) for _ in params]
    steps = data.draw(st.integers(0, 6))
    history = [[data.draw(tokens) for _ in range(steps)] for _ in params]
    state = PenaltyState(7, vocab, CPU)
    for row, prompt, p in zip(rows, prompts, params, strict=True):
        state.reset_row(row, torch.tensor(prompt, dtype=torch.int64), p)
    rows_t = torch.tensor(rows)
    for step in range(steps):
        state.record(rows_t, torch.tensor([h[step] for h in history]))
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(steps)) * 3
    info = build(params, rows)
    if info.penalty_params is None:
        assert not any(p.uses_penalties for p in params)
        return
    penalised = logits.clone()
    state.apply(penalised, info.rows, info.penalty_params)
    for i, p in enumerate(params):
        expected = reference_penalties(logits[i], prompts[i], history[i], p)
        torch.testing.assert_close(penalised[i], expected, rtol=1e-6, atol=1e-6)
    # Greedy decoding sees the penalised logits.
    greedy = [SamplingParams(**{**p.to_dict(), "temperature": 0.0}) for p in params]
    out = Sampler().sample(logits, build(greedy, rows), state)
    assert torch.equal(out.next_token_ids, penalised.argmax(dim=-1))


def test_neutral_rows_are_untouched_by_a_penalised_batch() -> None:
    state = PenaltyState(4, 20, CPU)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0, repetition_penalty=1.7)]
    for row, p in zip((1, 2), params, strict=True):
        state.reset_row(row, torch.arange(10), p)
    state.reset_row(1, torch.arange(10))  # even with a history in its row
    state.record(torch.tensor([1, 2]), torch.tensor([3, 3]))
    logits = torch.randn(2, 20)
    info = build(params, [1, 2])
    assert info.penalty_params is not None
    penalised = logits.clone()
    state.apply(penalised, info.rows, info.penalty_params)
    assert torch.equal(penalised[0], logits[0])
    assert not torch.equal(penalised[1], logits[1])


def test_penalty_state_is_lazy_and_bounded() -> None:
    state = PenaltyState(num_rows=6, vocab_size=50, device=CPU)
    state.reset_row(1, torch.tensor([1, 2]), SamplingParams())
    state.record(torch.tensor([1]), torch.tensor([3]))
    assert not state.allocated
    assert state.nbytes == 0
    state.reset_row(2, torch.tensor([1, 2]), SamplingParams(presence_penalty=0.5))
    assert state.allocated
    assert state.nbytes == PenaltyState.nbytes_for(6, 50) == 5 * 7 * 50
    for _ in range(100):
        state.record(torch.tensor([2, 0, 0]), torch.tensor([4, 1, 1]))
    assert state.nbytes == 5 * 7 * 50
    with pytest.raises(ValueError, match="row"):
        state.reset_row(7, torch.tensor([1]))


def test_reset_row_forgets_the_previous_owner_and_keeps_retracted_outputs() -> None:
    state = PenaltyState(3, 10, CPU)
    p = SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0)
    state.reset_row(1, torch.tensor([5]), p)
    state.record(torch.tensor([1, 1]), torch.tensor([2, 2]))
    state.reset_row(1, torch.tensor([7]), p, output_ids=torch.tensor([3, 3, 4]))
    info = build([p], [1])
    assert info.penalty_params is not None
    logits = torch.ones(1, 10)
    state.apply(logits, info.rows, info.penalty_params)
    expected = torch.ones(10)
    expected[[3, 4, 7]] = 0.5
    expected[3] -= 2.0
    expected[4] -= 1.0
    assert torch.equal(logits[0], expected)


def test_penalties_without_state_are_an_error() -> None:
    p = SamplingParams(presence_penalty=1.0)
    with pytest.raises(ValueError, match="PenaltyState"):
        Sampler().sample(torch.zeros(1, 4), build([p]))
    with pytest.raises(RuntimeError, match="reset_row"):
        sample(torch.zeros(1, 4), [p], penalties=PenaltyState(2, 4, CPU))


# -- no host reads of device values ---------------------------------------------------------

_SYNCING_OPS = {
    torch.ops.aten._local_scalar_dense,  # .item(), bool(t), int(t), float(t)
    torch.ops.aten.is_nonzero,
    torch.ops.aten.nonzero,  # boolean-mask indexing
    torch.ops.aten.masked_select,
    torch.ops.aten.equal,
    torch.ops.aten.unique_dim,
    torch.ops.aten._unique2,
}
_INDEXING_OPS = {torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_}


class _NoHostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Fails on every aten op whose output shape or value needs the host to wait."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.overloadpacket in _SYNCING_OPS or _mask_indexing(func, args):
            raise AssertionError(f"host read of a device value: {func}")
        return func(*args, **(kwargs or {}))


def _mask_indexing(func: Any, args: tuple[Any, ...]) -> bool:
    # x[mask] hides a nonzero inside aten.index: its output size is data-dependent.
    if func.overloadpacket not in _INDEXING_OPS or len(args) < 2:
        return False
    indices = args[1] if isinstance(args[1], list | tuple) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


@contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def forbidden(*_: object, **__: object) -> Any:
        raise AssertionError("host read of a device value")

    # tolist / numpy read CPU memory directly, without going through the dispatcher.
    with monkeypatch.context() as patch:
        for name in ("tolist", "numpy", "__array__", "item", "__bool__"):
            patch.setattr(torch.Tensor, name, forbidden)
        with _NoHostReads():  # type: ignore[no-untyped-call]
            yield


def everything_batch(vocab: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, return_logprob=True),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3),
        SamplingParams(temperature=1.3, top_logprobs_num=vocab, frequency_penalty=0.5),
        SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, seed=8),
    ]


def test_the_guard_catches_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.ones(3)
    for read in (
        lambda: t.sum().item(),
        lambda: bool(t.sum() > 0),
        lambda: int(t.sum()),
        lambda: t.tolist(),
        lambda: t[t > 0],
        lambda: t.nonzero(),
    ):
        with no_host_reads(monkeypatch), pytest.raises(AssertionError, match="host read"):
            read()


def test_sample_never_reads_the_device_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = 40
    params = everything_batch(vocab)
    state = PenaltyState(8, vocab, CPU)
    for row, p in enumerate(params, start=1):
        state.reset_row(row, torch.tensor([1, 2, row]), p)
    sampler = Sampler(seed=0)
    info = build(params, steps=[0, 1, 2, 3])
    logits = torch.randn(len(params), vocab)
    with no_host_reads(monkeypatch):
        out = sampler.sample(logits, info, state)
        state.record(info.rows, out.next_token_ids)
    assert out.next_token_ids.shape == (len(params),)


def test_sample_runs_on_the_meta_device() -> None:
    """Meta tensors have no values: any host read would raise. (Seeded rows only: a
    meta device has no generator.)"""
    vocab = 40
    params = [
        SamplingParams(**{**p.to_dict(), "seed": p.seed or 1}) for p in everything_batch(vocab)
    ]
    meta = torch.device("meta")
    state = PenaltyState(8, vocab, meta)
    for row, p in enumerate(params, start=1):
        state.reset_row(row, torch.empty(3, dtype=torch.int64, device=meta), p)
    info = build(params, device=meta)
    out = Sampler().sample(torch.empty(len(params), vocab, device=meta), info, state)
    state.record(info.rows, out.next_token_ids)
    assert out.next_token_ids.device == meta
    assert out.next_token_ids.shape == (len(params),)
    assert out.top_logprobs is not None
    assert out.top_logprobs[0].shape == (len(params), vocab)


# -- CUDA -----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sample_never_syncs_and_matches_cpu_for_seeded_rows() -> None:
    vocab = 1000
    cuda = torch.device("cuda")
    params = everything_batch(vocab)
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(3)) * 2
    outputs = []
    for device in (CPU, cuda):
        state = PenaltyState(8, vocab, device)
        for row, p in enumerate(params, start=1):
            state.reset_row(row, torch.tensor([1, 2, row], device=device), p)
        info = build(params, steps=[0, 1, 2, 3], device=device)
        dev_logits = logits.to(device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = Sampler(seed=0).sample(dev_logits, info, state)
            state.record(info.rows, out.next_token_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outputs.append(out.next_token_ids.cpu())
    seeded = [i for i, p in enumerate(params) if p.seed is not None or p.is_greedy]
    assert torch.equal(outputs[0][seeded], outputs[1][seeded])


def test_plain_greedy_shortcut_agrees_with_the_sampler() -> None:
    """The runner's argmax shortcut is taken exactly when the full sampler would only
    argmax, and then gives its tokens."""
    greedy = SamplingParams(temperature=0)
    assert SamplingBatchInfo.is_plain_greedy([greedy, greedy])
    assert not SamplingBatchInfo.is_plain_greedy([greedy, SamplingParams(temperature=0.7)])
    assert not SamplingBatchInfo.is_plain_greedy(
        [SamplingParams(temperature=0, presence_penalty=1)]
    )
    assert not SamplingBatchInfo.is_plain_greedy(
        [SamplingParams(temperature=0, return_logprob=True)]
    )
    assert not SamplingBatchInfo.is_plain_greedy([greedy], return_logprob=[True])
    assert not SamplingBatchInfo.is_plain_greedy([greedy], top_logprobs_num=[2])
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    info = SamplingBatchInfo.build([greedy] * 5, rows=[1, 2, 3, 4, 5], steps=[0] * 5, device="cpu")
    full = Sampler().sample(logits, info)
    quick = Sampler.sample_greedy(logits)
    assert torch.equal(full.next_token_ids, quick.next_token_ids)
    assert quick.logprobs is None
    assert quick.top_logprobs is None
