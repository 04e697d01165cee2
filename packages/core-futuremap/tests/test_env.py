"""The typed environment: every TANDEM_ variable parsed in one place, errors named."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.futuremap import TandemEnv, read_env


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
