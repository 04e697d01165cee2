"""Random sequences of stash / resolve / publish / discard, driven through the host
stream with random delays, against a plain-Python model of the protocol.

Operations are pipelined: the host submits them without waiting, and checks each
result later, as the overlap loop does. An operation the model says must violate the
consume-once invariant is waited on at once, and must fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from tandem.futuremap import FutureMap, HostStream, RelayField, StreamError, Work

NUM_ROWS = 6
ROWS = st.lists(st.integers(1, NUM_ROWS), min_size=0, max_size=NUM_ROWS, unique=True)
TOKEN = st.integers(0, 50_000)


@dataclass
class Pending:
    work: Work[torch.Tensor]
    expected: list[int] | list[list[float]]


class ProtocolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.stream = HostStream("stateful", max_delay_s=0.0005, seed=1)
        self.fmap = FutureMap(num_rows=NUM_ROWS, device="cpu", debug=True)
        self.fmap.declare(RelayField("hidden", (2,), torch.float32))
        # the model: row -> unread value, or absent when unwritten / consumed
        self.tokens: dict[int, int] = {}
        self.hidden: dict[int, list[float]] = {}
        self.lens: dict[int, int] = {}
        self.pending: list[Pending] = []

    def _expect_failure(self, work: Work[object]) -> None:
        with pytest.raises(StreamError, match=r"consume-once|not positive"):
            work.result(30)

    @rule(rows=ROWS, data=st.data())
    def stash(self, rows: list[int], data: st.DataObject) -> None:
        tokens = [data.draw(TOKEN) for _ in rows]
        hidden = [[float(t), -float(t)] for t in tokens]
        self.stream.submit(
            self.fmap.stash, torch.tensor(rows, dtype=torch.int64), torch.tensor(tokens),
            hidden=torch.tensor(hidden).reshape(len(rows), 2),
        )  # fmt: skip
        self.tokens.update(zip(rows, tokens, strict=True))
        self.hidden.update(zip(rows, hidden, strict=True))

    @rule(rows=ROWS)
    def resolve_tokens(self, rows: list[int]) -> None:
        work = self.stream.submit(self.fmap.resolve_tokens, torch.tensor(rows, dtype=torch.int64))
        if all(r in self.tokens for r in rows):
            self.pending.append(Pending(work, [self.tokens.pop(r) for r in rows]))
        else:
            self._expect_failure(work)
            self._forget(rows)

    @rule(rows=ROWS)
    def resolve_hidden(self, rows: list[int]) -> None:
        work = self.stream.submit(lambda: self.fmap.resolve_relay(rows, "hidden")["hidden"])
        if all(r in self.hidden for r in rows):
            self.pending.append(Pending(work, [self.hidden.pop(r) for r in rows]))
        else:
            self._expect_failure(work)
            self._forget(rows)

    @rule(rows=ROWS, data=st.data())
    def publish(self, rows: list[int], data: st.DataObject) -> None:
        lens = [data.draw(st.integers(-2, 4096)) for _ in rows]
        self.stream.submit(self.fmap.publish, rows, lens)
        self.lens.update(zip(rows, lens, strict=True))

    @rule(rows=ROWS)
    def resolve_seq_lens(self, rows: list[int]) -> None:
        work = self.stream.submit(self.fmap.resolve_seq_lens, rows)
        if all(self.lens.get(r, 0) > 0 for r in rows):
            self.pending.append(Pending(work, [self.lens[r] for r in rows]))
        else:
            self._expect_failure(work)

    @rule(rows=ROWS)
    def discard(self, rows: list[int]) -> None:
        self.stream.submit(self.fmap.discard, rows)
        self._forget(rows)
        for r in rows:
            self.lens.pop(r, None)

    @precondition(lambda self: bool(self.pending))
    @rule()
    def check_results(self) -> None:
        self._drain()

    def _forget(self, rows: list[int]) -> None:
        # After a violation the rows' contents are undefined: discard them on the
        # stream so that model and FutureMap agree again.
        self.stream.submit(self.fmap.discard, rows)
        for r in rows:
            self.tokens.pop(r, None)
            self.hidden.pop(r, None)
            self.lens.pop(r, None)

    def _drain(self) -> None:
        for item in self.pending:
            assert item.work.result(30).tolist() == item.expected
        self.pending.clear()

    def teardown(self) -> None:
        try:
            self._drain()
            self.stream.synchronize()
        finally:
            self.stream.close()


ProtocolMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestProtocol = ProtocolMachine.TestCase
