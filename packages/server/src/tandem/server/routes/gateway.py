"""What a gateway in front of several ``tandem serve`` replicas reads, in SGLang's shapes.

The SGLang Model Gateway (``smg``) takes a worker for SGLang when ``/server_info``
answers (``/get_server_info`` is its older name), reads ``/model_info`` (or
``/get_model_info``) for the model's facts, polls ``/v1/loads`` for its load-aware
policies and sends ``POST /flush_cache`` to every worker when asked to flush. This
module adds all of them but ``/server_info``, which ``admin`` serves beside
``/get_server_info``; docs/guides/scaling-out.md lists every call ``smg`` makes.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from tandem.server import openapi_schemas
from tandem.server.errors import error_body
from tandem.server.front_door import authenticated, public_info
from tandem.server.scheduler_client import SchedulerUnavailable

_SECTION = "(core|memory|spec|lora|disagg|queues|all)"
INCLUDE_PATTERN = rf"^\s*{_SECTION}\s*(,\s*{_SECTION}\s*)*$"
"""``/v1/loads?include=``: SGLang's section names, comma-separated. Only ``core`` has
figures here; the other sections are left out, as SGLang leaves out those it lacks."""

_RATE_WINDOW_S = 1.0


class _Client(Protocol):
    """What these routes use of the app's scheduler client."""

    @property
    def info(self) -> dict[str, Any]: ...

    async def flush_cache(self) -> bool: ...


@functools.cache
def version() -> str:
    """The ``tandem-server`` version, SGLang's ``version`` field."""
    try:
        return importlib.metadata.version("tandem-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def _model_type(model_path: str) -> str | None:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("model_type") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def model_info(info: dict[str, Any], engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """SGLang's ``/get_model_info``: the checkpoint the engine loaded and what it is."""
    path = info.get("model_path")
    architecture = info.get("architecture")
    return {
        "model_path": path,
        "tokenizer_path": engine_kwargs.get("tokenizer_path") or path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": _model_type(str(path)) if path else None,
        "architectures": [architecture] if architecture else None,
    }


class LoadReport:
    """SGLang's ``/v1/loads`` from the engine's latest figures: one entry per data
    parallel rank (the replicas of ``--dp-size``, else the one engine).

    ``gen_throughput`` (generated tokens per second) and ``utilization`` (the fraction
    of time the device ran batches) are rates over the time since the report before,
    measured once that is at least a second, so they are 0 in the first report.
    """

    def __init__(self) -> None:
        self._marks: dict[int, tuple[float, float, float]] = {}
        self._rates: dict[int, tuple[float, float]] = {}

    def render(self, info: dict[str, Any], dp_rank: int | None = None) -> dict[str, Any]:
        ranks = info.get("replicas") or ([info] if info else [])
        now = time.monotonic()
        loads = [
            self._rank(i, rank_info, now)
            for i, rank_info in enumerate(ranks)
            if dp_rank is None or i == dp_rank
        ]
        return {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": version(),
            "dp_rank_count": len(loads),
            "loads": loads,
            "aggregate": _aggregate(loads),
        }

    def _rank(self, rank: int, info: dict[str, Any], now: float) -> dict[str, Any]:
        capacity = int(info.get("max_total_tokens") or 0)
        free = int(info.get("available_kv_tokens") or 0)
        used = max(capacity - free - int(info.get("cached_kv_tokens") or 0), 0)
        running = int(info.get("num_running_requests") or 0)
        waiting = int(info.get("num_waiting_requests") or 0)
        prompt = int(info.get("prompt_tokens") or 0)
        tokens = float(info.get("generated_tokens") or 0)
        throughput, busy = self._rate(rank, now, tokens, float(info.get("device_busy_s") or 0))
        return {
            "dp_rank": rank,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            "num_used_tokens": used,
            "max_total_num_tokens": capacity,
            "token_usage": round(used / capacity, 4) if capacity else 0.0,
            "gen_throughput": round(throughput, 2),
            "cache_hit_rate": round(int(info.get("cached_tokens") or 0) / prompt, 4)
            if prompt
            else 0.0,
            "utilization": round(min(max(busy, 0.0), 1.0), 4),
            "max_running_requests": int(info.get("max_running_requests") or 0),
        }

    def _rate(self, rank: int, now: float, tokens: float, busy_s: float) -> tuple[float, float]:
        mark = self._marks.get(rank)
        if mark is None or tokens < mark[1]:  # first report, or a new engine
            self._marks[rank] = (now, tokens, busy_s)
            self._rates[rank] = (0.0, 0.0)
        elif now - mark[0] >= _RATE_WINDOW_S:
            span = now - mark[0]
            self._rates[rank] = ((tokens - mark[1]) / span, (busy_s - mark[2]) / span)
            self._marks[rank] = (now, tokens, busy_s)
        return self._rates[rank]


def _aggregate(loads: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(loads) or 1
    return {
        "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
        "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
        "total_reqs": sum(d["num_total_reqs"] for d in loads),
        "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
        "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2),
        "avg_utilization": round(sum(d["utilization"] for d in loads) / n, 4),
    }


def install(app: FastAPI, client: _Client, engine_kwargs: dict[str, Any], timeout_s: float) -> None:
    """Add the routes to ``app``; ``timeout_s`` bounds a flush (the watchdog's timeout)."""
    report = LoadReport()

    @app.get("/model_info", openapi_extra=openapi_schemas.GATEWAY_INFO)
    @app.get("/get_model_info", openapi_extra=openapi_schemas.GATEWAY_INFO)
    async def get_model_info(request: Request) -> dict[str, Any]:
        """SGLang's model facts. The model and tokenizer paths are shown only to a caller
        that presented the API key (as in ``/get_server_info``)."""
        info = model_info(client.info, engine_kwargs)
        return info if authenticated(request) else public_info(info)

    @app.get("/v1/loads", openapi_extra=openapi_schemas.GATEWAY_INFO)
    async def loads(
        include: str | None = Query(None, pattern=INCLUDE_PATTERN),
        dp_rank: int | None = Query(None, ge=0),
    ) -> dict[str, Any]:
        """SGLang's load report, per data parallel rank, from the engine's latest
        figures (``smg`` polls it for its load-aware policies)."""
        return report.render(client.info, dp_rank)

    @app.post("/flush_cache", openapi_extra=openapi_schemas.FLUSH_CACHE)
    async def flush_cache() -> Response:
        """Empty the radix prefix cache, SGLang's semantics: only an idle server flushes;
        with requests queued or running it answers 400 and changes nothing."""
        try:
            flushed = await asyncio.wait_for(client.flush_cache(), timeout_s)
        except SchedulerUnavailable as exc:
            return JSONResponse(error_body(f"the cache was not flushed: {exc}", 503), 503)
        except TimeoutError:
            message = f"the cache was not flushed: no answer from the scheduler in {timeout_s} s"
            return JSONResponse(error_body(message, 503), 503)
        if not flushed:
            message = (
                "the cache was not flushed: requests are queued or running (only an idle "
                "server flushes its cache); try again once they are done"
            )
            return JSONResponse(error_body(message, 400, code="server_busy"), 400)
        return JSONResponse({"status": "ok", "message": "Cache flushed."})
