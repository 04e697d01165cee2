"""The ``tandem`` command: ``tandem serve`` and ``tandem generate``.

``serve`` exposes every ``EngineConfig`` field as a ``--kebab-case`` flag, generated
from the dataclass, with its help taken from the dataclass docstring, so a new engine
option is a server flag the day it lands and the two can never disagree. A field whose
default comes from the environment is passed on only when its flag is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import socket
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

import uvicorn

from tandem.scheduler import config as engine_config
from tandem.scheduler.config import EngineConfig
from tandem.server import sglang_flags
from tandem.server.server_config import ServerConfig, default_api_key

_CHOICES = {
    "dtype": engine_config.DTYPES,
    "load_format": engine_config.LOAD_FORMATS,
    "quantization": engine_config.QUANTIZATIONS,
    "schedule_policy": engine_config.SCHEDULE_POLICIES,
    "compile_checks": engine_config.COMPILE_CHECKS,
    "disaggregation_mode": engine_config.DISAGGREGATION_MODES,
    "disaggregation_transfer_backend": engine_config.TRANSFER_BACKENDS,
    "grammar_backend": engine_config.GRAMMAR_BACKENDS,
}


def _field_docs(cls: type = EngineConfig) -> dict[str, str]:
    """``name: text`` entries of ``cls``'s docstring's Attributes section."""
    doc = cls.__doc__ or ""
    docs: dict[str, str] = {}
    current = None
    for line in doc.split("Attributes:", 1)[-1].splitlines():
        match = re.match(r"^\s{8}(\w+): (.*)$", line)
        if match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current and line.strip():
            docs[current] += " " + line.strip()
    return {k: v.replace("``", "") for k, v in docs.items()}


def _base_type(hint: Any) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]  # type: ignore[no-any-return]
    return hint  # type: ignore[no-any-return]


# Engine options with no meaning behind the server: its API process tokenizes and
# detokenizes, and the scheduler process checks stop strings with its own tokenizer.
OFFLINE_ONLY = frozenset({"skip_tokenizer_init"})
# Other names a flag answers to: SGLang's short ones, and vLLM's where they differ.
ALIASES = {"tokenizer_path": ("--tokenizer",), **sglang_flags.ALIASES}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field."""
    hints = typing.get_type_hints(EngineConfig)
    docs = _field_docs()
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if f.name in OFFLINE_ONLY:
            continue
        flags = ("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ()))
        base = _base_type(hints[f.name])
        help_text = docs.get(f.name, f.name).replace("%", "%%")
        from_env = f.metadata.get("from_env", False)  # left out unless given
        if base is bool:
            if from_env:
                group.add_argument(
                    *flags, dest=f.name, action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS, help=help_text,
                )  # fmt: skip
            else:
                group.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
            continue
        if not from_env:
            help_text += f" (default: {f.default})"
        group.add_argument(
            *flags, dest=f.name, type=base, metavar=f.name.upper(),
            default=argparse.SUPPRESS if from_env else f.default,
            choices=_CHOICES.get(f.name), help=help_text,
        )  # fmt: skip


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ServerConfig`` field (help from its docstring)."""
    docs = _field_docs(ServerConfig)
    hints = typing.get_type_hints(ServerConfig)
    group = parser.add_argument_group("server options")
    for f in dataclasses.fields(ServerConfig):
        flags = ("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ()))
        help_text = docs.get(f.name, f.name).replace("%", "%%")
        hint = hints[f.name]
        if hint is bool:
            group.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
        elif typing.get_origin(hint) is tuple:
            group.add_argument(
                *flags, dest=f.name, nargs="*", default=list(f.default), metavar="VALUE",
                help=help_text,
            )  # fmt: skip
        else:
            default = default_api_key() if f.name == "api_key" else f.default
            if f.name != "api_key" and default is not None:
                help_text += f" (default: {default})"
            group.add_argument(
                *flags, dest=f.name, type=_base_type(hint), default=default,
                metavar=f.name.upper(), help=help_text,
            )  # fmt: skip


def server_config(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}
    for name in ("allowed_origins", "allowed_hosts"):
        values[name] = tuple(values[name])
    return ServerConfig(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench}")
    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve a model over the OpenAI-compatible HTTP API.",
    )
    add_server_flags(serve)
    serve.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error")
    )
    add_engine_flags(serve)
    sglang_flags.add_foreign_flags(serve)
    sub.add_parser(
        "generate",
        help="one-off offline generation (see `tandem generate --help`)",
        add_help=False,
    )
    from tandem.server.bench import offline as bench

    bench.build_parser(
        sub.add_parser(
            "bench",
            help="offline, in-process benchmark (`tandem bench serve`: against a live server)",
            description="Offline, in-process benchmark of the engine. "
            "`tandem bench serve --help`: the load generator against a live server; "
            "`tandem bench perplexity --help`: a model's perplexity over a text file.",
        )
    )
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in OFFLINE_ONLY and hasattr(args, f.name)
    }


def _check(parser: argparse.ArgumentParser, kwargs: dict[str, Any]) -> None:
    """Exit (status 2) with a message naming the flag of an invalid value."""
    try:
        EngineConfig.from_options(kwargs).validate()
    except (ValueError, TypeError) as exc:
        message = str(exc)
        name = next((n for n in kwargs if re.match(rf"^{n}\b", message)), None)
        flag = "--" + name.replace("_", "-") if name else "an option"
        parser.error(f"argument {flag}: {message}")


def resolve_models(parser: argparse.ArgumentParser, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``model_path`` and ``tokenizer_path`` as the local folders they
    name (``tandem.scheduler.models.source``: the default model, ``tandem-tiny``, a
    folder, a GGUF file, a Hugging Face id), fetched or downloaded here, once, before
    any engine process starts. A path that resolves to nothing exits (status 2) with a
    message naming the flag; a default model that cannot be fetched, with its error."""
    from tandem.scheduler.models.fetch import FetchError
    from tandem.scheduler.models.source import resolve_model, resolve_tokenizer

    try:
        model = resolve_model(kwargs.get("model_path"))
    except FetchError as exc:  # the default model: no flag to blame
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    except (ValueError, OSError) as exc:
        parser.error(f"argument --model-path: {exc}")
    tokenizer = None
    if kwargs.get("tokenizer_path"):
        try:
            tokenizer = str(resolve_tokenizer(kwargs["tokenizer_path"], model))
        except (ValueError, OSError) as exc:
            parser.error(f"argument --tokenizer-path: {exc}")
    return {**kwargs, "model_path": str(model), "tokenizer_path": tokenizer}


def check_port(host: str, port: int) -> None:
    """An OSError when ``host:port`` cannot be listened on (in use, or no such
    address), found before the model loads rather than after. The probe socket sets
    ``SO_REUSEADDR`` as uvicorn's does, so a port in TIME_WAIT still passes."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host.strip("[]"), port))


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tandem.server.app import check_disaggregation, create_app, served_name, started
    from tandem.server.http_server import CLOSE_GRACE_S, TandemServer

    kwargs = engine_kwargs(args)
    _check(parser, kwargs)
    config = server_config(args)
    if config.api_key == "":
        parser.error(
            "argument --api-key: the API key is empty (TANDEM_API_KEY set to nothing?): "
            "give a key, or unset TANDEM_API_KEY to serve without one"
        )
    try:
        config.validate()
    except ValueError as exc:
        name = str(exc).split(":", 1)[0].split(" ", 1)[0]
        parser.error(f"argument --{name.replace('_', '-')}: {exc}")
    try:
        check_disaggregation(kwargs, config)
    except ValueError as exc:
        parser.error(f"argument --dp-size: {exc}")
    # The name clients see is the model as given (SGLang's rule), not the folder it
    # resolves to.
    config = dataclasses.replace(
        config, served_model_name=served_name(kwargs, config.served_model_name)
    )
    try:
        check_port(config.host, config.port)
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
        parser.error(f"argument --port: cannot listen on {config.host}:{config.port}: {why}")
    for note in args.sglang_notes:
        print(f"tandem: {note}", file=sys.stderr)
    print(
        "tandem: API key " + ("on: every endpoint but /health needs it" if config.api_key else
                              "off: any client that reaches the port may call the API"),
        file=sys.stderr,
    )  # fmt: skip
    kwargs = resolve_models(parser, kwargs)
    engine_config = EngineConfig.from_options(kwargs)
    if engine_config.tp_size > 1:
        from tandem.scheduler.parallel.distributed import check_ranks, start_node

        try:
            check_ranks(engine_config)
        except ValueError as exc:
            parser.error(f"argument --tp-size: {exc}")
        if engine_config.node_rank > 0:  # this machine runs ranks only; node 0 serves
            return start_node(engine_config)
    app = create_app(kwargs, config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=CLOSE_GRACE_S,
        access_log=False,
    )
    server = TandemServer(
        uv_config,
        lambda url: started(app, url),
        app.state.lifecycle,
        lambda: app.state.tandem.client if hasattr(app.state, "tandem") else None,
        config.graceful_shutdown_timeout,
    )
    try:
        server.run()
    except KeyboardInterrupt:
        # A signal before uvicorn takes SIGINT over reaches here as KeyboardInterrupt
        # (from asyncio's runner): the start is abandoned, reported as any Ctrl-C is.
        if not server.started:
            raise
    return app.state.lifecycle.exit_code if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tandem`` command. Ctrl-C in any mode ends it with status 130 and one line,
    never a traceback (``tandem serve`` handles its signals itself and drains)."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv[:2] == ["bench", "serve"]:
        from tandem.server.bench import serve as bench_serve

        return bench_serve.main(argv[2:])
    if argv[:2] == ["bench", "perplexity"]:
        from tandem.server.bench import perplexity

        return perplexity.main(argv[2:])
    if argv and argv[0] == "generate":
        from tandem.scheduler.engine import cli as offline

        return offline.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        from tandem.server.bench import offline as bench

        bench_parser = parser._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
        return bench.run(args, bench_parser, argv[1:])
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return serve(args, serve_parser)


if __name__ == "__main__":
    sys.exit(main())
