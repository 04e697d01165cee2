"""``tandem serve`` flags come from ``EngineConfig``: an option whose default is read
from the environment is passed on only when its flag is given."""

from __future__ import annotations

import pytest

from tandem.server.cli import build_parser, engine_kwargs

SWITCHES = ("debug_futures", "compile_checks", "host_stream_max_delay_ms", "host_stream_seed")


def _kwargs(*flags: str) -> dict[str, object]:
    return engine_kwargs(build_parser().parse_args(["serve", *flags]))


def test_environment_backed_options_are_left_to_the_environment() -> None:
    kwargs = _kwargs()
    assert not set(SWITCHES) & set(kwargs)
    assert kwargs["max_running_requests"] == 64  # an ordinary default is passed on


def test_environment_backed_options_as_flags() -> None:
    kwargs = _kwargs(
        "--debug-futures", "--compile-checks", "off",
        "--host-stream-max-delay-ms", "2.5", "--host-stream-seed", "3",
    )  # fmt: skip
    assert {name: kwargs[name] for name in SWITCHES} == {
        "debug_futures": True,
        "compile_checks": "off",
        "host_stream_max_delay_ms": 2.5,
        "host_stream_seed": 3,
    }
    assert _kwargs("--no-debug-futures")["debug_futures"] is False


def test_a_bad_choice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _kwargs("--compile-checks", "sometimes")
    assert "--compile-checks" in capsys.readouterr().err
