"""FutureMap clauses, one test each: stash/resolve, consume-once, publish, relay fields,
mixed batches, padding row, and the non-debug path. Run under both the compiled and
the eager checks."""

from __future__ import annotations

import pytest
import torch

from tandem.futuremap import FutureMap, RelayField


@pytest.fixture(params=["on", "off"], ids=["compiled", "eager"])
def checks_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TANDEM_COMPILE_CHECKS", request.param)
    return str(request.param)


@pytest.fixture
def fmap(checks_mode: str) -> FutureMap:
    return FutureMap(num_rows=8, device="cpu", debug=True)


def test_stash_then_resolve_returns_int64_in_row_order(fmap: FutureMap) -> None:
    fmap.stash(torch.tensor([3, 1, 5]), torch.tensor([[30], [10], [50]], dtype=torch.int32))
    out = fmap.resolve_tokens(torch.tensor([5, 3, 1]))
    assert out.dtype == torch.int64
    assert out.tolist() == [50, 30, 10]


def test_rows_and_tokens_may_be_python_sequences(fmap: FutureMap) -> None:
    fmap.stash([2, 4], [7, 9])
    assert fmap.resolve_tokens([4, 2]).tolist() == [9, 7]


def test_second_resolve_without_stash_raises(fmap: FutureMap) -> None:
    fmap.stash([1, 2], [5, 6])
    fmap.resolve_tokens([1, 2])
    with pytest.raises(RuntimeError, match="consume-once"):
        fmap.resolve_tokens([1])


def test_resolve_before_any_stash_raises(fmap: FutureMap) -> None:
    with pytest.raises(RuntimeError, match="consume-once"):
        fmap.resolve_tokens([4])


def test_write_read_write_read_passes(fmap: FutureMap) -> None:
    for step in range(4):
        fmap.stash([1, 2, 3], [step, step + 1, step + 2])
        assert fmap.resolve_tokens([1, 2, 3]).tolist() == [step, step + 1, step + 2]


def test_one_consumed_row_poisons_a_batch_read(fmap: FutureMap) -> None:
    fmap.stash([1, 2], [5, 6])
    fmap.resolve_tokens([1])
    with pytest.raises(RuntimeError, match="consume-once"):
        fmap.resolve_tokens([2, 1])


def test_a_row_twice_in_one_resolve_raises(fmap: FutureMap) -> None:
    fmap.stash([1], [5])
    with pytest.raises(RuntimeError, match="twice"):
        fmap.resolve_tokens([1, 1])


def test_empty_rows_are_no_ops(fmap: FutureMap) -> None:
    fmap.stash([], [])
    fmap.stash(torch.empty(0, dtype=torch.int64), torch.empty(0))
    assert fmap.resolve_tokens([]).shape == (0,)
    assert fmap.resolve_tokens(torch.empty(0, dtype=torch.int64)).dtype == torch.int64
    assert fmap.resolve_seq_lens([]).numel() == 0
    fmap.publish([], [])
    # nothing was consumed by the empty calls
    fmap.stash([1], [3])
    assert fmap.resolve_tokens([1]).tolist() == [3]


def test_padding_row_is_exempt_and_harmless(fmap: FutureMap) -> None:
    fmap.stash([1, 0, 0], [4, 9, 9])
    out = fmap.resolve_tokens([1, 0, 0])
    assert out[0].item() == 4
    assert (out >= 0).all()
    # row 0 may be read again and again without a stash
    assert (fmap.resolve_tokens([0, 0]) >= 0).all()
    assert (fmap.resolve_seq_lens([0]) > 0).all()


def test_publish_round_trips_and_records_an_event(fmap: FutureMap) -> None:
    assert fmap.publish_event is None
    fmap.publish(torch.tensor([2, 6]), torch.tensor([17, 3], dtype=torch.int32))
    assert fmap.resolve_seq_lens([6, 2]).tolist() == [3, 17]
    assert fmap.resolve_seq_lens([2]).dtype == torch.int64
    event = fmap.publish_event
    assert event is not None
    assert event.query()
    event.synchronize()
    fmap.publish([2], [18])
    assert fmap.publish_event is event  # created once, re-recorded


