"""Streams and events of an accelerator (CUDA, ROCm/HIP, or any torch device module).

Everything goes through ``torch.get_device_module(device)``: HIP builds of torch expose
themselves as ``cuda``, and nothing here names ``torch.cuda.Event`` directly. Driver
objects are created lazily, so constructing a runtime object never touches the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tandem.futuremap.runtime.base import Event, Stream, Work

T = TypeVar("T")


def device_module(device: torch.device) -> Any:
    """The torch module of ``device``'s type (``torch.cuda`` for CUDA and HIP)."""
    return torch.get_device_module(device)


class DeviceStream(Stream):
    """A device stream. ``submit`` runs the callable now, under this stream's context,
    so the kernels it launches are queued on this stream; the host does not wait.

    Args:
        device: the accelerator, e.g. ``"cuda"`` or ``"cuda:1"``.
        raw: an existing torch stream to wrap (default: a new one, created lazily).
    """

    def __init__(self, device: torch.device | str, raw: Any | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cpu":
            raise ValueError("the CPU has no device streams; use HostStream")
        self._module = device_module(self.device)
        self._raw = raw

    @property
    def raw(self) -> Any:
        """The torch stream, created on first use."""
        if self._raw is None:
            self._raw = self._module.Stream(device=self.device)
        return self._raw

    def submit(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> Work[T]:
        with self._module.stream(self.raw):
            return Work.completed(fn(*args, **kwargs))

    def new_event(self) -> DeviceEvent:
        return DeviceEvent(self.device)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def __repr__(self) -> str:
        return f"DeviceStream(device={self.device}, raw={self._raw!r})"


class DeviceEvent(Event):
    """A device event, created on its first record (unrecorded: complete, as in CUDA)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._module = device_module(self.device)
        self._raw: Any | None = None

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, DeviceStream):
            raise TypeError(
                f"a DeviceEvent records on a device stream, not {type(stream).__name__}"
            )
        if self._raw is None:
            self._raw = self._module.Event()
        self._raw.record(stream.raw)

    def wait(self, stream: Stream) -> None:
        if self._raw is None:
            return
        if isinstance(stream, DeviceStream):
            self._raw.wait(stream.raw)
        else:
            stream.submit(self.synchronize)

    def synchronize(self) -> None:
        if self._raw is not None:
            self._raw.synchronize()

    def query(self) -> bool:
        return self._raw is None or bool(self._raw.query())
