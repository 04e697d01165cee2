"""A serving process's long-lived heap, out of reach of the garbage collector's full passes.

CPython's full (generation 2) collection walks every tracked object and, holding the GIL,
stops every thread that runs Python. In a server most of them are what start-up made (torch,
the model, FastAPI's routes), never garbage, and a pass holds back every stream's next chunk:
rare, it shows in the latencies' tail. Each process the server starts calls
``freeze_long_lived`` after start-up: one full collection, then ``gc.freeze()``, so later
passes skip what is left; a frozen cycle that becomes garbage is never collected. SGLang does
the same. (measurements: docs/benchmarks.md, Measurements behind the code)
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> int:
    """Collect once, then freeze every object the process holds (see the module's
    docstring). Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
