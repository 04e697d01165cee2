"""The KV transports of disaggregation (``tandem.scheduler.disagg.transfer``): both
backends move byte regions between buffers laid out like a small KV pool, exactly and
nothing else; fail in time when the peer is gone; and close without leaving threads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

import pytest
import torch

from tandem.scheduler.disagg import transfer
from tandem.scheduler.disagg.transfer import KVTransport, Region, TransferError, make_transport

BACKENDS = ["mooncake", "torch"]
HOST = "127.0.0.1"
LAYERS, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM = 2, 8, 4, 2, 8
TIMEOUT_S = 10.0

Make = Callable[[str, list[torch.Tensor]], KVTransport]


def kv_buffers(dtype: torch.dtype, seed: int | None = None) -> list[torch.Tensor]:
    """``[k_0, k_1, v_0, v_1]``, random with a seed, zeros without."""
    shape = (PAGES * PAGE_SIZE, KV_HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(2 * LAYERS)]


def page_regions(
    dtype: torch.dtype, runs: Sequence[tuple[int, int, int]]
) -> tuple[list[Region], list[Region]]:
    """(source page, destination page, pages) runs, in every buffer."""
    page = PAGE_SIZE * KV_HEADS * HEAD_DIM * dtype.itemsize
    src, dst = [], []
    for b in range(2 * LAYERS):
        for s, d, n in runs:
            src.append(Region(b, s * page, n * page))
            dst.append(Region(b, d * page, n * page))
    return src, dst


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).view(-1)


def expected_after(
    src_bufs: list[torch.Tensor],
    dst_bufs: list[torch.Tensor],
    src: Sequence[Region],
    dst: Sequence[Region],
) -> list[torch.Tensor]:
    out = [raw(b).clone() for b in dst_bufs]
    for s, d in zip(src, dst, strict=True):
        out[d.buffer][d.offset : d.offset + d.length] = raw(src_bufs[s.buffer])[
            s.offset : s.offset + s.length
        ]
    return out


def move(
    prefill: KVTransport,
    decode: KVTransport,
    key: int,
    src: Sequence[Region],
    dst: Sequence[Region],
) -> None:
    arrived = decode.expect(prefill.endpoint, key, dst, TIMEOUT_S)
    prefill.send(decode.endpoint, key, src, dst, TIMEOUT_S)
    arrived.result(TIMEOUT_S)


def close_all(transports: Sequence[KVTransport]) -> None:
    # Side by side: a Mooncake engine takes about a second to stop.
    closers = [threading.Thread(target=t.close) for t in transports]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join()


@pytest.fixture
def make() -> Iterator[Make]:
    made: list[KVTransport] = []

    def make(backend: str, buffers: list[torch.Tensor]) -> KVTransport:
        made.append(make_transport(backend, buffers, HOST))
        return made[-1]

    yield make
    close_all(made)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_regions_arrive_exactly(make: Make, backend: str, dtype: torch.dtype) -> None:
    src_bufs, dst_bufs = kv_buffers(dtype, seed=1), kv_buffers(dtype)
    sources = [raw(b).clone() for b in src_bufs]
    prefill, decode = make(backend, src_bufs), make(backend, dst_bufs)

    # a run of three pages, a lone page, and an empty region, in every buffer
    src, dst = page_regions(dtype, [(1, 5, 3), (7, 1, 1), (0, 0, 0)])
    want = expected_after(src_bufs, dst_bufs, src, dst)
    move(prefill, decode, 3, src, dst)
    for got, expected in zip(dst_bufs, want, strict=True):
        assert torch.equal(raw(got), expected)

    # again with the same peer (the torch backend reuses its group), other pages
    src, dst = page_regions(dtype, [(4, 3, 2)])
    want = expected_after(src_bufs, dst_bufs, src, dst)
    move(prefill, decode, 4, src, dst)
    for got, expected in zip(dst_bufs, want, strict=True):
        assert torch.equal(raw(got), expected)
    for got, before in zip(src_bufs, sources, strict=True):
        assert torch.equal(raw(got), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_transfers_under_their_own_keys(make: Make, backend: str) -> None:
    dtype = torch.float32
    src_bufs, dst_bufs = kv_buffers(dtype, seed=2), kv_buffers(dtype)
    prefill, decode = make(backend, src_bufs), make(backend, dst_bufs)
    moves = {key: page_regions(dtype, [(key, PAGES - 1 - key, 1)]) for key in range(PAGES)}
    arrived = {
        key: decode.expect(prefill.endpoint, key, dst, TIMEOUT_S) for key, (_, dst) in moves.items()
    }
    errors: list[BaseException] = []

    def send(key: int) -> None:
        try:
            prefill.send(decode.endpoint, key, *moves[key], TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - checked below, in the test's thread
            errors.append(e)

    # sent in the opposite order to the one they were expected in
    senders = [threading.Thread(target=send, args=(key,)) for key in reversed(moves)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    assert errors == []
    for future in arrived.values():
        future.result(TIMEOUT_S)
    for got, source in zip(dst_bufs, src_bufs, strict=True):
        pages = (PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
        assert torch.equal(got.view(pages), source.view(pages).flip(0))


_DECODE_PROCESS = """
import json, os, sys
import torch
from tandem.scheduler.disagg.transfer import make_transport

