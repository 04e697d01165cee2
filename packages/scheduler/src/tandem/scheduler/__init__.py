"""tandem.scheduler: requests, batches, memory pools, the scheduling loop, the model
runner, models, attention backends, sampling and the offline ``Engine``.

``Engine`` is the entry point: ``Engine().generate("Hello", {"max_new_tokens": 16})``
runs the embedded default model (docs/guides/offline-engine.md). Importing this
package never imports FlashInfer: the ``flashinfer`` attention backend is loaded only
when chosen.
"""

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.engine.engine import Engine
from tandem.scheduler.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]
