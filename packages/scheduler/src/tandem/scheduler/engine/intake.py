"""Request intake: one ``generate`` call's arguments checked and turned into ``Request``
objects before any of them is queued.

A bad request is a ``ValueError`` naming the field (and the request's index in a
batch); nothing of the call reaches the loop thread then, so it never disturbs other
work. ``n > 1`` becomes ``n`` requests with ids and seeds of their own.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.scheduler.disagg.protocol import Bootstrap
from tandem.scheduler.request import Request
from tandem.scheduler.sampling import SamplingParams
from tandem.scheduler.speculative.interface import SpeculativeWorker
from tandem.scheduler.text.detokenizer import IncrementalDetokenizer
from tandem.scheduler.text.stop import StopChecker, StopLimits
from tandem.scheduler.text.tokenizer import Tokenizer

Prompt = str | Sequence[str] | None
InputIds = Sequence[int] | Sequence[Sequence[int]] | None
ParamsArg = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


@dataclass
class _Parsed:
    """One prompt's request, checked, with the call's and the sampling parameters'
    logprob options merged."""

    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    compiled: Any = None  # its compiled grammar, when its output is constrained


@dataclass(frozen=True)
class Intake:
    """What checking a request needs to know of the engine."""

    tokenizer: Tokenizer | None
    vocab_size: int
    context_length: int
    kv_capacity_tokens: int
    lookahead: int
    """KV positions a speculative step writes past the context (0 without one)."""
    spec: SpeculativeWorker | None
    in_use: Callable[[str], bool]
    """Whether a request id belongs to a request still running."""
    disaggregation_mode: str = "null"
    """``prefill`` and ``decode`` take only requests with bootstrap fields; ``null``
    ignores them."""
    grammars: Callable[[], Any] | None = None
    """The engine's ``grammar.GrammarBackend`` (built on first use), or None when
    constrained output is refused, for the reason ``no_grammar``."""
    no_grammar: str = ""
    stop_limits: StopLimits = field(default_factory=StopLimits)

    def requests(
        self,
        prompt: Prompt,
        sampling_params: ParamsArg,
        input_ids: InputIds,
        return_logprob: bool | Sequence[bool],
        top_logprobs_num: int | Sequence[int],
        stream: bool,
        rid: str | Sequence[str] | None,
        times: bool,
        text: bool = True,
        bootstrap: Bootstrap | Sequence[Bootstrap | None] | None = None,
        logprob_start_len: int | Sequence[int] = -1,
    ) -> tuple[bool, list[Request]]:
        """The call's requests, in order, and whether it took a single prompt.
        ``text=False``: the caller decodes the ids itself, so a request without stop
        strings gets no detokenizer here. ``logprob_start_len`` (SGLang's): with
        logprobs asked for, the prompt position from which prompt logprobs are
        returned; -1 for none."""
        single, prompts = self._prompt_ids(prompt, input_ids)
        if stream and not single:
            raise ValueError("stream=True takes a single prompt (or input_ids list)")
        n = len(prompts)
        params = _per_request(sampling_params, n, "sampling_params")
        logprob = _per_request(return_logprob, n, "return_logprob")
        top_n = _per_request(top_logprobs_num, n, "top_logprobs_num")
        starts = _per_request(logprob_start_len, n, "logprob_start_len")
        parsed = [
            self._parse(i, ids, p) for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        for top in top_n:
            if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= self.vocab_size:
                raise ValueError(
                    f"top_logprobs_num must be an int in [0, {self.vocab_size}], got {top!r}"
                )
        for i, (item, want_lp, top, start) in enumerate(
            zip(parsed, logprob, top_n, starts, strict=True)
        ):
            item.return_logprob = bool(want_lp or item.params.return_logprob)
            item.top_logprobs_num = max(top, item.params.top_logprobs_num)
            item.logprob_start_len = self._logprob_start(i, start, item)
        if stream and parsed[0].params.n > 1:
            raise ValueError("stream=True takes n=1")
        rids = self._rids(rid, parsed)
        self._check_speculative(parsed)
        boots = self._bootstraps(bootstrap, parsed)
        reqs = [
            self._request(copy, copy_rid, times, text, boot)
            for item, ids, boot in zip(parsed, rids, boots, strict=True)
            for copy, copy_rid in zip(_copies(item), ids, strict=True)
        ]
        return single and len(reqs) == 1, reqs

    def _logprob_start(self, index: int, start: Any, item: _Parsed) -> int:
        """Request ``index``'s checked ``logprob_start_len``: -1, or a prompt position
        (then it gets prompt logprobs, if it asked for logprobs at all, as in SGLang)."""
        n = len(item.prompt_ids)
        if not isinstance(start, int) or isinstance(start, bool) or not -1 <= start < n:
            raise ValueError(
                f"request {index}: logprob_start_len must be -1 (no prompt logprobs) or a "
                f"prompt position in [0, {n}) (the prompt has {n} tokens), got {start!r}"
            )
        if start < 0 or not item.return_logprob:
            return -1
        if self.spec is not None:
            raise ValueError(
                f"request {index}: prompt logprobs (logprob_start_len) are not supported "
                "with speculative decoding"
            )
        if self.disaggregation_mode != "null":
            raise ValueError(
                f"request {index}: prompt logprobs (logprob_start_len) are not supported "
                f"with disaggregation_mode={self.disaggregation_mode!r}"
            )
        return start

    def _bootstraps(
        self, bootstrap: Bootstrap | Sequence[Bootstrap | None] | None, parsed: list[_Parsed]
    ) -> list[Bootstrap | None]:
        """Each request's bootstrap fields, checked against this engine's mode."""
        n = len(parsed)
        boots = [bootstrap] * n if bootstrap is None or isinstance(bootstrap, Bootstrap) else None
        if boots is None:
            boots = _per_request(bootstrap, n, "bootstrap")
        mode = self.disaggregation_mode
        if mode == "null":
            return [None] * n  # as SGLang: a plain server ignores them
        for i, (boot, item) in enumerate(zip(boots, parsed, strict=True)):
            if not isinstance(boot, Bootstrap):
                raise ValueError(
                    f"request {i}: this server runs disaggregation_mode={mode!r}, so each "
                    "request needs bootstrap_host, bootstrap_port and bootstrap_room"
                )
            try:
                boot.check()
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from None
            if item.params.n > 1:
                raise ValueError(f"request {i}: n > 1 cannot be disaggregated (one room each)")
        return boots

    def _prompt_ids(self, prompt: Prompt, input_ids: InputIds) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass input_ids instead of prompt")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise ValueError(f"prompt {i} is not a string")
                if not text:
                    raise ValueError(f"prompt {i} is empty")
            return single, [self.tokenizer.encode(t) for t in texts]
        assert input_ids is not None
        single = len(input_ids) == 0 or not isinstance(input_ids[0], Sequence)
        batch = [list(input_ids)] if single else [list(ids) for ids in input_ids]  # type: ignore[arg-type]
        return single, batch

    def _parse(self, index: int, ids: list[int], raw: Mapping[str, Any] | None) -> _Parsed:
        vocab = self.vocab_size
        if not ids:
            raise ValueError(f"request {index}: input_ids is empty")
        for tok in ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab:
                raise ValueError(
                    f"request {index}: input_ids holds {tok!r}, outside the vocabulary [0, {vocab})"
                )
        try:
            params = SamplingParams.from_dict(raw)
            params.validate(vocab, context_len=self.context_length, prompt_len=len(ids))
            self.stop_limits.check(params.stop_strings)
        except ValueError as exc:
            raise ValueError(f"request {index}: {exc}") from None
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(
                f"request {index}: stop strings need a tokenizer, and this engine has none "
                "(skip_tokenizer_init, or a checkpoint without tokenizer.json); use "
                "stop_token_ids"
            )
        need = len(ids) + params.max_new_tokens + 2 * self.lookahead
        if need > self.kv_capacity_tokens:
            raise ValueError(
                f"request {index}: prompt + max_new_tokens = {need} tokens exceeds the KV "
                f"pool ({self.kv_capacity_tokens} tokens, max_total_tokens)"
            )
        return _Parsed(ids, params, compiled=self._compile(index, params))

    def _compile(self, index: int, params: SamplingParams) -> Any:
        """The request's grammar, compiled here in the caller's thread (cached by the
        backend), so a bad one is refused before anything is queued and the loop
        thread never compiles."""
        grammar = params.grammar
        if grammar is None:
            return None
        if self.grammars is None:
            raise ValueError(f"request {index}: {grammar[0]}: {self.no_grammar}")
        try:
            return self.grammars().compile(*grammar)
        except ValueError as exc:
            raise ValueError(f"request {index}: {exc}") from None

    def _rids(self, rid: str | Sequence[str] | None, parsed: list[_Parsed]) -> list[list[str]]:
        """One id per request: the caller's (SGLang's ``rid``; with ``n > 1`` the
        copies get ``-1``, ``-2``... suffixes) or a fresh one. Ids in use are refused."""
        if rid is None:
            return [[uuid.uuid4().hex for _ in range(p.params.n)] for p in parsed]
        given = [rid] if isinstance(rid, str) else list(rid)
        if len(given) != len(parsed) or not all(isinstance(r, str) and r for r in given):
            raise ValueError(f"rid needs one non-empty string per prompt ({len(parsed)})")
        out = [
            [r] if p.params.n == 1 else [f"{r}-{i}" for i in range(p.params.n)]
            for r, p in zip(given, parsed, strict=True)
        ]
        flat = [r for ids in out for r in ids]
        clash = sorted({r for r in flat if self.in_use(r) or flat.count(r) > 1})
        if clash:
            raise ValueError(f"rid {clash[0]!r} is already in use")
        return out

    def _check_speculative(self, parsed: list[_Parsed]) -> None:
        """Refuse what the speculative worker cannot serve."""
        if self.spec is None:
            return
        for i, item in enumerate(parsed):
            try:
                self.spec.check_request(
                    item.params, item.return_logprob or item.top_logprobs_num > 0
                )
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from None

    def _request(
        self, item: _Parsed, rid: str, times: bool, text: bool, boot: Bootstrap | None
    ) -> Request:
        detok = (
            IncrementalDetokenizer(
                self.tokenizer, item.prompt_ids, skip_special_tokens=item.params.skip_special_tokens
            )
            if self.tokenizer is not None and (text or item.params.stop_strings)
            else None
        )
        req = Request(
            rid=rid,
            prompt_ids=item.prompt_ids,
            params=item.params,
            stop=StopChecker(item.params.stop_strings, detok),
            return_logprob=item.return_logprob,
            top_logprobs_num=item.top_logprobs_num,
            logprob_start_len=item.logprob_start_len,
            bootstrap=boot,
        )
        if times:
            req.token_times = []
        if item.compiled is not None:
            assert self.grammars is not None
            req.grammar = self.grammars().matcher(item.compiled)
        return req


def _copies(item: _Parsed) -> list[_Parsed]:
    """``n`` independent samples of one prompt, as ``n`` requests (in order). Seeded
    copies get consecutive seeds, so they differ from each other yet reproduce."""
    n = item.params.n
    if n == 1:
        return [item]
    out = []
    for i in range(n):
        seed = None if item.params.seed is None else item.params.seed + i
        params = dataclasses.replace(item.params, n=1, seed=seed)
        out.append(dataclasses.replace(item, params=params))
    return out


def _per_request(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes | Mapping):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
