"""tandem.scheduler: requests, batches, memory pools, the scheduling loop, the model
runner, models, attention backends, sampling and the offline ``Engine``.

Quick start:

```python
from tandem.scheduler import Engine

with Engine() as engine:  # the embedded default model
    out = engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
    print(out["text"])
```

Importing this package never imports FlashInfer: the ``flashinfer`` attention backend
is loaded only when chosen.
"""

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.engine import Engine
from tandem.scheduler.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]
