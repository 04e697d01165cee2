"""Freezing a serving process's long-lived heap (``gc_freeze``): a full collection first,
then every object left is out of reach of later passes, while what is made afterwards
is collected as before."""

from __future__ import annotations

import gc
import weakref

from tandem.scheduler.engine.gc_freeze import freeze_long_lived


class _Node:
    """A cycle of one: only the cyclic collector can free it."""

    def __init__(self) -> None:
        self.me = self


def test_a_freeze_collects_first_then_skips_what_it_froze() -> None:
    gc.unfreeze()
    garbage = _Node()
    dropped_before = weakref.ref(garbage)
    del garbage
    kept = _Node()
    kept_at_freeze = weakref.ref(kept)
    try:
        frozen = freeze_long_lived()
        assert frozen == gc.get_freeze_count() > 0
        assert dropped_before() is None, "the freeze's collection freed existing garbage"
        del kept  # garbage now, but frozen: later passes do not visit it
        made_after = _Node()
        dropped_after = weakref.ref(made_after)
        del made_after
        gc.collect()
        assert dropped_after() is None, "objects made after the freeze are collected"
        assert kept_at_freeze() is not None, "a frozen cycle is never collected"
    finally:
        gc.unfreeze()
    gc.collect()
    assert kept_at_freeze() is None
