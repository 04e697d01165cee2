"""The debug switches are ``EngineConfig`` fields: their defaults come from the
environment, an option given to the ``Engine`` wins, and the engine's parts get the
config's value, never the environment's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.futuremap import HostStream
from tandem.scheduler import Engine, EngineConfig
from tandem.scheduler.attention.torch_backend import TorchAttention

SWITCHES = ("debug_futures", "compile_checks", "host_stream_max_delay_ms", "host_stream_seed")


def _switches(config: EngineConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in SWITCHES}


def test_defaults_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SWITCHES:
        monkeypatch.delenv(f"TANDEM_{name.upper()}", raising=False)
    assert _switches(EngineConfig()) == {
        "debug_futures": False,
        "compile_checks": "auto",
        "host_stream_max_delay_ms": 0.0,
        "host_stream_seed": None,
    }
    monkeypatch.setenv("TANDEM_DEBUG_FUTURES", "1")
    monkeypatch.setenv("TANDEM_COMPILE_CHECKS", "off")
    monkeypatch.setenv("TANDEM_HOST_STREAM_MAX_DELAY_MS", "2.5")
    monkeypatch.setenv("TANDEM_HOST_STREAM_SEED", "7")
    assert _switches(EngineConfig()) == {
        "debug_futures": True,
        "compile_checks": "off",
        "host_stream_max_delay_ms": 2.5,
        "host_stream_seed": 7,
    }


def test_an_option_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_DEBUG_FUTURES", "1")
    monkeypatch.setenv("TANDEM_COMPILE_CHECKS", "on")
    monkeypatch.setenv("TANDEM_HOST_STREAM_MAX_DELAY_MS", "3")
    monkeypatch.setenv("TANDEM_HOST_STREAM_SEED", "7")
    options = {
        "debug_futures": False,
        "compile_checks": "off",
        "host_stream_max_delay_ms": 0,
        "host_stream_seed": None,
    }
    assert _switches(EngineConfig.from_options(options)) == options


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("debug_futures", "yes"),
        ("compile_checks", "sometimes"),
        ("host_stream_max_delay_ms", -1),
        ("host_stream_seed", 1.5),
    ],
)
def test_invalid_switches_name_the_option(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_options({name: value})


@pytest.mark.parametrize("debug", [False, True])
def test_the_engine_uses_its_config_not_the_environment(
    debug: bool, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One switch turns every debug invariant on or off, whatever the environment says;
    the host stream's delays follow the config too."""
    monkeypatch.setenv("TANDEM_DEBUG_FUTURES", "0" if debug else "1")
    monkeypatch.setenv("TANDEM_HOST_STREAM_MAX_DELAY_MS", "50")
    options = {"debug_futures": debug, "host_stream_max_delay_ms": 0.5, "host_stream_seed": 3}
    with Engine(
        model_path=str(checkpoints["llama"]), dtype="float32", device="cpu", **options
    ) as engine:
        runner = engine.scheduler.runner
        assert runner.future_map.debug is debug
        assert isinstance(runner.attention, TorchAttention)
        assert runner.attention.check_stage is debug
        assert engine.scheduler.strict_accounting is debug
        assert isinstance(runner.stream, HostStream)
        assert runner.stream._state.max_delay_s == pytest.approx(0.0005)
        info = engine.get_server_info()
        assert {name: info[name] for name in options} == options
        out = engine.generate(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 3})
        assert len(out["output_ids"]) == 3
