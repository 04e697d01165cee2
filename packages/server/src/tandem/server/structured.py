"""Structured outputs on the OpenAI routes: ``response_format`` and SGLang's grammar
fields, as the one grammar sampling parameter the engine honours.

The engine takes at most one of ``json_schema``, ``regex``, ``ebnf`` and
``structural_tag`` (``SamplingParams``); this module maps a body onto it, or refuses
the body with a 400 naming the field before anything is scheduled. Whether a grammar
compiles is the engine's to say (also a 400). See docs/guides/structured-outputs.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tandem.scheduler.sampling.params import GRAMMAR_KINDS
from tandem.server.errors import APIError

ANY_JSON_OBJECT = json.dumps({"type": "object"})
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
# Kinds whose text is JSON: a client may send the object itself on the OpenAI routes.
_JSON_KINDS = frozenset({"json_schema", "structural_tag"})


def openai_grammar(body: Mapping[str, Any]) -> dict[str, str]:
    """The grammar of an OpenAI body as sampling params (``{}``: free output), from
    ``response_format`` or SGLang's extra fields (``regex``, ``ebnf``, ``json_schema``,
    ``structural_tag``), of which at most one may be given."""
    from_format = response_format(body.get("response_format"))
    extras = grammar_extras(body)
    if from_format and extras:
        kind = next(iter(extras))
        raise APIError(
            f"response_format cannot be combined with {kind}: pass one constraint",
            param=kind,
        )
    return from_format or extras


def grammar_extras(body: Mapping[str, Any]) -> dict[str, str]:
    """SGLang's grammar fields given at the top level of an OpenAI body."""
    found: dict[str, str] = {}
    for kind in GRAMMAR_KINDS:
        value = body.get(kind)
        if value is None:
            continue
        if kind in _JSON_KINDS and isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str):
            what = "a string or a JSON object" if kind in _JSON_KINDS else "a string"
            raise APIError(f"{kind} must be {what}", param=kind)
        if found:
            raise APIError(
                f"only one of {', '.join(GRAMMAR_KINDS)} may be given; got "
                f"{next(iter(found))} and {kind}",
                param=kind,
            )
        found[kind] = value
    return found


def response_format(value: Any) -> dict[str, str]:
    """OpenAI's ``response_format`` as sampling params: ``text`` is none, ``json_object``
    any JSON object, ``json_schema`` its schema, and SGLang's ``structural_tag`` the
    object itself (xgrammar's structural tag)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise APIError("response_format must be an object", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        if value.get("json_schema") is not None or value.get("schema") is not None:
            raise APIError(
                "response_format has both a schema and type json_object: json_object is "
                'any JSON object; for a schema, send {"type": "json_schema", "json_schema": '
                '{"name": ..., "schema": {...}}}',
                param="response_format.type",
            )
        return {"json_schema": ANY_JSON_OBJECT}
    if kind == "json_schema":
        return {"json_schema": json.dumps(_schema_of(value.get("json_schema")))}
    if kind == "structural_tag":
        if not ("format" in value or "structures" in value):
            raise APIError(
                "response_format of type structural_tag needs a format (xgrammar's "
                "structural tag) or structures and triggers",
                param="response_format",
            )
        return {"structural_tag": json.dumps(value)}
    allowed = ", ".join(RESPONSE_FORMAT_TYPES)
    if not isinstance(kind, str):
        raise APIError(
            f"response_format.type must be one of {allowed}", param="response_format.type"
        )
    raise APIError(
        f"response_format.type must be one of {allowed}; got {kind[:60]!r}",
        param="response_format.type",
    )


def _schema_of(spec: Any) -> dict[str, Any]:
    where = "response_format.json_schema"
    if spec is None:
        raise APIError(
            f"{where} is required when response_format.type is json_schema "
            '({"name": ..., "schema": {...}})',
            param=where,
        )
    if not isinstance(spec, dict):
        raise APIError(f"{where} must be an object", param=where)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(f"{where}.name must be a non-empty string", param=f"{where}.name")
    for key, kind, what in (("strict", bool, "a boolean"), ("description", str, "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise APIError(f"{where}.{key} must be {what}", param=f"{where}.{key}")
    schema = spec.get("schema")
    if schema is None:
        raise APIError(
            f"{where}.schema is required: the JSON Schema the output must match",
            param=f"{where}.schema",
        )
    if not isinstance(schema, dict):
        raise APIError(
            f"{where}.schema must be a JSON object (a JSON Schema)", param=f"{where}.schema"
        )
    return schema
