"""Constrained decoding: the grammar backend over xgrammar.

A request with ``json_schema``, ``regex``, ``ebnf`` or ``structural_tag`` in its sampling
parameters (``SamplingParams.grammar``) gets a ``GrammarMatcher``. Before each sampling step
the matcher writes the tokens the grammar allows next into a row of a packed bitmask
(``fill``), ``apply_bitmask`` sets every other logit to -inf, and the sampled token is fed
back (``accept``); once the grammar is complete only the stop tokens are allowed. One
``GrammarBackend`` per engine caches compiled grammars by ``(kind, text)``, since clients
resend the same schema with every request. xgrammar is imported on first use only.
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.scheduler.sampling.params import GRAMMAR_KINDS
from tandem.scheduler.text.tokenizer import Tokenizer, byte_alphabet

if TYPE_CHECKING:
    import xgrammar

_BITS = 32


class CompiledGrammar:
    """A grammar compiled against the backend's tokenizer; immutable, shared by every
    request that sends the same ``(kind, text)``. Make matchers from it with
    ``GrammarBackend.matcher``."""

    __slots__ = ("_compiled", "kind")

    def __init__(self, kind: str, compiled: xgrammar.CompiledGrammar) -> None:
        self.kind = kind
        self._compiled = compiled

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.kind}, {self._compiled.memory_size_bytes} bytes)"


class GrammarMatcher:
    """One request's position in its grammar.

    Not thread-safe: a matcher belongs to one request and is driven by one thread at a
    time (different matchers may be used from different threads).
    """

    __slots__ = ("_matcher", "_refused", "_stop_mask")

    def __init__(
        self, matcher: xgrammar.GrammarMatcher, stop_mask: torch.Tensor, refused: bytearray
    ) -> None:
        self._matcher = matcher
        self._stop_mask = stop_mask
        self._refused = refused

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar does not allow
        it here, the id is not in the vocabulary, or the matcher has terminated."""
        token = int(token)
        # xgrammar would refuse these too, but logs a warning to stderr for each.
        if not 0 <= token < len(self._refused) or self._refused[token]:
            return False
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(token))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (a CPU int32 bitmask from
        ``GrammarBackend.new_bitmask``). A terminated matcher allows only the stop
        tokens (every token when the model has none: the caller must end the request)."""
        if self._matcher.is_terminated():
            # xgrammar raises here; the step may still sample for a finished request.
            bitmask[row, : self._stop_mask.shape[0]] = self._stop_mask
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` accepted tokens (a retracted request, rejected draft
        tokens), the stop token included. xgrammar keeps the whole history, so any
        number up to the tokens accepted so far works; more raises ValueError."""
        if tokens < 0:
            raise ValueError(f"rollback: cannot roll back {tokens} tokens")
        if tokens == 0:
            return
        try:
            self._matcher.rollback(tokens)
        except RuntimeError as exc:
            raise ValueError(f"rollback: {_clean_message(exc)}") from exc

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token has been accepted."""
        return bool(self._matcher.is_terminated())

    @property
    def completed(self) -> bool:
        """The text so far is a complete match (a stop token may follow), whether or not
        the stop token has been accepted."""
        return bool(self._matcher.is_completed())


class GrammarBackend:
    """One per engine: the tokenizer's xgrammar info, the compiler, a cache of compiled
    grammars by ``(kind, text)``.

    Kinds (``GRAMMAR_KINDS``) and the text each takes:

    - ``json_schema``: a JSON schema as JSON text (an object, or ``true``).
      Whitespace between JSON tokens is free up to ``json_max_whitespace`` characters
      per gap (enough to pretty-print; unbounded, a weak model can emit whitespace
      until it runs out of tokens); properties come in the schema's order and, unless
      the schema says otherwise, no others are allowed (xgrammar's strict mode).
    - ``regex``: a regular expression the whole output must match (no backreferences
      or lookaround).
    - ``ebnf``: a GBNF/EBNF grammar (llama.cpp's syntax) with a rule named ``root``.
    - ``structural_tag``: xgrammar's structural tag as JSON text, one of

      - ``{"type": "structural_tag", "format": {...}}`` (xgrammar 0.2's format; the
        ``"type"`` may be left out), where the format is any of xgrammar's formats:
        ``const_string``, ``json_schema``, ``regex``, ``grammar``, ``any_text``,
        ``sequence``, ``or``, ``tag``, ``triggered_tags``, ``tags_with_separator``,
        ``token``, ``optional``, ``star``, ... e.g.
        ``{"type": "structural_tag", "format": {"type": "triggered_tags",
        "triggers": ["<tool_call>"], "tags": [{"begin": "<tool_call>", "content":
        {"type": "json_schema", "json_schema": {...}}, "end": "</tool_call>"}]}}``;
      - a bare format object such as ``{"type": "triggered_tags", ...}``;
      - the older form SGLang and OpenAI-style clients send:
        ``{"structures": [{"begin": "<tool_call>", "schema": {...},
        "end": "</tool_call>"}], "triggers": ["<tool_call>"]}`` (optionally with
        ``"type": "structural_tag"``): free text in which each trigger starts the
        structure whose ``begin`` it prefixes.

    Special tokens (``<|im_start|>``, ``<s>``...) other than the stop tokens are never
    allowed under a JSON schema, regex or EBNF grammar: their text is dropped when the
    output is detokenized, so the text would no longer match. Under a structural tag
    they are ordinary tokens, so tags and ``token`` formats can name them (tool-call
    markers often are special tokens).

    Args:
        tokenizer_path: the checkpoint folder holding ``tokenizer.json``.
        vocab_size: the model's vocabulary (the logits' width), which may exceed the
            tokenizer's (padding, never allowed) or fall short of it (ids past it are
            never allowed).
        eos_ids: the tokens that end generation; the only ones allowed once the
            grammar is complete. With none, a matcher terminates as soon as its
            grammar is complete.
        cache_size: compiled grammars kept, least recently used dropped first.
        max_threads: threads xgrammar uses to compile one grammar.
        json_max_whitespace: whitespace characters allowed between two JSON tokens
            under a ``json_schema`` (None: any number; 0: the compact
            ``{"a": 1, "b": [2, 3]}`` layout only).
    """

    def __init__(
        self,
        tokenizer_path: Path,
        vocab_size: int,
        eos_ids: Collection[int],
        cache_size: int = 256,
        *,
        max_threads: int = 8,
        json_max_whitespace: int | None = 16,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self._tokenizer_path = Path(tokenizer_path)
        self._vocab_size = vocab_size
        self._stop_ids = tuple(sorted({int(t) for t in eos_ids if 0 <= t < vocab_size}))
        self._cache_size = cache_size
        self._max_threads = max_threads
        self._json_max_whitespace = json_max_whitespace
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self._vocab: _Vocab | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def compile(self, kind: str, text: str) -> CompiledGrammar:
        """The compiled grammar for ``(kind, text)``, from the cache when it is there.

        Raises ValueError whose message starts with ``kind`` for any input xgrammar
        cannot compile (the server answers it with a 400). Thread-safe; xgrammar
        releases the GIL while compiling, and two threads asking for the same grammar
        at once compile it once.
        """
        if kind not in GRAMMAR_KINDS:
            raise ValueError(f"{kind}: not a grammar kind (one of {', '.join(GRAMMAR_KINDS)})")
        if not isinstance(text, str):
            raise ValueError(f"{kind}: must be a string, got {type(text).__name__}")
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            pending = self._pending.get(key)
            owner = pending is None
            if pending is None:
                pending = self._pending[key] = Future()
        if not owner:
            return pending.result()
        try:
            compiled = CompiledGrammar(kind, self._compile(kind, text))
            self._check_satisfiable(compiled)
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._pending[key]
            if self._cache_size > 0:
                self._cache[key] = compiled
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        pending.set_result(compiled)
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""
        import xgrammar

        vocab = self._loaded()
        matcher = xgrammar.GrammarMatcher(
            compiled._compiled, terminate_without_stop_token=not self._stop_ids
        )
        refused = vocab.refused_tagged if compiled.kind == "structural_tag" else vocab.refused
        return GrammarMatcher(matcher, vocab.stop_mask, refused)

    def _check_satisfiable(self, compiled: CompiledGrammar) -> None:
        """Refuse a grammar that allows no first token (``root ::= root "a"``): every
        logit would be -inf."""
        matcher = self.matcher(compiled)
        if matcher.completed:
            return
        bitmask = self.new_bitmask(1)
        matcher.fill(bitmask, 0)
        if not bool(bitmask.any()):
            raise ValueError(f"{compiled.kind}: the grammar matches no text")

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 CPU bitmask ``[rows, ceil(vocab_size / 32)]``, every token allowed:
        bit ``t % 32`` of word ``t // 32`` is token ``t``."""
        return torch.full((rows, math.ceil(self._vocab_size / _BITS)), -1, dtype=torch.int32)

    def _compile(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        vocab = self._loaded()
        if kind == "structural_tag":
            tag = _structural_tag(text)
            tag = _without_raw_controls(json.loads(tag), tag)
            compile_tag = vocab.tag_compiler().compile_structural_tag
            return _xgrammar_call(kind, "invalid structural tag", compile_tag, tag)
        compiler = vocab.compiler
        if kind == "json_schema":
            text = _without_raw_controls(_parse_schema(text), text)
            spaces = self._json_max_whitespace
            compile_schema = functools.partial(
                compiler.compile_json_schema,
                any_whitespace=spaces != 0,
                max_whitespace_cnt=spaces or None,
            )
            return _xgrammar_call(kind, "unsupported schema", compile_schema, text)
        if kind == "regex":
            return _xgrammar_call(kind, "invalid regular expression", compiler.compile_regex, text)
        return _xgrammar_call(kind, "invalid grammar", compiler.compile_grammar, text)

    def _loaded(self) -> _Vocab:
        vocab = self._vocab
        if vocab is None:
            with self._lock:
                if self._vocab is None:
                    self._vocab = _Vocab.load(
                        self._tokenizer_path, self._vocab_size, self._stop_ids, self._max_threads
                    )
                vocab = self._vocab
        return vocab


class _Vocab:
    """xgrammar's view of the tokenizer, built once: two tokenizer infos (special tokens
    hidden, for schemas, regexes and EBNF; visible, for structural tags) and a
    compiler for each, the tagged one built when the first structural tag comes."""

    def __init__(
        self,
        hidden: xgrammar.TokenizerInfo,
        visible_vocab: list[str],
        vocab_type: xgrammar.VocabType,
        add_prefix_space: bool,
        stop_ids: tuple[int, ...],
        max_threads: int,
    ) -> None:
        import xgrammar

        self._visible_vocab = visible_vocab
        self._vocab_type = vocab_type
        self._add_prefix_space = add_prefix_space
        self._stop_ids = stop_ids
        self._max_threads = max_threads
        self._lock = threading.Lock()
        self._tag_compiler: xgrammar.GrammarCompiler | None = None
        # Our own LRU caches compiled grammars; xgrammar's cache would never shrink.
        self.compiler = xgrammar.GrammarCompiler(
            hidden, max_threads=max_threads, cache_enabled=False
        )
        self.refused = _refused(hidden)
        self.stop_mask = _stop_mask(stop_ids, hidden.vocab_size)
        self.refused_tagged = bytearray(len(self.refused))
        for token, text in enumerate(visible_vocab):
            self.refused_tagged[token] = not text and token not in stop_ids

    @classmethod
    def load(cls, path: Path, vocab_size: int, stop_ids: tuple[int, ...], threads: int) -> _Vocab:
        import xgrammar

        tokenizer = Tokenizer.from_pretrained(path)
        backend = tokenizer.backend
        pipeline = json.loads(backend.to_str())
        token_ids = backend.get_vocab(with_added_tokens=True)
        vocab_type = _vocab_type(pipeline, token_ids)
        add_prefix_space = _adds_prefix_space(pipeline)
        visible = [""] * vocab_size
        for token, index in token_ids.items():
            if index < vocab_size:
                visible[index] = token
        added = backend.get_added_tokens_decoder()
        byte_level = vocab_type == xgrammar.VocabType.BYTE_LEVEL
        alphabet = byte_alphabet() if byte_level else None
        for index, added_token in added.items():
            if index < vocab_size:
                visible[index] = _encode_added(added_token.content, alphabet)
        hidden = list(visible)
        special = tokenizer.all_special_ids | {i for i, t in added.items() if t.special}
        for index in special:
            if index < vocab_size and index not in stop_ids:
                hidden[index] = ""
        info = xgrammar.TokenizerInfo(
            hidden,
            vocab_type,
            vocab_size=vocab_size,
            stop_token_ids=list(stop_ids),
            add_prefix_space=add_prefix_space,
        )
        return cls(info, visible, vocab_type, add_prefix_space, stop_ids, threads)

    def tag_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        with self._lock:
            if self._tag_compiler is None:
                info = xgrammar.TokenizerInfo(
                    self._visible_vocab,
                    self._vocab_type,
                    vocab_size=len(self._visible_vocab),
                    stop_token_ids=list(self._stop_ids),
                    add_prefix_space=self._add_prefix_space,
                )
                self._tag_compiler = xgrammar.GrammarCompiler(
                    info, max_threads=self._max_threads, cache_enabled=False
                )
            return self._tag_compiler


def _refused(info: xgrammar.TokenizerInfo) -> bytearray:
    """One byte per token id: 1 where xgrammar never accepts the token (special or
    padding ids), so ``accept`` can refuse it without xgrammar's warning."""
    refused = bytearray(info.vocab_size)
    for token in info.special_token_ids:
        refused[token] = 1
    return refused


def _stop_mask(stop_ids: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """A bitmask row allowing only ``stop_ids``, or every token when there are none."""
    words = [0] * math.ceil(vocab_size / _BITS)
    for token in stop_ids:
        words[token // _BITS] |= 1 << (token % _BITS)
    if not stop_ids:
        words = [(1 << _BITS) - 1] * len(words)
    # A word with bit 31 set is a negative int32.
    signed = [w - (1 << _BITS) if w >= 1 << (_BITS - 1) else w for w in words]
    return torch.tensor(signed, dtype=torch.int32)


def _vocab_type(pipeline: Mapping[str, Any], token_ids: Mapping[str, int]) -> xgrammar.VocabType:
    """How vocabulary strings spell bytes: GPT-2's byte-to-character map (byte-level
    BPE), SentencePiece's ``▁`` and ``<0xNN>`` pieces (byte fallback), or plainly.

    A vocabulary with the byte pieces is byte fallback whatever the decoder says;
    otherwise tokenizer.json's decoder tells, as xgrammar's own detection reads it.
    """
    import xgrammar

    byte_pieces = sum(f"<0x{byte:02X}>" in token_ids for byte in range(256))
    if byte_pieces >= 128:
        return xgrammar.VocabType.BYTE_FALLBACK
    for part in _flatten(pipeline.get("decoder"), "decoders"):
        if part.get("type") == "ByteLevel":
            return xgrammar.VocabType.BYTE_LEVEL
        if part.get("type") == "ByteFallback":
            return xgrammar.VocabType.BYTE_FALLBACK
    return xgrammar.VocabType.RAW


def _adds_prefix_space(pipeline: Mapping[str, Any]) -> bool:
    """Whether encoding puts a ``▁`` before the text (SentencePiece style)."""
    for part in _flatten(pipeline.get("normalizer"), "normalizers"):
        if part.get("type") == "Prepend" and part.get("prepend") == "▁":
            return True
    for part in _flatten(pipeline.get("pre_tokenizer"), "pretokenizers"):
        if part.get("type") == "Metaspace" and part.get("prepend_scheme") in ("always", "first"):
            return True
    return False


def _flatten(step: object, members: str) -> list[Mapping[str, Any]]:
    if not isinstance(step, Mapping):
        return []
    if step.get("type") == "Sequence":
        return [part for part in step.get(members) or [] if isinstance(part, Mapping)]
    return [step]


def _encode_added(content: str, alphabet: list[str] | None) -> str:
    """An added token's text spelled as the vocabulary spells its tokens: added tokens
    are stored as plain text, but xgrammar decodes every entry by the vocabulary type,
    which for byte-level BPE is ``alphabet`` (GPT-2's byte-to-character map)."""
    if alphabet is None:
        return content
    return "".join(alphabet[byte] for byte in content.encode("utf-8"))


def _parse_schema(text: str) -> Any:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema: not valid JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise ValueError(
            f"json_schema: a schema is a JSON object or boolean, got {type(schema).__name__}"
        )
    return schema


# What a JSON string's characters may be, unescaped: no quote, backslash or control.
_PLAIN_CHARACTER = r'[^"\\\x00-\x1f]'
_LENGTH_ONLY = frozenset({"type", "minLength", "maxLength", "title", "description", "default"})


def _without_raw_controls(value: Any, text: str) -> str:
    """``text``, whose JSON is ``value`` (a schema, or a structural tag holding schemas;
    rewritten in place), with every string schema bounded only by ``minLength`` and
    ``maxLength`` turned into the same bounds on a pattern of plain characters.
    xgrammar (0.2.8 and 0.2.9) compiles such strings to a character class that admits
    raw control characters, which no JSON string may hold; its patterns exclude them.
    Like xgrammar's own bounded strings, these take no escape sequences."""
    return json.dumps(value) if _bound_strings(value) else text


def _bound_strings(value: Any) -> bool:
    """Rewrite in place; whether anything changed."""
    changed = False
    if isinstance(value, dict):
        low, high = value.get("minLength", 0), value.get("maxLength")
        if (
            value.get("type") == "string"
            and ("minLength" in value or "maxLength" in value)
            and set(value) <= _LENGTH_ONLY
            and isinstance(low, int)
            and (high is None or isinstance(high, int))
        ):
            del value["type"]
            value.pop("minLength", None)
            value.pop("maxLength", None)
            bounds = f"{low}," if high is None else f"{low},{high}"
            value.update(type="string", pattern=f"^{_PLAIN_CHARACTER}{{{bounds}}}$")
            return True
        for item in value.values():
            changed = _bound_strings(item) or changed
    elif isinstance(value, list):
        for item in value:
            changed = _bound_strings(item) or changed
    return changed


def _structural_tag(text: str) -> str:
    """``text`` in xgrammar 0.2's structural tag form (see ``GrammarBackend``)."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structural_tag: not valid JSON: {exc}") from exc
    if not isinstance(tag, dict):
        raise ValueError(f"structural_tag: must be a JSON object, got {type(tag).__name__}")
    if "structures" in tag:
        return json.dumps(_from_structures(tag))
    if "format" not in tag and tag.get("type", "structural_tag") != "structural_tag":
        return json.dumps({"type": "structural_tag", "format": tag})
    return text


def _from_structures(tag: Mapping[str, Any]) -> dict[str, Any]:
    """The older ``{"structures": [...], "triggers": [...]}`` form as triggered tags."""
    structures = tag["structures"]
    triggers = tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag: structures must be a non-empty list")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag: triggers must be a list of non-empty strings")
    extra = set(tag) - {"type", "structures", "triggers"}
    if extra:
        raise ValueError(f"structural_tag: unknown key(s) {', '.join(sorted(extra))}")
    tags = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or not {"begin", "schema", "end"} <= set(item):
            raise ValueError(
                f"structural_tag: structures[{i}] must be an object with begin, schema and end"
            )
        begin, schema, end = item["begin"], item["schema"], item["end"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"structural_tag: structures[{i}].schema is not valid JSON: {exc}"
                ) from exc
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ValueError(f"structural_tag: structures[{i}] begin and end must be strings")
        if not isinstance(schema, dict | bool):
            raise ValueError(
                f"structural_tag: structures[{i}].schema must be a JSON object or boolean"
            )
        content = {"type": "json_schema", "json_schema": schema}
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags},
    }


def _xgrammar_call(kind: str, what: str, compile_fn: Any, text: str) -> xgrammar.CompiledGrammar:
    try:
        compiled: xgrammar.CompiledGrammar = compile_fn(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"{kind}: {what}: {_clean_message(exc)}") from exc
    return compiled


# xgrammar's C++ errors read "[21:40:40] /project/cpp/regex_converter.cc:83: Check
# failed: (cond) is false: what went wrong"; the client needs only the last part.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: (Invalid structural tag error: )?")
_MAX_MESSAGE = 500


def _clean_message(exc: BaseException) -> str:
    message = str(exc).strip()
    message = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", message)).strip()
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "..."
    return message or type(exc).__name__


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    Row ``rows[i]`` of ``logits`` is masked by ``bitmask[i]`` (with ``rows`` None, row
    ``i`` by ``bitmask[i]`` for every row of ``logits``); other rows are left alone.
    ``rows`` must be distinct. Logit columns past the bitmask's tokens (a logits
    tensor wider than the vocabulary) are disallowed too. The bitmask may stay on the
    CPU when the logits are on an accelerator; it is copied over.
    """
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(
            f"apply_bitmask: logits and bitmask must be 2-D, got {logits.dim()}-D "
            f"and {bitmask.dim()}-D"
        )
    count = logits.shape[0] if rows is None else len(rows)
    if count == 0:
        return
    if bitmask.shape[0] < count:
        raise ValueError(f"apply_bitmask: {count} rows to mask but {bitmask.shape[0]} masks")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    indices: list[int] | None = None
    if rows is None or list(rows) == list(range(count)):
        target, masks = logits[:count], bitmask[:count]
    else:
        # xgrammar masks logits[r] with bitmask[r]; spread our masks to their rows.
        indices = [int(r) for r in rows]
        target = logits
        masks = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)
        masks[torch.tensor(indices, device=bitmask.device)] = bitmask[:count]
    covered = min(logits.shape[1], bitmask.shape[1] * _BITS)
    if _xgrammar_kernel_supports(target):
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(target, masks, vocab_size=covered, indices=indices)
    else:
        _apply_bitmask_torch(target, masks, covered, indices)
    if covered < logits.shape[1]:
        if indices is None:
            target[:, covered:] = float("-inf")
        else:
            target[torch.tensor(indices, device=logits.device), covered:] = float("-inf")


def _xgrammar_kernel_supports(logits: torch.Tensor) -> bool:
    """xgrammar's kernels: a CPU one for float32, float16 and bfloat16, and a Triton
    one on CUDA (ROCm included)."""
    if logits.device.type == "cpu":
        return logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return logits.device.type == "cuda"


def _apply_bitmask_torch(
    logits: torch.Tensor, masks: torch.Tensor, covered: int, indices: list[int] | None
) -> None:
    """The same operation in plain torch, for dtypes and devices xgrammar lacks."""
    chosen = masks if indices is None else masks[torch.tensor(indices, device=masks.device)]
    shifts = torch.arange(_BITS, device=masks.device, dtype=torch.int32)
    allowed = ((chosen.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :covered]
    if indices is None:
        logits[:, :covered].masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(indices, device=logits.device)
        logits[index, :covered] = logits[index, :covered].masked_fill(~allowed, float("-inf"))
