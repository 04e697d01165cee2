"""tandem.scheduler: requests, batches, memory pools, the radix cache, the normal and
overlap loops, the model runner, models, attention backends, sampling and the offline
``Engine``.

This layer is being built (see the Engine issues); for now it only proves that it
installs on top of ``tandem.futuremap`` in the shared ``tandem`` namespace.
"""

LAYER = "scheduler"
