"""Per-request sampling parameters, with SGLang's names and defaults.

A request carries one ``SamplingParams`` from the API to the scheduler. The server
parses user JSON with ``from_dict`` (unknown keys are an error, never silently
dropped) and rejects bad values with ``validate`` before the request reaches the
scheduler, so the scheduler can trust what it gets: a bad value is a 4xx, not a crash
inside a batch that other requests share.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
"""The sampling parameters that constrain the output, SGLang's names."""

# SGLang spells the seed ``sampling_seed``; ``seed`` is the canonical name here (the
# OpenAI API's), and the alias is folded into it by ``from_dict``.
_ALIASES = {"sampling_seed": "seed"}


@dataclass
class SamplingParams:
    """How to pick a request's next tokens and when to stop.

    Attributes:
        max_new_tokens: most tokens to generate (0 is allowed: prefill only).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus sampling, in (0, 1]; 1 is off.
        top_k: keep the k most likely tokens; -1 or 0 is off (SGLang uses -1, the
            OpenAI-style clients often send 0; both mean "all tokens"), 1 is greedy.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely
            token's, in [0, 1]; 0 is off.
        repetition_penalty: Hugging Face semantics over prompt and generated tokens
            (positive logits divided by it, negative multiplied); 1 is off.
        frequency_penalty: OpenAI semantics over generated tokens only: subtract
            ``frequency_penalty * count``; in [-2, 2]; 0 is off.
        presence_penalty: OpenAI semantics over generated tokens only: subtract
            ``presence_penalty`` once a token has appeared; in [-2, 2]; 0 is off.
        stop: stop string(s); matched by the detokenizer, not here.
        stop_token_ids: extra token ids that end the request.
        ignore_eos: keep generating past the model's EOS token.
        skip_special_tokens: drop special tokens when detokenizing.
        seed: per-request seed (``sampling_seed`` in SGLang): the same seed and the same
            logits give the same tokens whatever else is in the batch.
        n: number of choices; the scheduler expands a request into ``n`` sequences.
        return_logprob: return the chosen tokens' log-probabilities.
        top_logprobs_num: also return this many most likely alternatives per token.
        json_schema: constrain the output to JSON matching this schema (a JSON string,
            SGLang's parameter; ``{"type": "object"}`` for any JSON object).
        regex: constrain the output to match this regular expression.
        ebnf: constrain the output to this EBNF grammar (its rule ``root`` first).
        structural_tag: constrain the output to xgrammar's structural tag (a JSON
            string): free text with tagged, schema-constrained parts (tool calls).
            At most one of the four grammar fields may be set (``grammar``).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    return_logprob: bool = False
    top_logprobs_num: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a JSON-like mapping; ``None`` gives the defaults.

        Raises ValueError naming every unknown key, so a typo such as ``top-p`` is
        reported instead of silently sampling with the default.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params: expected a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known and k not in _ALIASES)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _ALIASES.get(key, key)
            if name in kwargs and kwargs[name] != value:
                raise ValueError(f"{name}: given twice with different values ({key!r})")
            kwargs[name] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for msgpack between processes); ``from_dict`` inverts it."""
        return dataclasses.asdict(self)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The output constraint as ``(kind, text)`` (kind: one of ``GRAMMAR_KINDS``),
        or None when the output is free."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature 0, or top-k 1 (the same token either way)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list, whichever form the user sent."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    @property
    def top_k_enabled(self) -> bool:
        """Whether top-k truncates at all (-1 and 0 mean off)."""
        return self.top_k > 0

    @property
    def uses_penalties(self) -> bool:
        """Whether any penalty changes the logits (so the request needs penalty state)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(
        self,
        vocab_size: int,
        context_len: int | None = None,
        prompt_len: int | None = None,
    ) -> None:
        """Raise ValueError, whose message starts with the offending field's name.

        Args:
            vocab_size: the model's vocabulary size (bounds token ids and
                ``top_logprobs_num``).
            context_len: the model's context length; with ``prompt_len``, the prompt
                plus ``max_new_tokens`` must fit in it.
            prompt_len: the request's prompt length in tokens.
        """
        _int_at_least("max_new_tokens", self.max_new_tokens, 0)
        _real_in("temperature", self.temperature, 0.0, math.inf, "must be >= 0")
        _real_in("top_p", self.top_p, 0.0, 1.0, "must be in (0, 1]", low_open=True)
        _int_at_least("top_k", self.top_k, -1)
        _real_in("min_p", self.min_p, 0.0, 1.0, "must be in [0, 1]")
        _real_in("repetition_penalty", self.repetition_penalty, 0.0, math.inf, "must be > 0", True)
        _real_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "must be in [-2, 2]")
        _real_in("presence_penalty", self.presence_penalty, -2.0, 2.0, "must be in [-2, 2]")
        _check_stop(self.stop)
        _check_stop_token_ids(self.stop_token_ids, vocab_size)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("return_logprob", self.return_logprob)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed: must be an int or None, got {self.seed!r}")
        _int_at_least("n", self.n, 1)
        _int_at_least("top_logprobs_num", self.top_logprobs_num, 0)
        if self.top_logprobs_num > vocab_size:
            raise ValueError(
                f"top_logprobs_num: must be <= the vocabulary size {vocab_size}, "
                f"got {self.top_logprobs_num}"
            )
        _check_fits(self.max_new_tokens, context_len, prompt_len)
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        for kind in given:
            if not isinstance(getattr(self, kind), str):
                raise ValueError(f"{kind}: must be a string, got {getattr(self, kind)!r}")
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one of {', '.join(given)} may be given")


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass, but True as a count or a seed is a client bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_at_least(name: str, value: object, low: int) -> None:
    if not _is_int(value):
        raise ValueError(f"{name}: must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")


def _real_in(
    name: str,
    value: object,
    low: float,
    high: float,
    what: str,
    low_open: bool = False,
) -> None:
    if not _is_real(value):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    # Written so that NaN fails every comparison and is rejected; inf is rejected too
    # because no field here has a meaningful infinite value.
    above_low = value > low if low_open else value >= low
    if not (above_low and value <= high and math.isfinite(value)):
        raise ValueError(f"{name}: {what}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be a bool, got {value!r}")


def _check_stop(stop: object) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop: must be a string or a list of strings, got {stop!r}")


def _check_stop_token_ids(ids: object, vocab_size: int) -> None:
    if ids is None:
        return
    if not isinstance(ids, list | tuple):
        raise ValueError(f"stop_token_ids: must be a list of ints, got {ids!r}")
    for token in ids:
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise ValueError(f"stop_token_ids: {token!r} is not a token id in [0, {vocab_size})")


def _check_fits(max_new_tokens: int, context_len: int | None, prompt_len: int | None) -> None:
    if context_len is None or prompt_len is None:
        return
    if prompt_len + max_new_tokens > context_len:
        raise ValueError(
            f"max_new_tokens: the prompt ({prompt_len} tokens) plus max_new_tokens "
            f"({max_new_tokens}) exceeds the context length {context_len}"
        )
