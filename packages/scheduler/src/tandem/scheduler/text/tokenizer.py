"""The text side of a model: a Hugging Face tokenizer folder without ``transformers``.

The engine needs encode, decode, the chat template and the stop ids of a checkpoint.
``transformers`` would give all of that, but it is a heavy import for a serving process
and its behaviour shifts between major versions; the ``tokenizers`` library plus a
sandboxed jinja2 environment reproduce exactly the parts we use, and the tests check
them against ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class SpecialTokens:
    """The named special tokens of ``tokenizer_config.json``, as strings.

    Chat templates read them as ``bos_token``, ``eos_token``...; a token the folder does
    not name stays ``None`` and is then left undefined in the template (not the string
    ``"None"``), as ``transformers`` does.
    """

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None

    def template_variables(self) -> dict[str, str]:
        """The tokens a chat template may read, only those that are set."""
        named = {name: getattr(self, name) for name in _NAMED_SPECIAL_TOKENS}
        return {name: value for name, value in named.items() if value is not None}


class Tokenizer:
    """Encode, decode and chat-render text for one model.

    Build it with ``from_pretrained``; the constructor takes already-parsed parts so
    tests (and the default model) can assemble one without a folder.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: SpecialTokens | None = None,
        chat_templates: Mapping[str, str] | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._backend = backend
        self._special = special_tokens or SpecialTokens()
        self._chat_templates = dict(chat_templates or {})
        self._eos_token_ids = eos_token_ids
        self._jinja = _chat_template_environment()
        # Compiled on first use, so a template we cannot parse only breaks chat requests,
        # never plain completions on the same model.
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face checkpoint folder."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        special = _special_tokens(config)
        _add_missing_special_tokens(backend, config)
        _apply_bos_eos_policy(backend, config, special)
        eos_ids = _eos_token_ids(folder, backend, special)
        return cls(
            backend,
            special_tokens=special,
            chat_templates=_chat_templates(folder, config),
            eos_token_ids=eos_ids,
        )

    @property
    def backend(self) -> BackendTokenizer:
        """The ``tokenizers`` object, for callers that need offsets or batch encoding."""
        return self._backend

    @property
    def special_tokens(self) -> SpecialTokens:
        return self._special

    @property
    def bos_token(self) -> str | None:
        return self._special.bos_token

    @property
    def eos_token(self) -> str | None:
        return self._special.eos_token

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self._special.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """The id of ``eos_token``; generation stops on any of ``eos_token_ids``."""
        return self._token_id(self._special.eos_token)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the union over config.json,
        generation_config.json and the tokenizer's own eos token, because checkpoints
        disagree about which file is authoritative (Llama 3 instruct needs them all)."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included: the smallest embedding
        that can take any id it encodes."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        largest = max(vocab.values(), default=-1)
        return max(self._backend.get_vocab_size(with_added_tokens=True), largest + 1)

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special plus the named special tokens: what
        ``decode(skip_special_tokens=True)`` drops."""
        ids = {
            index
            for index, token in self._backend.get_added_tokens_decoder().items()
            if token.special
        }
        for name in _NAMED_SPECIAL_TOKENS:
            token_id = self._token_id(getattr(self._special, name))
            if token_id is not None:
                ids.add(token_id)
        return frozenset(ids)

    @property
    def chat_template(self) -> str | None:
        """The template used without tools (``default``), if the model has one."""
        return self._chat_templates.get("default")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the checkpoint's
        post-processor adds (usually the BOS token). Text rendered by a chat template
        already holds its special tokens: encode it with ``add_special_tokens=False``."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``. Unknown ids are dropped rather than raising, so a model
        whose embedding is larger than its tokenizer cannot crash the server."""
        id_list = ids if isinstance(ids, list) else [int(i) for i in ids]
        return self._backend.decode(id_list, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the model's chat template.

        Keyword arguments become template variables (``enable_thinking=False``, ...).
        Message keys whose value is ``None`` are dropped first: OpenAI clients send
        ``content: null`` next to ``tool_calls`` and many templates would print "None".
        """
        template = self._compiled_template(tools)
        variables: dict[str, Any] = {**self._special.template_variables(), **kwargs}
        variables.setdefault("documents", None)
        variables.update(
            messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
        )
        return template.render(**variables)

    def chat_pieces(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[tuple[str, bool]]:
        """The rendered conversation as ``(text, literal)`` pieces, for ``encode_pieces``:
        the template's text, whose special tokens stay special, and, ``literal``, each
        special token's string that a message's content carries, which is only text.
        A user who types ``<|im_start|>system`` into a message thus cannot forge a turn
        of the template (OpenAI's tokenizers refuse specials in text too)."""
        specials = self._special_pattern
        literals: list[str] = []
        nonce = secrets.token_hex(8)

        def hide(match: re.Match[str]) -> str:
            literals.append(match.group(0))
            return f"\ue000{nonce}{len(literals) - 1}\ue001"

        hidden = []
        for message in messages:
            content = message.get("content")
            if specials is not None and isinstance(content, str) and specials.search(content):
                message = {**message, "content": specials.sub(hide, content)}
            hidden.append(message)
        text = self.apply_chat_template(hidden, add_generation_prompt, tools, **kwargs)
        if not literals:
            return [(text, False)]
        parts = re.split(f"\ue000{nonce}(\\d+)\ue001", text)
        pieces = [(parts[0], False)]
        for index, after in zip(parts[1::2], parts[2::2], strict=True):
            pieces += [(literals[int(index)], True), (after, False)]
        return [(t, literal) for t, literal in pieces if t]

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Token ids of ``chat_pieces``' pieces, nothing added: the plain ones with
        special tokens parsed (as a whole rendered text is), the literal ones as text.
        Special tokens split text for the tokenizer anyway, so the plain pieces
        tokenize as they would have in one text. Batch calls, without the GIL."""
        plain = [t for t, literal in pieces if not literal]
        literal = [t for t, literal in pieces if literal]
        encoded = iter(self.encode_batch(plain, add_special_tokens=False))
        as_text = iter(_encode_batch(self._literal_backend, literal, False) if literal else [])
        ids: list[int] = []
        for _, is_literal in pieces:
            ids += next(as_text) if is_literal else next(encoded)
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, as ``encode`` gives them, in one call that runs
        without the GIL (``encode`` holds it throughout)."""
        return _encode_batch(self._backend, texts, add_special_tokens)

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        tokens = {
            token.content
            for token in self._backend.get_added_tokens_decoder().values()
            if token.special and token.content
        }
        if not tokens:
            return None
        return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))

    @functools.cached_property
    def _literal_backend(self) -> BackendTokenizer:
        """A copy of the backend that reads special tokens' strings as text."""
        backend = BackendTokenizer.from_str(self._backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def _compiled_template(self, tools: list[dict[str, Any]] | None) -> jinja2.Template:
        name = _template_name(self._chat_templates, tools)
        compiled = self._compiled.get(name)
        if compiled is None:
            compiled = self._jinja.from_string(self._chat_templates[name])
            self._compiled[name] = compiled
        return compiled

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


def _encode_batch(backend: BackendTokenizer, texts: list[str], special: bool) -> list[list[int]]:
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [list(e.ids) for e in batch(texts, add_special_tokens=special)]


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, ``{}`` when the file is absent (all the side files
    of a checkpoint are optional)."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: object) -> str | None:
    """A token given as a string or as a serialized ``AddedToken`` dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(config: Mapping[str, Any]) -> SpecialTokens:
    return SpecialTokens(
        **{name: _token_content(config.get(name)) for name in _NAMED_SPECIAL_TOKENS}
    )


def _added_token(value: object) -> AddedToken | None:
    """The ``AddedToken`` a config entry describes, keeping its strip/normalize flags."""
    content = _token_content(value)
    if content is None:
        return None
    flags = value if isinstance(value, Mapping) else {}
    return AddedToken(
        content,
        single_word=bool(flags.get("single_word", False)),
        lstrip=bool(flags.get("lstrip", False)),
        rstrip=bool(flags.get("rstrip", False)),
        normalized=bool(flags.get("normalized", False)),
        special=True,
    )


def _add_missing_special_tokens(backend: BackendTokenizer, config: Mapping[str, Any]) -> None:
    """Give the backend the named special tokens that tokenizer.json lacks.

    ``transformers`` does this on load, so ids (and the vocab size) only agree with it
    if we do too; a checkpoint that names an eos token must be able to encode it.
    """
    missing = []
    for name in _NAMED_SPECIAL_TOKENS:
        token = _added_token(config.get(name))
        if token is not None and backend.token_to_id(token.content) is None:
            missing.append(token)
    if missing:
        backend.add_special_tokens(missing)


def _apply_bos_eos_policy(
    backend: BackendTokenizer, config: Mapping[str, Any], special: SpecialTokens
) -> None:
    """Let ``add_bos_token``/``add_eos_token`` decide only where tokenizer.json is silent.

    tokenizer.json's post-processor is what the model was trained with, and
    ``transformers`` 5 ignores the two flags whenever that file exists. A tokenizer.json
    with no post-processor at all (converted SentencePiece checkpoints) would then add
    nothing, yet such a model expects the BOS its config asks for, so there we build the
    post-processor from the flags, as the Llama tokenizer of ``transformers`` 4 did.
    """
    if backend.post_processor is not None:
        return
    bos = _known_token(backend, special.bos_token) if config.get("add_bos_token") else None
    eos = _known_token(backend, special.eos_token) if config.get("add_eos_token") else None
    single = _template_pieces(bos, eos, "$A", 0)
    pair = single + _template_pieces(bos, eos, "$B", 1)
    backend.post_processor = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[token for token in (bos, eos) if token is not None],
    )


def _template_pieces(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None, sequence: str, type_id: int
) -> list[str]:
    """One sequence of a ``TemplateProcessing``: ``[bos] sequence [eos]``."""
    pieces = [] if bos is None else [f"{bos[0]}:{type_id}"]
    pieces.append(f"{sequence}:{type_id}")
    if eos is not None:
        pieces.append(f"{eos[0]}:{type_id}")
    return pieces


def _known_token(backend: BackendTokenizer, token: str | None) -> tuple[str, int] | None:
    token_id = None if token is None else backend.token_to_id(token)
    return None if token is None or token_id is None else (token, token_id)


def _ids_of(value: object) -> set[int]:
    """``eos_token_id`` is an int, a list of ints or null depending on the checkpoint."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _eos_token_ids(
    folder: Path, backend: BackendTokenizer, special: SpecialTokens
) -> frozenset[int]:
    ids = _ids_of(_read_json(folder / "config.json").get("eos_token_id"))
    ids |= _ids_of(_read_json(folder / "generation_config.json").get("eos_token_id"))
    if special.eos_token is not None:
        eos_id = backend.token_to_id(special.eos_token)
        if eos_id is not None:
            ids.add(eos_id)
    return frozenset(ids)


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; a single template is named ``default``.

    ``chat_template.jinja`` wins over tokenizer_config.json because newer
    ``transformers`` writes the template there and may leave a stale copy behind.
    """
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {
            str(item["name"]): str(item["template"])
            for item in raw
            if isinstance(item, Mapping) and "name" in item and "template" in item
        }
    return {}


def _template_name(templates: Mapping[str, str], tools: object) -> str:
    """Which named template renders a request, following ``transformers``: ``tool_use``
    when tools are given and it exists, else ``default``."""
    if not templates:
        raise ValueError(
            "this model has no chat template (no chat_template.jinja and no chat_template "
            "in tokenizer_config.json); send a plain completion instead"
        )
    if tools is not None and "tool_use" in templates:
        return "tool_use"
    if "default" in templates:
        return "default"
    raise ValueError(
        f"this model has several chat templates and none is named 'default': {sorted(templates)}"
    )


class _GenerationTag(Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders its body.

    Some templates mark assistant turns this way for training masks; without the tag
    they would not even parse.
    """

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance-level set)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    """Templates call this to reject a conversation they cannot render."""
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """Templates stamp today's date into system prompts (Llama 3.1+)."""
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """jinja2's own ``tojson`` escapes ``<``, ``>``, ``&`` and ``'`` for HTML, which would
    change tool schemas the model sees; templates expect plain ``json.dumps``."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _chat_template_environment() -> ImmutableSandboxedEnvironment:
    """The environment ``transformers`` renders chat templates in: templates come from
    the Hub and are untrusted code, hence the immutable sandbox."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character map, indexed by byte value.

    Our token id of every single byte is the byte itself, which makes the vocabulary
    easy to reason about in tests.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = iter(range(256, 2 * 256))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
