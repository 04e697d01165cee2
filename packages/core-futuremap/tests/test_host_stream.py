"""The CPU host stream: FIFO order, sequence-number events, errors that surface at the
next host wait (never lost, never a hang), random delays, cross-stream waits."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from tandem.futuremap import (
    HostEvent,
    HostStream,
    InlineStream,
    StreamError,
    create_event,
    create_stream,
    current_stream,
)

TIMEOUT = 30.0


@pytest.fixture
def stream() -> HostStream:
    s = HostStream("test-stream", max_delay_s=0.002, seed=7)
    yield s
    s.close()


def test_items_run_in_submission_order_on_one_worker(stream: HostStream) -> None:
    seen: list[int] = []
    threads: set[str] = set()

    def item(i: int) -> int:
        seen.append(i)
        threads.add(threading.current_thread().name)
        return i * i

    works = [stream.submit(item, i) for i in range(50)]
    assert [w.result(TIMEOUT) for w in works] == [i * i for i in range(50)]
    assert seen == list(range(50))
    assert threads == {"test-stream"}


def test_submit_does_not_wait_for_the_worker() -> None:
    gate = threading.Event()
    with HostStream() as s:
        s.submit(gate.wait, TIMEOUT)
        work = s.submit(lambda: "after")
        assert not work.done()  # the host went on while the worker is blocked
        gate.set()
        assert work.result(TIMEOUT) == "after"


def test_events_are_sequence_numbers(stream: HostStream) -> None:
    gate = threading.Event()
    stream.submit(gate.wait, TIMEOUT)
    event = stream.record_event()
    assert not event.query()
    later = stream.record_event()
    gate.set()
    event.synchronize()
    assert event.query()
    later.synchronize()


def test_an_unrecorded_event_is_complete() -> None:
    event = HostEvent()
    assert event.query()
    event.synchronize()


def test_torch_work_overlaps_with_the_host() -> None:
    # A matmul on the worker releases the GIL, so the host thread keeps running.
    a = torch.randn(512, 512)
    with HostStream() as s:
        work = s.submit(lambda: [a @ a for _ in range(20)][-1])
        host_steps = 0
        while not work.done():
            host_steps += 1
            time.sleep(0)
        assert host_steps > 0
        assert work.result(TIMEOUT).shape == (512, 512)


def test_exception_surfaces_at_the_next_synchronize(stream: HostStream) -> None:
    def boom() -> None:
        raise ValueError("kernel failed")

    stream.submit(lambda: None)
    stream.submit(boom)
    skipped = stream.submit(lambda: "never runs")
    with pytest.raises(StreamError, match="kernel failed") as info:
        stream.synchronize()
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(StreamError, match="skipped"):
        skipped.result(TIMEOUT)
    # reported once; the stream runs again afterwards
    stream.synchronize()
    assert stream.submit(lambda: 5).result(TIMEOUT) == 5


def test_exception_surfaces_at_an_event_wait(stream: HostStream) -> None:
    stream.submit(lambda: 1 / 0)
    event = stream.record_event()
    with pytest.raises(StreamError, match="ZeroDivisionError"):
        event.synchronize()
    stream.synchronize()  # already reported


def test_exception_surfaces_at_work_result_once(stream: HostStream) -> None:
    work = stream.submit(lambda: [][1])
    with pytest.raises(StreamError, match="IndexError"):
        work.result(TIMEOUT)
    stream.synchronize()  # the result() call reported it
    assert stream.submit(lambda: "ok").result(TIMEOUT) == "ok"


def test_a_failing_item_never_hangs_a_waiting_host() -> None:
    with HostStream(max_delay_s=0.001) as s:
        for _ in range(20):
            s.submit(lambda: None)
        s.submit(lambda: (_ for _ in ()).throw(RuntimeError("late failure")))
        for _ in range(20):
            s.submit(lambda: None)
        done = threading.Event()
        errors: list[BaseException] = []

        def host() -> None:
            try:
                s.synchronize()
            except StreamError as exc:
                errors.append(exc)
            done.set()

        threading.Thread(target=host, daemon=True).start()
        assert done.wait(TIMEOUT), "synchronize hung after a failure"
        assert errors
        assert "late failure" in str(errors[0])


def test_random_delays_keep_fifo_order() -> None:
    out: list[int] = []
    with HostStream(max_delay_s=0.003, seed=11) as s:
        for i in range(40):
            s.submit(out.append, i)
        s.synchronize()
    assert out == list(range(40))


def test_wait_event_across_host_streams() -> None:
    gate = threading.Event()
    order: list[str] = []
    with HostStream("a") as a, HostStream("b") as b:
        a.submit(gate.wait, TIMEOUT)
        a.submit(order.append, "a-done")
        b.wait_stream(a)
        work = b.submit(order.append, "b-after-a")
        time.sleep(0.05)
        assert not work.done()  # b is held by a's event
        gate.set()
        work.result(TIMEOUT)
    assert order == ["a-done", "b-after-a"]


def test_current_stream_inside_a_work_item(stream: HostStream) -> None:
    assert isinstance(current_stream("cpu"), InlineStream)
    assert stream.submit(current_stream, "cpu").result(TIMEOUT) is stream


def test_an_event_recorded_inside_an_item_is_complete_at_once(stream: HostStream) -> None:
    def item() -> bool:
        event = create_event("cpu")
        event.record(current_stream("cpu"))
        event.synchronize()  # must not deadlock on its own stream
        return event.query()

    stream.submit(time.sleep, 0.01)
    assert stream.submit(item).result(TIMEOUT)


def test_synchronize_from_the_worker_is_refused(stream: HostStream) -> None:
    with pytest.raises(StreamError, match="deadlock"):
        stream.submit(stream.synchronize).result(TIMEOUT)


def test_closed_stream_refuses_work_and_stops_its_thread() -> None:
    s = HostStream("closing")
    s.submit(lambda: None)
    s.close()
    assert not any(t.name == "closing" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        s.submit(lambda: None)


def test_an_abandoned_stream_stops_its_worker() -> None:
    s = HostStream("abandoned")
    s.submit(lambda: None).result(TIMEOUT)
    del s
    gc.collect()
    deadline = time.monotonic() + TIMEOUT
    while any(t.name == "abandoned" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "worker of a collected stream still alive"
        time.sleep(0.01)


def test_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="max_delay_s"):
        HostStream(max_delay_s=-1)


def test_create_stream_reads_delay_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HOST_STREAM_MAX_DELAY_MS", "2")
    monkeypatch.setenv("TANDEM_HOST_STREAM_SEED", "5")
    s = create_stream("cpu")
    try:
        assert isinstance(s, HostStream)
        assert s._state.max_delay_s == pytest.approx(0.002)
    finally:
        s.close()


def test_inline_stream_runs_at_once() -> None:
    s = InlineStream()
    assert s.submit(lambda x: x + 1, 1).result() == 2
    event = s.record_event()
    assert event.query()
    s.wait_event(event)
    s.synchronize()