shape, dtype = {shape}, torch.{dtype}
buffers = [torch.zeros(shape, dtype=dtype) for _ in range({count})]
transport = make_transport("mooncake", buffers, "127.0.0.1")
print(json.dumps(transport.endpoint), flush=True)
sys.stdin.readline()  # the parent has written
print(json.dumps([bytes(b.view(torch.uint8).view(-1).tolist()).hex() for b in buffers]), flush=True)
os._exit(0)  # gone at once, as if it crashed
"""


def read_line(stream: IO[str], proc: subprocess.Popen[str], timeout_s: float) -> str:
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not line or not line[0]:
        proc.kill()
        pytest.fail("the decode process said nothing")
    return line[0]


def wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` has stopped (SIGSTOP lands asynchronously)."""
    deadline = time.monotonic() + TIMEOUT_S
    tasks = Path(f"/proc/{pid}/task")
    while not all(
        (task / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT" for task in tasks.iterdir()
    ):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


def test_mooncake_between_processes(make: Make, tmp_path: Path) -> None:
    dtype = torch.bfloat16
    src_bufs = kv_buffers(dtype, seed=3)
    prefill = make("mooncake", src_bufs)
    script = _DECODE_PROCESS.format(
        shape=tuple(src_bufs[0].shape), dtype="bfloat16", count=len(src_bufs)
    )
    src, dst = page_regions(dtype, [(0, 2, 2), (6, 7, 1)])
    late_src, late_dst = page_regions(dtype, [(5, 0, 1)])
    with (tmp_path / "decode.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            assert proc.stdin is not None
            assert proc.stdout is not None
            endpoint = json.loads(read_line(proc.stdout, proc, 60))
            prefill.send(endpoint, 1, src, dst, TIMEOUT_S)

            # a peer that hangs: the send gives up in time, the write goes on
            proc.send_signal(signal.SIGSTOP)
            wait_stopped(proc.pid)
            start = time.monotonic()
            with pytest.raises(TransferError, match=r"timed out after 0\.5 s"):
                prefill.send(endpoint, 2, late_src, late_dst, 0.5)
            assert 0.5 <= time.monotonic() - start < 3
            proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + TIMEOUT_S
            while any(t.name.startswith("tandem-kv-write") for t in threading.enumerate()):
                assert time.monotonic() < deadline, "the late write never ended"
                time.sleep(0.01)

            proc.stdin.write("\n")
            proc.stdin.flush()
            got = [bytes.fromhex(h) for h in json.loads(read_line(proc.stdout, proc, 30))]
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    want = expected_after(src_bufs, kv_buffers(dtype), [*src, *late_src], [*dst, *late_dst])
    assert got == [bytes(w.tolist()) for w in want]

    # the decode process is gone now
    start = time.monotonic()
    with pytest.raises(TransferError, match=endpoint["session"]):
        prefill.send(endpoint, 3, src, dst, 5.0)
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_to_a_peer_that_is_gone(make: Make, backend: str) -> None:
    dtype = torch.float32
    prefill = make(backend, kv_buffers(dtype, seed=4))
    src, dst = page_regions(dtype, [(1, 1, 2)])

    # A peer the sender never reached, then one it had sent to before it closed.
    for key, used_before in ((1, False), (3, True)):
        peer = make(backend, kv_buffers(dtype))
        if used_before:
            move(prefill, peer, key - 1, src, dst)
        endpoint = peer.endpoint
        peer.close()
        start = time.monotonic()
        with pytest.raises(TransferError):
            prefill.send(endpoint, key, src, dst, 5.0)
        assert time.monotonic() - start < 5.0


def test_torch_timeouts_then_the_pair_recovers(make: Make) -> None:
    """A gloo wait that times out closes the pair's whole group, on both sides: the next
    transfer builds a new one."""
    dtype = torch.float32
    src_bufs, dst_bufs = kv_buffers(dtype, seed=5), kv_buffers(dtype)
    prefill, decode = make("torch", src_bufs), make("torch", dst_bufs)
    src, dst = page_regions(dtype, [(2, 3, 1)])
    move(prefill, decode, 1, src, dst)

    start = time.monotonic()
    with pytest.raises(TransferError, match=r"timed out after 0\.3 s"):
        prefill.send(decode.endpoint, 2, src, dst, 0.3)  # nothing expects it
    assert 0.3 <= time.monotonic() - start < 3
    move(prefill, decode, 3, src, dst)

    arrived = decode.expect(prefill.endpoint, 4, dst, 0.3)  # nothing sends it
    with pytest.raises(TransferError, match=r"timed out after 0\.3 s"):
        arrived.result(3)
    move(prefill, decode, 5, src, dst)
    assert torch.equal(
        dst_bufs[0][3 * PAGE_SIZE : 4 * PAGE_SIZE], src_bufs[0][2 * PAGE_SIZE : 3 * PAGE_SIZE]
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_requests_raise_value_error(make: Make, backend: str) -> None:
    dtype = torch.float32
    prefill, decode = make(backend, kv_buffers(dtype, seed=6)), make(backend, kv_buffers(dtype))
    src, dst = page_regions(dtype, [(1, 1, 2)])
    peer = decode.endpoint
    with pytest.raises(ValueError, match="source regions for"):
        prefill.send(peer, 1, src, dst[:-1], TIMEOUT_S)
    shorter = [*dst[:-1], Region(dst[-1].buffer, dst[-1].offset, dst[-1].length - 4)]
    with pytest.raises(ValueError, match="source bytes for"):
        prefill.send(peer, 1, src, shorter, TIMEOUT_S)
    size = raw(kv_buffers(dtype)[0]).numel()
    past_the_end = [Region(0, size - 4, 8)]
    with pytest.raises(ValueError, match="outside buffer 0"):
        prefill.send(peer, 1, past_the_end, past_the_end, TIMEOUT_S)
    with pytest.raises(ValueError, match="no buffer 4"):
        decode.expect(prefill.endpoint, 1, [Region(4, 0, 8)], TIMEOUT_S)
    for key in (-1, 1 << 31, True):
        with pytest.raises(ValueError, match="transfer keys"):
            prefill.send(peer, key, src, dst, TIMEOUT_S)
    with pytest.raises(ValueError, match="timeout_s"):
        prefill.send(peer, 1, src, dst, 0)
    other = next(b for b in BACKENDS if b != backend)
    with pytest.raises(ValueError, match="backend"):
        prefill.send({**peer, "backend": other}, 1, src, dst, TIMEOUT_S)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown KV transfer backend 'nixl'"):
        make_transport("nixl", kv_buffers(torch.float32), HOST)


def test_missing_mooncake_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(RuntimeError) as info:
        make_transport("mooncake", kv_buffers(torch.float32), HOST)
    message = str(info.value)
    assert "pip install mooncake-transfer-engine-non-cuda" in message
    assert "apt-get install libibverbs1" in message
    assert "--disaggregation-transfer-backend torch" in message


def test_importing_the_module_imports_no_backend() -> None:
    code = (
        "import sys, tandem.scheduler.disagg.transfer; "
        "assert 'mooncake' not in sys.modules and 'mooncake.engine' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_native_threads() -> int:
    """The thread count once it holds still: libraries start some threads in the
    background (Mooncake at import)."""
    count = native_threads()
    for _ in range(40):
        time.sleep(0.025)
        count, before = native_threads(), count
        if count == before:
            break
    return count


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_is_idempotent_and_leaves_no_threads(backend: str) -> None:
    dtype = torch.float32
    src_bufs, dst_bufs = kv_buffers(dtype, seed=7), kv_buffers(dtype)
    src, dst = page_regions(dtype, [(1, 2, 1)])
    if backend == "mooncake":
        transfer._mooncake_engine_class()  # the import starts threads of Mooncake's own
    python_threads, threads_before = set(threading.enumerate()), settled_native_threads()

    prefill = make_transport(backend, src_bufs, HOST)
    decode = make_transport(backend, dst_bufs, HOST)
    stranger = make_transport(backend, kv_buffers(dtype), HOST)
    try:
        move(prefill, decode, 1, src, dst)
        waiting = [
            decode.expect(prefill.endpoint, 2, dst, 60),  # its group is up; no send comes
            decode.expect(stranger.endpoint, 3, dst, 60),  # that peer never connects
        ]
        start = time.monotonic()
        close_all([prefill, decode, stranger])
        for t in (prefill, decode, stranger):
            t.close()
        assert time.monotonic() - start < 10
    finally:
        close_all([prefill, decode, stranger])
    if backend == "torch":
        for future in waiting:
            with pytest.raises(TransferError, match="closed"):
                future.result(0)
    with pytest.raises(TransferError, match="closed"):
        prefill.send(decode.endpoint, 4, src, dst, TIMEOUT_S)
    with pytest.raises(TransferError, match="closed"):
        decode.expect(prefill.endpoint, 5, dst, TIMEOUT_S).result(0)

    assert [t for t in threading.enumerate() if t not in python_threads] == []
    deadline = time.monotonic() + 2  # a joined thread may take a moment to be gone
    while native_threads() > threads_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert native_threads() <= threads_before
