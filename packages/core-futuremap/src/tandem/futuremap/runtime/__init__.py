"""Device runtime: one ``Stream``/``Event`` abstraction over CUDA/HIP and the CPU host
stream. See the "Device runtime" section of the FutureMap concepts page
(docs/concepts/futuremap.md)."""

from __future__ import annotations

import torch

from tandem.futuremap.env import read_env
from tandem.futuremap.runtime.base import Event, Stream, StreamError, Work
from tandem.futuremap.runtime.device_stream import DeviceEvent, DeviceStream, device_module
from tandem.futuremap.runtime.host_stream import (
    HostEvent,
    HostStream,
    InlineStream,
    current_host_stream,
)

__all__ = [
    "DeviceEvent",
    "DeviceStream",
    "Event",
    "HostEvent",
    "HostStream",
    "InlineStream",
    "Stream",
    "StreamError",
    "Work",
    "create_event",
    "create_stream",
    "current_stream",
]


def create_stream(
    device: torch.device | str,
    *,
    name: str = "tandem-forward",
    max_delay_s: float | None = None,
    seed: int | None = None,
) -> Stream:
    """A new stream for ``device``: a ``HostStream`` on the CPU, a
    ``DeviceStream`` elsewhere.

    ``max_delay_s`` and ``seed`` apply to the host stream only; when omitted they come
    from ``TANDEM_HOST_STREAM_MAX_DELAY_MS`` / ``TANDEM_HOST_STREAM_SEED``
    (``read_env``). An engine passes its ``host_stream_*`` options.
    """
    dev = torch.device(device)
    if dev.type != "cpu":
        return DeviceStream(dev)
    if max_delay_s is None or seed is None:
        env = read_env()
        max_delay_s = env.host_stream_max_delay_s if max_delay_s is None else max_delay_s
        seed = env.host_stream_seed if seed is None else seed
    return HostStream(name, max_delay_s=max_delay_s, seed=seed)


def current_stream(device: torch.device | str) -> Stream:
    """The stream the calling code runs on: the device's current stream, or on the CPU
    the host stream whose worker is calling (an ``InlineStream`` otherwise)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return current_host_stream()
    return DeviceStream(dev, raw=device_module(dev).current_stream(dev))


def create_event(device: torch.device | str) -> Event:
    """A fresh unrecorded event for streams of ``device``."""
    dev = torch.device(device)
    return HostEvent() if dev.type == "cpu" else DeviceEvent(dev)
