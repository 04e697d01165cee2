"""The typed environment: every variable parsed in one place, errors named, and
explicit arguments winning over it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem.futuremap import FutureMap, HostStream, TandemEnv, create_stream, read_env


def test_defaults() -> None:
    assert read_env({}) == TandemEnv()


def test_values_are_parsed() -> None:
    env = read_env(
        {
            "TANDEM_DEBUG_FUTURES": "yes",
            "TANDEM_COMPILE_CHECKS": "0",
            "TANDEM_HOST_STREAM_MAX_DELAY_MS": "2.5",
            "TANDEM_HOST_STREAM_SEED": "42",
        }
    )
    assert env == TandemEnv(True, "off", 0.0025, 42)


def test_cache_dir_is_a_path_and_empty_means_unset() -> None:
    assert read_env({"TANDEM_CACHE_DIR": "/srv/tandem"}).cache_dir == Path("/srv/tandem")
    assert read_env({"TANDEM_CACHE_DIR": "~/c"}).cache_dir == Path("~/c").expanduser()
    assert read_env({"TANDEM_CACHE_DIR": "  "}).cache_dir is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TANDEM_DEBUG_FUTURES", "maybe"),
        ("TANDEM_COMPILE_CHECKS", "sometimes"),
        ("TANDEM_HOST_STREAM_MAX_DELAY_MS", "-1"),
        ("TANDEM_HOST_STREAM_MAX_DELAY_MS", "fast"),
        ("TANDEM_HOST_STREAM_SEED", "x"),
    ],
)
def test_malformed_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        read_env({name: value})


def test_triton_interpret_is_read_as_triton_does() -> None:
    assert read_env({"TRITON_INTERPRET": "1"}).triton_interpret is True
    assert read_env({"TRITON_INTERPRET": "0"}).triton_interpret is False
    assert read_env({}).triton_interpret is False


def test_xdg_cache_home_is_a_path_and_empty_means_unset() -> None:
    assert read_env({"XDG_CACHE_HOME": "/var/c"}).xdg_cache_home == Path("/var/c")
    assert read_env({"XDG_CACHE_HOME": " "}).xdg_cache_home is None


def test_explicit_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """FutureMap and create_stream fall back to the environment only for what they are
    not given: with every value explicit, the variables are not even parsed."""
    for name in ("TANDEM_DEBUG_FUTURES", "TANDEM_COMPILE_CHECKS", "TANDEM_HOST_STREAM_SEED"):
        monkeypatch.setenv(name, "malformed")
    monkeypatch.setenv("TANDEM_HOST_STREAM_MAX_DELAY_MS", "malformed")
    fmap = FutureMap(2, "cpu", debug=True, compile_checks="off")
    assert fmap.debug
    assert fmap._checks is not None
    assert fmap._checks.mode == "off"
    assert not FutureMap(2, "cpu", debug=False).debug
    with create_stream("cpu", max_delay_s=0.0, seed=1) as stream:
        assert isinstance(stream, HostStream)
        assert stream._state.max_delay_s == 0.0


def test_no_module_reads_the_environment_but_env_py() -> None:
    """``tandem.futuremap.env`` is the one place that reads environment variables."""
    root = Path(__file__).resolve().parents[3] / "packages"
    allowed = root / "core-futuremap/src/tandem/futuremap/env.py"
    pattern = re.compile(r"\bos\.(environ|getenv|putenv|unsetenv)\b|from os import")
    sources = sorted(root.glob("*/src/tandem/**/*.py"))
    assert allowed in sources
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for path in sources
        if path != allowed
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