@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_seq_len_raises(fmap: FutureMap, bad: int) -> None:
    fmap.publish([1, 2], [4, bad])
    with pytest.raises(RuntimeError, match="not positive"):
        fmap.resolve_seq_lens([1, 2])


def test_seq_len_read_before_publish_raises(fmap: FutureMap) -> None:
    with pytest.raises(RuntimeError, match="not positive"):
        fmap.resolve_seq_lens([5])


def test_seq_lens_are_state_not_consumed(fmap: FutureMap) -> None:
    fmap.publish([1], [9])
    assert fmap.resolve_seq_lens([1]).tolist() == [9]
    assert fmap.resolve_seq_lens([1]).tolist() == [9]


def test_without_debug_no_check_fires(checks_mode: str) -> None:
    fmap = FutureMap(num_rows=8, device="cpu", debug=False)
    assert fmap.resolve_tokens([3]).tolist() == [0]  # before any stash
    fmap.stash([3], [11])
    assert fmap.resolve_tokens([3]).tolist() == [11]
    assert fmap.resolve_tokens([3, 3]).tolist() == [11, 11]  # twice, duplicated
    fmap.publish([2], [0])
    assert fmap.resolve_seq_lens([2]).tolist() == [0]
    fmap.declare(RelayField("h", (2,)))
    assert fmap.resolve_relay([1], "h")["h"].shape == (1, 2)
    assert fmap.resolve_mixed([-5], []).tolist() == [-5]  # host data is not inspected


def test_debug_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_DEBUG_FUTURES", "0")
    assert FutureMap(num_rows=2, device="cpu").debug is False
    monkeypatch.setenv("TANDEM_DEBUG_FUTURES", "1")
    assert FutureMap(num_rows=2, device="cpu").debug is True


def test_buffers_are_sized_by_rows_plus_padding(fmap: FutureMap) -> None:
    assert fmap.output_tokens.shape == (9,)
    assert fmap.new_seq_lens.shape == (9,)
    assert fmap.output_tokens.dtype == fmap.new_seq_lens.dtype == torch.int64
    assert (fmap.output_tokens[1:] == -1).all()  # debug: unwritten


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_num_rows_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="num_rows"):
        FutureMap(num_rows=bad, device="cpu")  # type: ignore[arg-type]


