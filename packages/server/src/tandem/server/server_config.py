"""``ServerConfig``: every option of the HTTP front of ``tandem serve``.

The engine's options are ``EngineConfig`` fields; these are the server's own (listening,
limits, shutdown, the watchdog, authentication). ``tandem serve`` exposes each as a flag,
with SGLang's or vLLM's name where one of them has the option.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from tandem.futuremap.env import read_env

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
TOOL_CALL_PARSERS = ("llama3", "qwen25")  # tool_calls.FORMATS


@dataclass(frozen=True)
class ServerConfig:
    """Options of the API process.

    Attributes:
        host: Address to listen on.
        port: Port to listen on.
        served_model_name: The model name clients see and send (default: ``default``
            for the embedded default model, else the ``--model-path`` value).
        api_key: When set, every endpoint but ``/health`` needs ``Authorization: Bearer
            <key>`` (``/metrics`` too unless ``metrics_without_auth``). Default: the
            ``TANDEM_API_KEY`` environment variable.
        metrics_without_auth: Serve ``/metrics`` without the API key (for a Prometheus
            scraper on a trusted network).
        allowed_origins: Origins a browser page may call the API from (CORS); none by
            default, so no web page can read a response.
        allowed_hosts: ``Host`` header values accepted. Empty: when bound to loopback,
            only loopback names (a web page cannot reach a local server through a
            DNS-rebound name); otherwise any.
        max_request_bytes: Largest request body; a larger one is answered 413 before it
            is read to the end.
        max_choices: Largest prompts x n of one request; more is a 400.
        tokenizer_workers: Threads that parse, render chat templates and tokenize, off
            the event loop.
        prepare_queue_size: Requests that may wait for a tokenizer worker; past them a
            request is refused with 503 and ``Retry-After``.
        graceful_shutdown_timeout: Seconds in-flight requests may still run after
            SIGTERM or SIGINT; then open streams end with an error event and ``[DONE]``.
        watchdog_timeout: Seconds the scheduler may go without progress while work is
            pending (or without a heartbeat at all) before the server declares it hung,
            fails every request with 503 and exits non-zero.
        dp_size: Data-parallel replicas (SGLang's option): this many scheduler
            processes, each a full copy of the engine, behind this one API process; each
            request goes to the replica with the fewest open jobs (prompts x n). On the
            CPU, without ``cpu_forward_threads``, each replica's forward gets cores /
            dp_size threads. A replica that dies or hangs fails the whole server (503,
            then exit non-zero).
        tool_call_parser: How the model writes tool calls (SGLang's option): ``llama3``
            (Llama 3's JSON, ``{"name": ..., "parameters": {...}}``) or ``qwen25``
            (``<tool_call>`` tags around the JSON, Qwen's and Hermes's). Unset: from the
            chat template, then the architecture (docs/guides/structured-outputs.md).
        special_tokens_in_content: Tokenize chat message contents with special tokens
            parsed, as the template's own are. Off by default: a message's content is
            text, so a user cannot write ``<|im_start|>system`` into it to forge a turn.
    """

    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    api_key: str | None = None
    metrics_without_auth: bool = False
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_request_bytes: int = 8 * 1024 * 1024
    max_choices: int = 256
    tokenizer_workers: int = 2
    prepare_queue_size: int = 512
    graceful_shutdown_timeout: float = 30.0
    watchdog_timeout: float = 300.0
    dp_size: int = 1
    tool_call_parser: str | None = None
    special_tokens_in_content: bool = False

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port: {self.port} is not a TCP port")
        for name in ("max_request_bytes", "max_choices", "tokenizer_workers", "dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prepare_queue_size < 0:
            raise ValueError(f"prepare_queue_size must be >= 0, got {self.prepare_queue_size}")
        for name in ("graceful_shutdown_timeout", "watchdog_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )

    @property
    def host_allow_list(self) -> tuple[str, ...]:
        """The ``Host`` names accepted (without port); empty means any."""
        if self.allowed_hosts:
            return self.allowed_hosts
        return LOOPBACK_NAMES if is_loopback(self.host) else ()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_api_key() -> str | None:
    """``--api-key``'s default: ``TANDEM_API_KEY``."""
    return read_env().api_key
