"""Prometheus metrics, all prefixed ``tandem_``.

Latencies and token counts are measured here, in the API process, where a client sees
them. Scheduler figures (running and queued requests, KV usage, device busy and idle
time, overshoot steps) come from the engine's ``get_server_info()``, which the scheduler
process pushes a few times a second; a collector turns the latest copy into samples at
scrape time, so there is no second bookkeeping that could drift. Once the scheduler is
dead or hung, only ``tandem_scheduler_up 0`` remains of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, info: Callable[[], dict[str, Any]], up: Callable[[], bool]) -> None:
        self._info = info
        self._up = up

    def collect(self) -> Iterator[Metric]:
        up = self._up()
        yield GaugeMetricFamily(
            "tandem_scheduler_up", "1 while the scheduler process answers, else 0 (alert on it)",
            value=1.0 if up else 0.0,
        )  # fmt: skip
        info = self._info()
        if not up or not info:
            return  # a dead or hung scheduler's last figures would be stale
        capacity = int(info.get("max_total_tokens") or 0)
        free = int(info.get("available_kv_tokens") or 0)
        cached = int(info.get("cached_kv_tokens") or 0)
        used = max(capacity - free - cached, 0)
        gauges = {
            "num_running_requests": ("requests running", info.get("num_running_requests")),
            "num_queued_requests": ("requests waiting", info.get("num_waiting_requests")),
            "kv_capacity_tokens": ("KV pool size in tokens", capacity),
            "kv_used_tokens": ("KV tokens held by requests", used),
            "kv_cached_tokens": ("KV tokens held by the radix cache", cached),
            "kv_usage": ("KV pool fraction held by requests", used / capacity if capacity else 0.0),
            "free_request_rows": ("free rows of the request pool", info.get("free_rows")),
            "spec_accept_length": (
                "mean tokens committed per speculative verify step (0 without speculation)",
                info.get("avg_spec_accept_length"),
            ),
        }  # fmt: skip
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"tandem_{name}", doc, value=float(value or 0))
        counters = {
            "device_busy_seconds": ("device time spent running batches", "device_busy_s"),
            "device_idle_seconds": ("device time spent waiting for work", "device_idle_s"),
            "overshoot_steps": ("steps run for finished requests", "overshoot_steps"),
            "forward_steps": ("batches run", "forward_steps"),
            "retracted_requests": ("requests retracted for lack of KV", "retracted_requests"),
            "aborted_requests": ("requests aborted in the scheduler", "aborted_requests"),
            "spec_verify_steps": ("speculative verify steps", "spec_verify_steps"),
            "spec_committed_tokens": (
                "tokens committed by speculative verify steps", "spec_committed_tokens",
            ),
        }  # fmt: skip
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(f"tandem_{name}", doc, value=float(info.get(key) or 0))


class Metrics:
    """Every metric of one server, in a registry of its own."""

    def __init__(self, info: Callable[[], dict[str, Any]], up: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tandem_requests", "finished requests", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("tandem_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "generated tokens", registry=r)
        self.inflight = Gauge("tandem_inflight_requests", "requests open in the API", registry=r)
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds", "time to first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds", "time between streamed chunks",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds", "request latency, end to end",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_EngineCollector(info, up))

    def on_finished(self, meta: dict[str, Any]) -> None:
        """Count a request the scheduler finished (whoever was still listening)."""
        reason = meta.get("finish_reason") or {}
        self.requests.labels(str(reason.get("type", "unknown"))).inc()
        self.prompt_tokens.inc(int(meta.get("prompt_tokens") or 0))
        self.generation_tokens.inc(int(meta.get("completion_tokens") or 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
