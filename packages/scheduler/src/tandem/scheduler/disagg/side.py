"""Turn a scheduler into one half of a disaggregated pair."""

from __future__ import annotations

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.disagg import layout
from tandem.scheduler.disagg.bootstrap import Inbox
from tandem.scheduler.disagg.decode_side import DecodeSide
from tandem.scheduler.disagg.prefill_side import PrefillSide
from tandem.scheduler.disagg.transfer import make_transport
from tandem.scheduler.schedule.scheduler import Scheduler


def disaggregate(config: EngineConfig, scheduler: Scheduler) -> PrefillSide | DecodeSide:
    """The ``disaggregation_mode`` side of ``scheduler``, with its transfer engine (its
    KV pool registered) and its control channel; its events wake nobody until the
    engine's loop sets ``inbox.wake``."""
    pool = scheduler.kv_pool
    transport = make_transport(
        config.disaggregation_transfer_backend, layout.buffers(pool), config.disaggregation_host
    )
    inbox = Inbox(lambda: None)
    side: PrefillSide | DecodeSide
    try:
        if config.disaggregation_mode == "prefill":
            side = PrefillSide(config, pool, transport, scheduler.release, inbox)
        else:
            side = DecodeSide(
                config, scheduler.stages, scheduler.resources, scheduler.release,
                scheduler.counters, transport, inbox,
                decoding_pages=lambda: len(scheduler.decode.decodable()),
            )  # fmt: skip
    except BaseException:
        transport.close()
        raise
    scheduler.disaggregate(side)
    return side
