"""Device streams and events: lazy creation (checked on any machine) and the real
thing on an accelerator (GPU-marked)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tandem.futuremap import (
    DeviceEvent,
    DeviceStream,
    FutureMap,
    HostStream,
    create_event,
    create_stream,
    current_stream,
)


def test_device_objects_are_created_lazily_without_touching_the_device() -> None:
    # Constructing CUDA runtime objects on a CPU-only machine must not fail: nothing
    # is created until first use.
    stream = DeviceStream("cuda")
    event = DeviceEvent("cuda")
    assert stream._raw is None
    assert event.query()  # unrecorded: complete
    event.synchronize()
    event.wait(stream)  # unrecorded: no-op
    assert isinstance(create_event("cuda"), DeviceEvent)
    assert isinstance(create_stream("cuda:0"), DeviceStream)


def test_no_device_stream_for_the_cpu() -> None:
    with pytest.raises(ValueError, match="HostStream"):
        DeviceStream("cpu")


def test_create_stream_on_cpu_is_the_host_stream() -> None:
    s = create_stream("cpu")
    try:
        assert isinstance(s, HostStream)
    finally:
        s.close()


class _FakeDeviceModule:
    """Stands in for ``torch.cuda`` so the device path runs on a CPU machine."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.active: list[object] = []
        module = self

        class Stream:
            def __init__(self, device: object = None) -> None:
                module.log.append("Stream()")

            def synchronize(self) -> None:
                module.log.append("stream.synchronize")

        class Event:
            def __init__(self) -> None:
                module.log.append("Event()")

            def record(self, stream: object) -> None:
                module.log.append("event.record")

            def wait(self, stream: object) -> None:
                module.log.append("event.wait")

            def synchronize(self) -> None:
                module.log.append("event.synchronize")

            def query(self) -> bool:
                return True

        self.Stream = Stream
        self.Event = Event

    def stream(self, raw: object) -> object:
        module = self

        class _Ctx:
            def __enter__(self) -> None:
                module.active.append(raw)

            def __exit__(self, *exc: object) -> None:
                module.active.pop()

        return _Ctx()

    def current_stream(self, device: object = None) -> object:
        return "current"


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeDeviceModule:
    fake = _FakeDeviceModule()
    real = torch.get_device_module

    def get_device_module(device: object = None) -> object:
        return fake if torch.device(device).type == "cuda" else real(device)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "get_device_module", get_device_module)
    return fake


def test_device_path_goes_through_get_device_module(fake_cuda: _FakeDeviceModule) -> None:
    stream = DeviceStream("cuda")
    event = DeviceEvent("cuda")
    assert fake_cuda.log == []  # nothing created yet
    seen: list[object] = []
    work = stream.submit(lambda: seen.append(list(fake_cuda.active)) or "value")
    assert work.done()
    assert work.result() == "value"
    assert seen == [[stream.raw]]  # the callable ran under the stream's context
    event.record(stream)
    event.record(stream)
    assert fake_cuda.log.count("Event()") == 1  # created once, on first record
    other = DeviceStream("cuda")
    other.wait_event(event)
    event.synchronize()
    stream.synchronize()
    assert fake_cuda.log[-3:] == ["event.wait", "event.synchronize", "stream.synchronize"]
    assert current_stream("cuda").raw == "current"
    with pytest.raises(TypeError, match="device stream"):
        event.record(HostStream())


def test_importing_tandem_futuremap_touches_no_gpu_library() -> None:
    code = (
        "import sys, tandem.futuremap; "
        "bad = [m for m in ('flashinfer', 'triton') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
def test_device_stream_orders_work_and_events() -> None:
    stream = DeviceStream("cuda")
    x = torch.zeros(1 << 20, device="cuda")
    stream.submit(lambda: x.add_(1))
    event = stream.record_event()
    waiter = DeviceStream("cuda")
    waiter.wait_event(event)
    out = waiter.submit(lambda: x.sum()).result()
    waiter.synchronize()
    assert out.item() == float(1 << 20)
    assert event.query()


@pytest.mark.gpu
def test_future_map_on_the_forward_stream() -> None:
    stream = DeviceStream("cuda")
    fmap = FutureMap(num_rows=16, device="cuda", debug=True)
    rows = torch.tensor([3, 1, 7], device="cuda")

    def step() -> torch.Tensor:
        fmap.stash(rows, torch.tensor([30, 10, 70], device="cuda"))
        fmap.publish(rows, torch.tensor([4, 5, 6], device="cuda"))
        return torch.cat([fmap.resolve_tokens(rows), fmap.resolve_seq_lens(rows)])

    out = stream.submit(step).result()
    done = stream.record_event()
    done.synchronize()
    assert out.tolist() == [30, 10, 70, 4, 5, 6]
    assert fmap.publish_event is not None
    assert isinstance(current_stream("cuda"), DeviceStream)


@pytest.mark.gpu
def test_consume_once_fires_on_the_device() -> None:
    # A device-side assert poisons the CUDA context, so run it in a child process.
    code = (
        "import torch; from tandem.futuremap import FutureMap\n"
        "f = FutureMap(num_rows=4, device='cuda', debug=True)\n"
        "f.resolve_tokens(torch.tensor([2], device='cuda')); torch.cuda.synchronize()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
