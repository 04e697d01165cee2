"""Turning OpenAI and SGLang request bodies into engine jobs, or a 400 naming the field.

Validation happens here, in the API process, with the engine's own rules
(``SamplingParams.validate``), so that a bad request never reaches the scheduler and
the error names the field the client sent (``max_tokens``, not ``max_new_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.scheduler.sampling import SamplingParams
from tandem.server.errors import APIError

# Engine names -> the OpenAI names a client sent.
_PUBLIC = {"max_new_tokens": "max_tokens", "top_logprobs_num": "top_logprobs"}
MAX_N = 128
MAX_TOP_LOGPROBS = 20
# Integers travel to the scheduler as msgpack and land in int64 tensors: wider ones are a 400
# here, not a failure in the scheduler (a 500).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class Job:
    """One sequence to generate: a prompt and params with ``n == 1``."""

    index: int
    prompt_ids: list[int]
    params: dict[str, Any]
    return_logprob: bool = False
    top_logprobs_num: int = 0


@dataclass
class Limits:
    """What the loaded model allows."""

    vocab_size: int
    context_length: int


def _typed(body: Mapping[str, Any], key: str, types: Any, what: str, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(f"{key} must be {what}, got {value!r}", param=key)
    if not isinstance(value, types):
        raise APIError(f"{key} must be {what}, got {value!r}", param=key)
    return value


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    return bool(_typed(body, key, bool, "a boolean", default))


def ensure_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def sampling_from_openai(body: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's sampling dict from OpenAI fields (plus SGLang/vLLM extensions)."""
    max_tokens = body.get("max_completion_tokens")
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise APIError(f"{key} must be an integer, got {max_tokens!r}", param=key)
    if max_tokens is not None and max_tokens < 0:
        raise APIError(f"{key} must be >= 0, got {max_tokens}", param=key)
    params: dict[str, Any] = {}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    number = (int, float)
    for name in (
        "temperature", "top_p", "min_p", "repetition_penalty",
        "frequency_penalty", "presence_penalty",
    ):  # fmt: skip
        value = _typed(body, name, number, "a number")
        if value is not None:
            params[name] = value
    top_k = _typed(body, "top_k", int, "an integer")
    if top_k is not None:
        params["top_k"] = top_k
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError("stop must be a string or a list of strings", param="stop")
        params["stop"] = [s for s in stop if s] or None
    params["seed"] = _typed(body, "seed", int, "an integer")
    params["ignore_eos"] = _bool(body, "ignore_eos")
    params["skip_special_tokens"] = _bool(body, "skip_special_tokens", True)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        params["stop_token_ids"] = stop_ids
    return params


def choices_count(body: Mapping[str, Any]) -> int:
    n = _typed(body, "n", int, "an integer", 1)
    if not 1 <= n <= MAX_N:
        raise APIError(f"n must be in [1, {MAX_N}], got {n}", param="n")
    return int(n)


def check_ids(ids: list[int], limits: Limits, param: str) -> None:
    if not ids:
        raise APIError("the prompt is empty", param=param)
    for tok in ids:
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < limits.vocab_size:
            raise APIError(
                f"token id {tok!r} is outside the vocabulary [0, {limits.vocab_size})", param=param
            )
    if len(ids) >= limits.context_length:
        raise APIError(
            f"the prompt has {len(ids)} tokens; the context length is {limits.context_length}",
            param=param,
            code="context_length_exceeded",
        )


def validate(params: dict[str, Any], prompt_len: int, limits: Limits) -> dict[str, Any]:
    """Check with the engine's rules; return the params as the scheduler wants them."""
    try:
        sp = SamplingParams.from_dict(params)
        sp.validate(limits.vocab_size, context_len=limits.context_length, prompt_len=prompt_len)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        field = message.split(":", 1)[0].strip()
        param = _PUBLIC.get(field, field) if field.isidentifier() else None
        code = "context_length_exceeded" if "context length" in message else None
        raise APIError(message, param=param, code=code) from None
    for name in ("top_k", "seed"):
        value = getattr(sp, name)
        if value is not None and not INT64_MIN <= value <= INT64_MAX:
            raise APIError(f"{name} must fit in 64 bits, got {value}", param=name)
    return sp.to_dict()


def expand(
    prompts: list[list[int]],
    params: dict[str, Any],
    n: int,
    limits: Limits,
    return_logprob: bool,
    top_logprobs_num: int,
    default_max: int | None = None,
) -> list[Job]:
    """``n`` jobs per prompt, in OpenAI's choice order; seeded copies get seed + i, as the
    engine does, so they differ yet reproduce."""
    jobs = []
    for p, ids in enumerate(prompts):
        per = dict(params)
        if "max_new_tokens" not in per:
            # Unset: as much as the context leaves (capped by the endpoint's default).
            room = limits.context_length - len(ids)
            per["max_new_tokens"] = room if default_max is None else min(default_max, room)
        checked = validate(per, len(ids), limits)
        if checked.get("seed") is not None and checked["seed"] + n - 1 > INT64_MAX:
            raise APIError(f"seed + n - 1 must fit in 64 bits, got {checked['seed']}", param="seed")
        for i in range(n):
            copy = dict(checked, n=1)
            if copy.get("seed") is not None:
                copy["seed"] = copy["seed"] + i
            jobs.append(Job(p * n + i, ids, copy, return_logprob, top_logprobs_num))
    return jobs
