"""What the request models (``request_models``) cannot check, and turning requests into jobs.

The raw body is checked around ``json.loads`` (UTF-8, nesting depth, lone surrogates)
before pydantic sees it; after it, the bounds of the loaded model (prompt and token
budget lengths, vocabulary, stop limits), the server's ``max_choices``, the bootstrap
fields (whose use depends on the server's mode) and the engine's own rules
(``SamplingParams.validate``, 64-bit ranges). Errors name the field the client sent
(``max_tokens``, not ``max_new_tokens``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tandem.scheduler.sampling import SamplingParams
from tandem.scheduler.text.stop import StopLimits
from tandem.server import request_models
from tandem.server.errors import APIError
from tandem.server.request_models import MAX_BOOTSTRAP_HOST, ROOM_MAX

# Engine names -> the OpenAI names a client sent.
_PUBLIC = {"max_new_tokens": "max_tokens", "top_logprobs_num": "top_logprobs"}
MAX_JSON_DEPTH = 64
# Integers travel to the scheduler as msgpack and land in int64 tensors: wider ones are a 400
# here, not a failure in the scheduler (a 500).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_REAL_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
    "presence_penalty",
)  # fmt: skip
_MESSAGE_MAX = 300  # characters of an engine message quoted back


@dataclass
class Job:
    """One sequence to generate: a prompt and params with ``n == 1``."""

    index: int
    prompt_ids: list[int]
    params: dict[str, Any]
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap: dict[str, Any] | None = None
    """``{"host", "port", "room"}``: the prefill server and room pairing this job's two
    halves (``bootstrap`` below), or ``None``."""
    logprob_start_len: int = -1
    """With ``return_logprob``: the prompt position from which the prompt's logprobs
    come back (SGLang's field; ``echo`` with ``logprobs`` asks for 0); -1: none."""
    echo: str | None = None
    """``/v1/completions``' ``echo``: the prompt's text, returned before the completion."""


@dataclass
class Limits:
    """What the loaded model allows. ``max_token_chars``: the longest text one token
    stands for (0: unknown, so texts are only measured by tokenizing them)."""

    vocab_size: int
    context_length: int
    max_token_chars: int = 0
    stop: StopLimits = field(default_factory=StopLimits)

    @property
    def max_text_chars(self) -> int:
        """Characters beyond which a text cannot fit in the context (0: no such bound)."""
        return (self.context_length - 1) * self.max_token_chars


# -- the raw body --------------------------------------------------------------------------------
_STRUCTURE = re.compile(rb'["\[\]{}]')
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def load_json(raw: bytes) -> Any:
    """The JSON value of a body, or a 400: not UTF-8, nested deeper than
    ``MAX_JSON_DEPTH``, not JSON (``NaN`` and ``Infinity`` included), or holding a lone
    surrogate in any string."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the body is not valid UTF-8 (byte {exc.start})") from None
    if too_deep(raw, MAX_JSON_DEPTH):
        raise APIError(
            f"the body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep "
            f"(the depth limit is {MAX_JSON_DEPTH})"
        )
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, _NotANumber) as exc:
        raise APIError(f"the body is not valid JSON: {exc}") from None
    except (ValueError, RecursionError):
        # Python refuses integers of more than 4300 digits.
        raise APIError("the body is not valid JSON: a number is too long") from None
    if _SURROGATE_ESCAPE.search(text):
        path = surrogate_path(value)
        if path is not None:
            raise APIError(
                f"{path} holds a lone UTF-16 surrogate escape, which is not text", param=path
            )
    return value


class _NotANumber(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotANumber(f"{name} is not a JSON number")


def too_deep(raw: bytes, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` deep, by one pass over the raw
    bytes (``json.loads`` itself would recurse). Brackets inside strings do not count."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth, pos = 0, 0
    while (found := _STRUCTURE.search(raw, pos)) is not None:
        char = raw[found.start()]
        pos = found.end()
        if char == ord('"'):
            rest = _STRING_REST.match(raw, pos)
            if rest is None:
                return False  # an unterminated string: json.loads reports it
            pos = rest.end()
        elif char in b"[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _child(path: str, key: Any) -> str:
    if key is None:
        return path
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def surrogate_path(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string or key of ``value`` that is
    not encodable text (a lone surrogate), or ``None``. Iterative: any depth is fine."""
    stack: list[tuple[str, Iterator[tuple[Any, Any]]]] = [("", iter([(None, value)]))]
    while stack:
        path, items = stack[-1]
        for key, item in items:
            if isinstance(key, str) and not _is_text(key):
                printable = key.encode("utf-8", "backslashreplace").decode("utf-8")
                return _child(path, printable)
            if isinstance(item, str):
                if not _is_text(item):
                    return _child(path, key) or "the body"
            elif isinstance(item, dict):
                stack.append((_child(path, key), iter(item.items())))
                break
            elif isinstance(item, list):
                stack.append((_child(path, key), enumerate(item)))
                break
        else:
            stack.pop()
    return None


def ensure_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


# -- fields ------------------------------------------------------------------------------------
def _show(value: Any) -> str:
    """``value`` for an error message, cut short: a client's field may be megabytes."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _stop(value: str | list[str] | None) -> list[str] | None:
    """Stop strings as a list, without empty ones; ``None`` for none."""
    if value is None:
        return None
    texts = [value] if isinstance(value, str) else value
    return [s for s in texts if s] or None


def check_max_tokens(value: int | None, limits: Limits, param: str) -> int | None:
    """A token budget (``max_tokens``) within the context, whose size the schema learns
    only once the model is loaded."""
    most = limits.context_length - 1
    if value is not None and value > most:
        raise APIError(f"{param} must be in [0, {most}], got {_show(value)}", param=param)
    return value


def sampling_from_openai(body: request_models.OpenAIRequest, limits: Limits) -> dict[str, Any]:
    """The engine's sampling dict from OpenAI fields (plus SGLang/vLLM extensions)."""
    params: dict[str, Any] = {}
    # max_completion_tokens wins, but a bad max_tokens next to it is still a bad request.
    for key in ("max_tokens", "max_completion_tokens"):
        value = check_max_tokens(getattr(body, key), limits, key)
        if value is not None:
            params["max_new_tokens"] = value
    for name in _REAL_FIELDS:
        value = getattr(body, name)
        if value is not None:
            params[name] = value
    if body.top_k is not None:
        params["top_k"] = body.top_k
    stop = _stop(body.stop)
    if stop is not None:
        params["stop"] = stop
    params["seed"] = body.seed
    params["ignore_eos"] = bool(body.ignore_eos)
    params["skip_special_tokens"] = body.skip_special_tokens is not False
    if body.stop_token_ids is not None:
        params["stop_token_ids"] = body.stop_token_ids
    return params


def native_sampling(
    raw: request_models.SamplingParams | Mapping[str, Any] | None, limits: Limits | None = None
) -> dict[str, Any]:
    """/generate's ``sampling_params`` (the model, or its JSON object) as the engine's
    sampling dict; ``null`` is unset, in the object and in each of its fields."""
    if raw is None:
        return {}
    if not isinstance(raw, request_models.SamplingParams):
        raw = request_models.validate(
            request_models.SamplingParams, dict(raw), at="sampling_params"
        )
    params = {k: v for k, v in raw.model_dump(exclude_unset=True).items() if v is not None}
    if "seed" in params and "sampling_seed" in params:
        raise APIError(
            "sampling_params: pass seed or its alias sampling_seed, not both",
            param="sampling_params.sampling_seed",
        )
    if limits is not None:
        check_max_tokens(params.get("max_new_tokens"), limits, "sampling_params.max_new_tokens")
    params.pop("n", None)  # 1, the only value the model takes
    if "stop" in params:
        params["stop"] = _stop(params["stop"])
    return params


def check_fan_out(prompts: int, n: int, max_choices: int) -> None:
    """Refuse a request for more choices (prompts x n) than the server allows."""
    if prompts * n > max_choices:
        raise APIError(
            f"this request asks for {prompts} prompt(s) x n={n} = {prompts * n} choices; "
            f"the server allows at most {max_choices} per request (max_choices)",
            param="n" if n > 1 else "prompt",
        )


def check_text_length(text: str, limits: Limits, param: str) -> None:
    """Refuse, without tokenizing it, a text too long to fit in the context even if
    every token stood for the longest text any token stands for."""
    most = limits.max_text_chars
    if most and len(text) > most:
        raise APIError(
            f"{param} has {len(text)} characters: more than {limits.context_length - 1} tokens "
            f"of at most {limits.max_token_chars} characters each, so it cannot fit in the "
            f"context length {limits.context_length}",
            param=param,
            code="context_length_exceeded",
        )


def check_ids(ids: list[int], limits: Limits, param: str) -> None:
    if not ids:
        raise APIError("the prompt is empty", param=param)
    if len(ids) >= limits.context_length:
        raise APIError(
            f"the prompt has {len(ids)} tokens; the context length is {limits.context_length}",
            param=param,
            code="context_length_exceeded",
        )
    for tok in ids:
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < limits.vocab_size:
            raise APIError(
                f"token id {_show(tok)} is outside the vocabulary [0, {limits.vocab_size})",
                param=param,
            )


def validate(
    params: dict[str, Any], prompt_len: int, limits: Limits, prefix: str = ""
) -> dict[str, Any]:
    """Check with the engine's rules; return the params as the scheduler wants them.
    ``prefix`` (``sampling_params.``) leads the engine's field names in the ``param``;
    without it they are given their OpenAI names."""
    try:
        sp = SamplingParams.from_dict(params)
        sp.validate(limits.vocab_size, context_len=limits.context_length, prompt_len=prompt_len)
        limits.stop.check(sp.stop_strings)
    except (ValueError, TypeError, OverflowError) as exc:
        message = str(exc)
        if len(message) > _MESSAGE_MAX:
            message = message[: _MESSAGE_MAX - 3] + "..."
        field = message.split(":", 1)[0].strip()
        param = _param(field, prefix) if field.isidentifier() else None
        code = "context_length_exceeded" if "context length" in message else None
        raise APIError(message, param=param, code=code) from None
    for name in ("top_k", "seed"):
        value = getattr(sp, name)
        if value is not None and not INT64_MIN <= value <= INT64_MAX:
            raise APIError(
                f"{name} must fit in 64 bits, got {_show(value)}", param=_param(name, prefix)
            )
    return sp.to_dict()


def _param(field: str, prefix: str) -> str:
    return prefix + field if prefix else _PUBLIC.get(field, field)


def expand(
    prompts: list[list[int]],
    params: dict[str, Any],
    n: int,
    limits: Limits,
    return_logprob: bool,
    top_logprobs_num: int,
    default_max: int | None = None,
    prefix: str = "",
    logprob_start_len: int = -1,
    start_param: str = "logprob_start_len",
) -> list[Job]:
    """``n`` jobs per prompt, in OpenAI's choice order; seeded copies get seed + i, as the
    engine does, so they differ yet reproduce. ``logprob_start_len`` (named
    ``start_param`` in errors) must be a position of every prompt; it reaches the jobs
    only with ``return_logprob``."""
    jobs = []
    for p, ids in enumerate(prompts):
        if logprob_start_len >= len(ids):
            raise APIError(
                f"{start_param} must be -1 or a prompt position, below the prompt's "
                f"{len(ids)} tokens, got {logprob_start_len}",
                param=start_param,
            )
        per = dict(params)
        if "max_new_tokens" not in per:
            # Unset: as much as the context leaves (capped by the endpoint's default).
            room = limits.context_length - len(ids)
            per["max_new_tokens"] = room if default_max is None else min(default_max, room)
        checked = validate(per, len(ids), limits, prefix)
        if checked.get("seed") is not None and checked["seed"] + n - 1 > INT64_MAX:
            raise APIError(f"seed + n - 1 must fit in 64 bits, got {checked['seed']}", param="seed")
        for i in range(n):
            copy = dict(checked, n=1)
            if copy.get("seed") is not None:
                copy["seed"] = copy["seed"] + i
            job = Job(p * n + i, ids, copy, return_logprob, top_logprobs_num)
            job.logprob_start_len = logprob_start_len if return_logprob else -1
            jobs.append(job)
    return jobs


# -- prefill/decode disaggregation -------------------------------------------------------------
BOOTSTRAP_FIELDS = tuple(request_models.BOOTSTRAP_TYPES)


def bootstrap(
    body: Mapping[str, Any], required: bool, prompts: int = 1, lists: bool = False
) -> list[dict[str, Any]] | None:
    """SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``, which a
    gateway in front of prefill and decode servers adds to both halves of a request:
    all three or none (``null`` is absent); one ``{"host", "port", "room"}`` per prompt.

    ``required``: this server is a prefill or a decode server, which cannot serve a
    request without them. ``lists``: the route takes several prompts (``/v1/completions``),
    where each field may also be a list of one value per prompt, as SGLang takes them (and
    ``smg`` sends them); with more than one prompt, rooms must be such a list, each
    different, since a room pairs one sequence.
    """
    given = {name: body.get(name) for name in BOOTSTRAP_FIELDS if body.get(name) is not None}
    if not given and not required:
        return None
    missing = [name for name in BOOTSTRAP_FIELDS if name not in given]
    if missing:
        why = (
            f"it has {', '.join(given)}"
            if given
            else "this server is one half of a prefill/decode pair (--disaggregation-mode), "
            "which a gateway such as `smg launch --pd-disaggregation` sends requests to"
        )
        raise APIError(
            f"{', '.join(missing)} missing: a request carries bootstrap_host, bootstrap_port "
            f"and bootstrap_room together, or none of them ({why})",
            param=missing[0],
        )
    values: dict[str, list[Any]] = {}
    for name, value in given.items():
        if isinstance(value, list) and lists:
            if len(value) != prompts:
                raise APIError(
                    f"{name} lists {len(value)} value(s) for {prompts} prompt(s): one per prompt",
                    param=name,
                )
            values[name] = [_bootstrap_value(name, v, f"{name}[{i}]") for i, v in enumerate(value)]
        else:
            values[name] = [_bootstrap_value(name, value, name)] * prompts
    rooms = values["bootstrap_room"]
    if prompts > 1 and not isinstance(given["bootstrap_room"], list):
        raise APIError(
            f"bootstrap_room must list one room per prompt ({prompts} here): a room pairs one "
            "sequence",
            param="bootstrap_room",
        )
    if len(set(rooms)) != len(rooms):
        again = next(i for i, room in enumerate(rooms) if room in rooms[:i])
        raise APIError(
            f"bootstrap_room[{again}] repeats an earlier room: a room pairs one sequence",
            param=f"bootstrap_room[{again}]",
        )
    hosts, ports = values["bootstrap_host"], values["bootstrap_port"]
    return [{"host": h, "port": p, "room": r} for h, p, r in zip(hosts, ports, rooms, strict=True)]


def _bootstrap_value(name: str, value: Any, param: str) -> Any:
    """One bootstrap field's value, checked (``request_models.BOOTSTRAP_TYPES``); ``param``
    names it in errors."""
    if value is None:  # only in a list: a null field is absent
        raise APIError(f"{param} must not be null", param=param)
    if name == "bootstrap_host" and isinstance(value, str):
        # The schema's pattern ends in ``$``, which also matches before a final newline in
        # JSON Schema validators (Python's re among them): such a host is taken without it.
        value = value.removesuffix("\n")
    try:
        return request_models.BOOTSTRAP_TYPES[name].validate_python(value, strict=True)
    except ValidationError:
        pass
    if name == "bootstrap_host":
        if not isinstance(value, str):
            raise APIError(f"{param} must be a string, got {_show(value)}", param=param)
        raise APIError(
            f"{param} must be a host name or an IP address (1 to {MAX_BOOTSTRAP_HOST} "
            f"letters, digits and . _ - : % [ ]), got {_show(value)}",
            param=param,
        )
    if not isinstance(value, int | float) or isinstance(value, bool) or value != int(value):
        raise APIError(f"{param} must be an integer, got {_show(value)}", param=param)
    low, high = (1, 65535) if name == "bootstrap_port" else (0, ROOM_MAX)
    raise APIError(f"{param} must be in [{low}, {high}], got {_show(value)}", param=param)


def check_one_choice(boot: list[dict[str, Any]] | None, n: int) -> None:
    """A room pairs one sequence on each side: no ``n > 1`` with bootstrap fields."""
    if boot is not None and n > 1:
        raise APIError(
            "a request with bootstrap fields (prefill/decode disaggregation) takes n=1: its "
            f"bootstrap_room pairs one prefill with one decode; this one asks for n={n}",
            param="n",
        )


def with_bootstrap(jobs: list[Job], boot: list[dict[str, Any]] | None) -> list[Job]:
    """Each prompt's bootstrap (``bootstrap``) on its job (``n`` is 1 with one)."""
    if boot is not None:
        for job in jobs:
            job.bootstrap = boot[job.index]
    return jobs
