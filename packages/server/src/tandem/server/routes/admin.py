"""The routes that watch the server rather than generate: ``/health``,
``/health_generate``, ``/server_info`` (``/get_server_info``) and ``/metrics``.

``/health`` and ``/server_info`` answer while the engine is still starting, before the
server's state exists; the others need it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tandem.server import openapi_schemas, parsing
from tandem.server.errors import APIError, error_body
from tandem.server.front_door import authenticated, public_info
from tandem.server.generation import collect
from tandem.server.routes import gateway
from tandem.server.routes.common import server_state

if TYPE_CHECKING:
    from tandem.server.app import ServerState
    from tandem.server.dp_client import DataParallelClient
    from tandem.server.lifecycle import Lifecycle
    from tandem.server.scheduler_client import SchedulerClient


def _started(request: Request) -> ServerState | None:
    """The server's state, or None while the engine is still starting."""
    return getattr(request.app.state, "tandem", None)


def router(
    client: SchedulerClient | DataParallelClient, lifecycle: Lifecycle, model_name: str
) -> APIRouter:
    """The routes, over the ``client`` and ``lifecycle`` that exist before the state."""
    routes = APIRouter()

    @routes.get("/health", openapi_extra=openapi_schemas.HEALTH)
    async def health(request: Request) -> Response:
        """200 while the scheduler answers and the server takes requests; else 503
        (draining, hung or dead), so a load balancer stops sending."""
        if _started(request) is None or not client.alive or not lifecycle.accepting:
            reason = (
                "the server is shutting down" if lifecycle.draining
                else f"the scheduler is not responding ({lifecycle.hung})" if lifecycle.hung
                else "the scheduler is not running"
            )  # fmt: skip
            return JSONResponse(error_body(reason, 503), 503)
        return JSONResponse({"status": "ok"})

    @routes.get("/health_generate", openapi_extra=openapi_schemas.UNAVAILABLE)
    async def health_generate(request: Request) -> Response:
        """SGLang's deeper check: a one-token generation through the whole path. A prefill
        or decode server cannot generate alone (half a request needs its peer): there it
        answers as ``/health`` does."""
        st = server_state(request)
        if st.disaggregated:
            return await health(request)
        jobs = parsing.expand(
            [[0]], {"max_new_tokens": 1, "temperature": 0}, 1, st.limits, False, 0
        )
        try:
            await asyncio.wait_for(
                collect(st.client, st.metrics, jobs, request), st.config.watchdog_timeout
            )
        except TimeoutError:
            return JSONResponse(error_body("a one-token generation timed out", 503), 503)
        except APIError as exc:
            return JSONResponse(error_body(exc.message, 503), 503)
        return JSONResponse({"status": "ok"})

    @routes.get("/server_info")  # SGLang's newer name, which smg asks for first
    @routes.get("/get_server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        info = {
            **client.info, "served_model_name": model_name, "version": gateway.version(),
            "scheduler_alive": client.alive,
        }  # fmt: skip
        st = _started(request)
        if st is not None:
            info["tool_call_parser"] = st.tool_format
            info["api_gc_frozen_objects"] = st.gc_frozen_objects
        return info if authenticated(request) else public_info(info)

    @routes.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(
            server_state(request).metrics.render(), media_type="text/plain; version=0.0.4"
        )

    return routes
