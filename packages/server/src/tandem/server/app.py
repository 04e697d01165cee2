"""The FastAPI application: the server's state, its start and stop, and the routes of
``tandem.server.routes`` behind the front door.

The API process owns the tokenizer, chat templates and the response shapes; the
scheduler process only ever sees token ids and sampling params.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from tandem.scheduler.engine.gc_freeze import freeze_long_lived
from tandem.scheduler.text.stop import StopLimits
from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server import openapi_schemas, prepare, tool_calls
from tandem.server.dp_client import DataParallelClient
from tandem.server.errors import install_handlers
from tandem.server.front_door import install_front_door
from tandem.server.lifecycle import Lifecycle
from tandem.server.metrics import Metrics
from tandem.server.parsing import Limits
from tandem.server.prepare import Preparer
from tandem.server.routes import admin, gateway, native, openai
from tandem.server.scheduler_client import SchedulerClient
from tandem.server.server_config import ServerConfig

log = logging.getLogger(__name__)

DEFAULT_SERVED_NAME = "default"  # the embedded default model's served name


@dataclass
class ServerState:
    client: SchedulerClient | DataParallelClient
    metrics: Metrics
    tokenizer: Tokenizer | None
    limits: Limits
    model_name: str
    config: ServerConfig
    lifecycle: Lifecycle
    preparer: Preparer
    tool_format: str = "llama3"  # tool_calls.FORMATS; see tool_format_of
    disaggregation_mode: str = "null"  # EngineConfig.disaggregation_mode
    gc_frozen_objects: int | None = None  # frozen once serving starts (``started``)

    @property
    def disaggregated(self) -> bool:
        """One half of a prefill/decode pair: every request carries bootstrap fields."""
        return self.disaggregation_mode != "null"


def tool_format_of(
    config: ServerConfig, tokenizer: Tokenizer | None, info: dict[str, Any]
) -> tuple[str, str]:
    """The tool-call format (``--tool-call-parser``, else the model's default) and why."""
    if config.tool_call_parser is not None:
        return config.tool_call_parser, "--tool-call-parser"
    template = tokenizer.chat_template if tokenizer is not None else None
    return tool_calls.default_format(template, info.get("architecture"))


def served_name(engine_kwargs: dict[str, Any], served_model_name: str | None) -> str:
    """The one model name of the server: ``--served-model-name``, else ``default`` for the
    embedded default model, else the ``--model-path`` value as given (SGLang's rule)."""
    return served_model_name or engine_kwargs.get("model_path") or DEFAULT_SERVED_NAME


def ready_line(app: FastAPI, url: str) -> str:
    """The one line ``tandem serve`` prints once it answers requests."""
    st: ServerState = app.state.tandem
    device = st.client.info["device"]
    return f'tandem is ready at {url} serving model "{st.model_name}" on {device}'


def started(app: FastAPI, url: str) -> str:
    """``tandem serve``'s API process has started: its long-lived heap is frozen
    (``tandem.scheduler.engine.gc_freeze``), and the ready line is returned."""
    st: ServerState = app.state.tandem
    st.gc_frozen_objects = freeze_long_lived()
    return ready_line(app, url)


async def _unless_stopped(start: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run ``start`` unless ``stop`` is set first (then it is cancelled): whether it ran."""
    task = asyncio.ensure_future(start)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()  # its error, if it failed
    return True


def check_disaggregation(engine_kwargs: dict[str, Any], config: ServerConfig) -> str:
    """The server's ``disaggregation_mode``; a ``ValueError`` naming ``dp_size`` when
    replicas are asked of a prefill or decode server."""
    mode = str(engine_kwargs.get("disaggregation_mode") or "null")
    if mode != "null" and config.dp_size > 1:
        # Each replica would need a bootstrap server of its own, while a gateway knows one
        # bootstrap port per prefill server.
        raise ValueError(
            f"dp_size={config.dp_size} cannot be combined with disaggregation_mode={mode}: "
            "a prefill or decode server runs one engine; start several servers and list "
            "each with the gateway instead"
        )
    return mode


def create_app(engine_kwargs: dict[str, Any], config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    mode = check_disaggregation(engine_kwargs, config)
    lifecycle = Lifecycle()
    client: SchedulerClient | DataParallelClient
    if config.dp_size > 1:
        client = DataParallelClient.launch(
            engine_kwargs, config.dp_size, config.watchdog_timeout, on_hung=lifecycle.give_up
        )
    else:
        client = SchedulerClient(
            engine_kwargs, watchdog_timeout_s=config.watchdog_timeout, on_hung=lifecycle.give_up
        )
    model_name = served_name(engine_kwargs, config.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(instance: FastAPI) -> AsyncIterator[None]:
        try:
            started = await _unless_stopped(client.start(), lifecycle.stop_starting)
        except BaseException:
            await client.close()
            raise
        if not started:  # Ctrl-C or SIGTERM while the engine loaded: stop, quietly
            await client.close()
            yield
            return
        info = client.info
        tokenizer = client.tokenizer
        metrics = Metrics(lambda: client.info, lambda: client.alive)
        client.finished_listeners.append(metrics.on_finished)
        limits = Limits(
            int(info["vocab_size"]),
            int(info["context_length"]),
            prepare.max_token_chars(tokenizer),
            StopLimits(int(info["max_stop_strings"]), int(info["max_stop_string_length"])),
        )
        preparer = Preparer(config.tokenizer_workers, config.prepare_queue_size)
        tool_format, why = tool_format_of(config, tokenizer, info)
        log.info("tool calls are parsed as %s (%s)", tool_format, why)
        instance.state.tandem = ServerState(
            client, metrics, tokenizer, limits, model_name, config, lifecycle, preparer,
            tool_format, mode,
        )  # fmt: skip
        try:
            yield
        finally:
            preparer.shutdown()
            await client.close()

    app = FastAPI(title="tandem", lifespan=lifespan)
    app.state.lifecycle = lifecycle
    install_handlers(app)

    def limits() -> Limits | None:
        st: ServerState | None = getattr(app.state, "tandem", None)
        return st.limits if st is not None else None

    openapi_schemas.document(app, limits, config.max_choices)
    install_front_door(app, config, lifecycle)
    bootstrap_required = mode != "null"  # by the routes' schemas
    app.include_router(admin.router(client, lifecycle, model_name))
    gateway.install(app, client, engine_kwargs, config.watchdog_timeout)
    app.include_router(openai.router(model_name, bootstrap_required))
    app.include_router(native.router(bootstrap_required))
    return app
