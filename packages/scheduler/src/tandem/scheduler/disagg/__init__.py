"""Prefill/decode disaggregation: a prefill server computes a prompt's KV and first
token, a decode server takes the request prebuilt and decodes it.

``bootstrap`` is the control channel (the prefill server's bootstrap server, the decode
server's connections to it), ``transfer`` the KV transports behind one interface
(Mooncake's transfer engine, torch.distributed point-to-point), ``prefill`` and
``decode`` what each mode adds to the scheduler. docs/guides/disaggregation.md walks
through the hand-over.
"""

from tandem.scheduler.disagg.protocol import Bootstrap

__all__ = ["Bootstrap"]
