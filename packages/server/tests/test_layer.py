"""The server layer installs in the shared namespace next to the three others."""

from __future__ import annotations


def test_all_four_layers_import_side_by_side() -> None:
    import tandem
    import tandem.futuremap
    import tandem.scheduler
    import tandem.server
    import tandem.spec_eagle

    assert tandem.server.__doc__
    assert tandem.server.LAYER == "server"
    assert getattr(tandem, "__file__", None) is None  # a PEP 420 namespace
    assert len(list(tandem.__path__)) >= 1
