"""A serving process's long-lived heap, out of reach of the garbage collector's full passes.

CPython's cyclic collector runs a full (generation 2) pass now and then, at whichever
allocation crosses its threshold, and the pass walks every tracked object the process
holds: in a serving process that is mostly what start-up made (torch, the model's
modules, the tokenizer, FastAPI's routes and schemas), which never becomes garbage. The
pass stops the thread that triggered it, and, since it holds the GIL, every other thread
that runs Python. Serving the ~100M benchmark model on a 2-core CPU (32 and 64
concurrent streams), a full pass took 216-252 ms in the API process, where it held back
every stream's next chunk and took CPU from the forward, and about 100 ms in the
scheduler process. They are rare (one in the API process in two minutes of that load),
so they show in the tail of the latencies, not in the throughput.

``freeze_long_lived`` is called once by each process the server starts (the API
process, the scheduler process, each tensor-parallel rank), when its start-up is over:
one full collection, then ``gc.freeze()``, which moves every object left into a
permanent generation that later passes skip. Objects made after it are collected as
before, and the full passes over them took under 8 ms under the same load. The price: a
cycle of frozen objects that becomes garbage later is never collected. SGLang freezes
its server processes the same way after start-up.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> int:
    """Collect once, then freeze every object the process holds (see the module's
    docstring). Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
