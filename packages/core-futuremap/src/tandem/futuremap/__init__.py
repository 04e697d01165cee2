"""tandem.futuremap: the device runtime and the FutureMap, the bottom layer of tandem.

The scheduler runs one batch ahead of the device; the tokens batch N+1 needs travel
from batch N through the ``FutureMap``, on the device, in stream order. The
``tandem.futuremap.runtime`` gives every layer the same ``Stream`` and
``Event`` on CUDA/HIP and on the CPU (the host stream).
"""

from tandem.futuremap.env import TandemEnv, read_env
from tandem.futuremap.future_map import FutureMap
from tandem.futuremap.runtime import (
    DeviceEvent,
    DeviceStream,
    Event,
    HostEvent,
    HostStream,
    InlineStream,
    Stream,
    StreamError,
    Work,
    create_event,
    create_stream,
    current_stream,
)
from tandem.futuremap.schema import NEW_SEQ_LENS, OUTPUT_TOKENS, RelayField

__all__ = [
    "NEW_SEQ_LENS",
    "OUTPUT_TOKENS",
    "DeviceEvent",
    "DeviceStream",
    "Event",
    "FutureMap",
    "HostEvent",
    "HostStream",
    "InlineStream",
    "RelayField",
    "Stream",
    "StreamError",
    "TandemEnv",
    "Work",
    "create_event",
    "create_stream",
    "current_stream",
    "read_env",
]
