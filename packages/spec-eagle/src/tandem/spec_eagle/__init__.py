"""tandem.spec_eagle: EAGLE speculative decoding that keeps the overlap (draft ->
verify -> publish -> draft-extend -> stash), chain or tree, one or several draft
layers, EAGLE and EAGLE-3 heads in their public checkpoint formats.

It plugs into the scheduler through its speculative-worker interface
(``tandem.scheduler.speculative.interface``) under the entry-point names ``EAGLE`` and
``EAGLE3``; the scheduler never imports this package. Turn it on with the ``Engine``
options ``speculative_algorithm`` and ``speculative_draft_model_path`` (a head's
folder); docs/guides/speculative-decoding.md has a quick start.
"""

from tandem.scheduler.speculative.interface import register_speculative_algorithm
from tandem.spec_eagle.draft_config import DraftConfig, default_aux_layers
from tandem.spec_eagle.draft_model import EagleDraftModel, load_draft_model
from tandem.spec_eagle.random_head import write_random_head
from tandem.spec_eagle.worker import EagleWorker, create_worker

LAYER = "spec_eagle"

__all__ = [
    "LAYER",
    "DraftConfig",
    "EagleDraftModel",
    "EagleWorker",
    "create_worker",
    "default_aux_layers",
    "load_draft_model",
    "write_random_head",
]

# Explicit registration as well as the entry points: an environment that puts the
# sources on PYTHONPATH instead of installing them (the GPU sessions) has no entry
# points, but importing this package is then enough.
for _name in ("EAGLE", "EAGLE3"):
    register_speculative_algorithm(_name, create_worker)