def test_mismatched_lengths_name_the_problem(fmap: FutureMap) -> None:
    with pytest.raises(ValueError, match="2 rows but 3 tokens"):
        fmap.stash([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="1 rows but 2 lengths"):
        fmap.publish([1], [1, 2])
    with pytest.raises(TypeError, match="integer tensor"):
        fmap.resolve_tokens(torch.tensor([1.0]))


def test_relay_fields_are_lazy_typed_and_consumed_once(fmap: FutureMap) -> None:
    fmap.declare(
        RelayField("topk_p", (2,), torch.float32),
        RelayField("topk_index", (2,), torch.int64),
        RelayField("hidden_states", (4,), torch.float32),
    )
    assert fmap.relay_buffer("topk_p") is None  # allocated on first stash
    hidden = torch.randn(2, 4)
    fmap.stash(
        [3, 1],
        [5, 6],
        topk_p=torch.tensor([[0.5, 0.25], [0.75, 0.125]], dtype=torch.float64),
        topk_index=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        hidden_states=hidden,
    )
    buf = fmap.relay_buffer("topk_p")
    assert buf is not None
    assert buf.shape == (9, 2)
    assert buf.dtype == torch.float32
    got = fmap.resolve_relay([1, 3], "topk_p", "topk_index")
    assert got["topk_p"].tolist() == [[0.75, 0.125], [0.5, 0.25]]
    assert got["topk_index"].dtype == torch.int64
    assert got["topk_index"].tolist() == [[3, 4], [1, 2]]
    with pytest.raises(RuntimeError, match="consume-once"):
        fmap.resolve_relay([1], "topk_p")
    # hidden_states was not resolved yet; negative values are fine for relay data
    assert torch.equal(fmap.resolve_relay([3, 1], "hidden_states")["hidden_states"], hidden)
    assert fmap.resolve_tokens([3, 1]).tolist() == [5, 6]


def test_relay_field_errors_name_the_field(fmap: FutureMap) -> None:
    fmap.declare(RelayField("topk_p", (2,)))
    with pytest.raises(KeyError, match="'nope' is not declared"):
        fmap.stash([1], [1], nope=torch.zeros(1))
    with pytest.raises(ValueError, match="expects shape"):
        fmap.stash([1], [1], topk_p=torch.zeros(1, 3))
    with pytest.raises(RuntimeError, match="before any stash"):
        fmap.resolve_relay([1], "topk_p")
    with pytest.raises(ValueError, match="already declared"):
        fmap.declare(RelayField("topk_p", (3,)))
    fmap.declare(RelayField("topk_p", (2,)))  # identical: fine
    with pytest.raises(ValueError, match="reserved"):
        RelayField("output_tokens")
    with pytest.raises(ValueError, match="identifier"):
        RelayField("top-k")
    with pytest.raises(ValueError, match="positive ints"):
        RelayField("x", (0,))


def test_failed_stash_writes_nothing(fmap: FutureMap) -> None:
    fmap.declare(RelayField("topk_p", (2,)))
    with pytest.raises(ValueError, match="expects shape"):
        fmap.stash([1], [9], topk_p=torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="consume-once"):
        fmap.resolve_tokens([1])


def test_mixed_batch_puts_prefill_first_then_resolved_decode(fmap: FutureMap) -> None:
    fmap.stash([2, 5], [20, 50])
    ids = fmap.resolve_mixed(torch.tensor([7, 8, 9], dtype=torch.int32), torch.tensor([5, 2]))
    assert ids.dtype == torch.int64
    assert ids.tolist() == [7, 8, 9, 50, 20]
    assert fmap.resolve_mixed([1, 2], []).tolist() == [1, 2]
    fmap.stash([3], [30])
    assert fmap.resolve_mixed([], [3]).tolist() == [30]
    with pytest.raises(RuntimeError, match="consume-once"):
        fmap.resolve_mixed([1], [2])  # row 2 was consumed above


def test_mixed_batch_rejects_negative_prefill_ids(fmap: FutureMap) -> None:
    with pytest.raises(ValueError, match="negative"):
        fmap.resolve_mixed([4, -1], [])


def test_discard_makes_a_freed_row_unwritten(fmap: FutureMap) -> None:
    fmap.declare(RelayField("h", (1,)))
    fmap.stash([4], [44], h=torch.ones(1, 1))
    fmap.publish([4], [12])
    fmap.discard([4])
    with pytest.raises(RuntimeError, match="consume-once"):
        fmap.resolve_tokens([4])
    with pytest.raises(RuntimeError, match="not positive"):
        fmap.resolve_seq_lens([4])
    with pytest.raises(RuntimeError, match="consume-once"):
        fmap.resolve_relay([4], "h")
    fmap.stash([4], [45])  # the next owner writes first
    assert fmap.resolve_tokens([4]).tolist() == [45]


def test_stash_and_resolve_on_the_host_stream() -> None:
    from tandem.futuremap import create_stream

    fmap = FutureMap(num_rows=4, device="cpu", debug=True)
    with create_stream("cpu", max_delay_s=0.001, seed=3) as stream:
        for step in range(5):
            stream.submit(fmap.stash, [1, 2], torch.tensor([step, step * 2]))
            work = stream.submit(fmap.resolve_tokens, [2, 1])
            assert work.result().tolist() == [step * 2, step]
        stream.synchronize()
