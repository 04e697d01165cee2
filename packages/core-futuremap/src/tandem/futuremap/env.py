"""The one typed place where tandem reads its environment variables.

Layers never call ``os.environ`` themselves: they take the value as an argument, and
only a default left unset falls back to ``read_env``, so a test can see at a glance
which switches exist and what they mean. The engine's switches are ``EngineConfig``
fields whose defaults come from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CompileChecks = Literal["auto", "on", "off"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def _parse_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0")
    return value


def _parse_compile(name: str, raw: str) -> CompileChecks:
    value = raw.strip().lower()
    if value == "auto":
        return "auto"
    if value in _TRUE:
        return "on"
    if value in _FALSE:
        return "off"
    raise ValueError(f"{name}={raw!r} must be auto, on or off")


@dataclass(frozen=True)
class TandemEnv:
    """Switches read from the environment. The first four are the defaults of the
    ``EngineConfig`` fields of the same names (``host_stream_max_delay_ms`` there).

    Attributes:
        debug_futures: ``TANDEM_DEBUG_FUTURES``; turns on the debug invariants: the
            FutureMap's consume-once checks and, in an engine, strict accounting, the
            page ledger and the decode-stage check (always on in tests and CI).
        compile_checks: ``TANDEM_COMPILE_CHECKS`` (``auto``/``on``/``off``); whether the
            debug checks run as one ``torch.compile``'d function. ``auto`` compiles on
            accelerators where it works (eager if compiling fails) and stays eager on
            the CPU, where compiled checks measured slower; ``on`` compiles everywhere.
        host_stream_max_delay_s: ``TANDEM_HOST_STREAM_MAX_DELAY_MS`` (milliseconds in
            the variable, seconds here); when > 0 every host-stream work item is
            delayed by a random time up to this bound, to shake out ordering bugs.
        host_stream_seed: ``TANDEM_HOST_STREAM_SEED``; seed of those random delays.
        cache_dir: ``TANDEM_CACHE_DIR``; where tandem keeps what it builds once and reuses
            (the embedded default model). ``None`` (unset or empty) falls back to the
            user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``).
        xdg_cache_home: ``XDG_CACHE_HOME``, the desktop convention every tool honours
            (``None`` when unset or empty); the user's cache directory.
        triton_interpret: ``TRITON_INTERPRET`` is ``1``: Triton's own switch, which
            runs its kernels in the interpreter (on a CPU too). Triton reads it when it
            is imported, so it is a fact of the process rather than an engine option.
        api_key: ``TANDEM_API_KEY``; the default of ``tandem serve --api-key`` (``None``
            when unset; set but empty stays ``""``, which ``tandem serve`` refuses rather
            than serve without a key), so a key need not appear in a process listing.
    """

    debug_futures: bool = False
    compile_checks: CompileChecks = "auto"
    host_stream_max_delay_s: float = 0.0
    host_stream_seed: int | None = None
    cache_dir: Path | None = None
    xdg_cache_home: Path | None = None
    triton_interpret: bool = False
    api_key: str | None = None


def read_env(environ: Mapping[str, str] | None = None) -> TandemEnv:
    """Parse the ``TANDEM_*`` variables (and ``XDG_CACHE_HOME``, ``TRITON_INTERPRET``)
    of ``environ`` (default: ``os.environ``).

    A malformed value is an error naming the variable, never silently ignored.
    """
    env = os.environ if environ is None else environ
    seed_raw = env.get("TANDEM_HOST_STREAM_SEED")
    seed: int | None = None
    if seed_raw is not None and seed_raw.strip():
        try:
            seed = int(seed_raw)
        except ValueError:
            raise ValueError(f"TANDEM_HOST_STREAM_SEED={seed_raw!r} is not an integer") from None
    cache_raw = env.get("TANDEM_CACHE_DIR", "").strip()
    xdg_raw = env.get("XDG_CACHE_HOME", "").strip()
    delay_ms = _parse_float(
        "TANDEM_HOST_STREAM_MAX_DELAY_MS", env.get("TANDEM_HOST_STREAM_MAX_DELAY_MS", "0")
    )
    return TandemEnv(
        debug_futures=_parse_bool("TANDEM_DEBUG_FUTURES", env.get("TANDEM_DEBUG_FUTURES", "0")),
        compile_checks=_parse_compile(
            "TANDEM_COMPILE_CHECKS", env.get("TANDEM_COMPILE_CHECKS", "auto")
        ),
        host_stream_max_delay_s=delay_ms / 1000.0,
        host_stream_seed=seed,
        cache_dir=Path(cache_raw).expanduser() if cache_raw else None,
        xdg_cache_home=Path(xdg_raw) if xdg_raw else None,
        triton_interpret=env.get("TRITON_INTERPRET") == "1",
        api_key=env.get("TANDEM_API_KEY"),
    )


def default_library_switch(name: str, value: str) -> None:
    """Set a third-party library's environment switch ``name`` to ``value`` unless the
    user set it, before that library reads it (a library that reads its switches only
    from the environment, at import)."""
    os.environ.setdefault(name, value)
