"""Structured output: the request fields that constrain a choice's text, as
the ``GrammarSpec`` the workers compile (xgrammar), or a 400 naming the field.

- ``response_format`` (OpenAI, chat): ``{"type": "text"}``,
  ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}``;
- ``structured_outputs`` (extension, chat and completions; vLLM's names):
  exactly one of ``{"json": SCHEMA}``, ``{"json_object": true}``,
  ``{"regex": PATTERN}``, ``{"choice": [STRINGS]}``, ``{"grammar": EBNF}``,
  ``{"structural_tag": TAG}``.

A schema is always enforced (with or without ``strict``): the output of a
choice that ends with "stop" validates against it. What the gateway cannot
check (a grammar that does not compile) the workers refuse, and the gateway
answers 400 naming the field here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import msgspec

from gateway.openai.choices import ChoiceEvent
from gateway.openai.errors import APIError, request_timeout
from protocol.sampling import GrammarSpec, InvalidSamplingParams, SamplingParams

MAX_SPEC_CHARS = 200_000
"""Longest grammar text (a schema as JSON, a pattern, a grammar)."""

STRUCTURED_KINDS = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "ebnf",
    "structural_tag": "structural_tag",
}
"""``structured_outputs`` keys and the grammar kind each one gives."""


class Constraint(NamedTuple):
    """A choice's grammar and the request field it came from (None, None: free text)."""

    grammar: GrammarSpec | None = None
    param: str | None = None


def response_format_grammar(value: Any) -> GrammarSpec | None:
    """The grammar of a ``response_format`` (None: free text)."""
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError(400, "response_format must be an object with a 'type'", param=param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise APIError(
            400,
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(
            400,
            "response_format.json_schema must be an object with the schema under 'schema'",
            param="response_format.json_schema",
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise APIError(
            400, "json_schema.name must be a string", param="response_format.json_schema.name"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(
            400, "json_schema.strict must be a boolean", param="response_format.json_schema.strict"
        )
    schema = spec.get("schema", {"type": "object"})
    return GrammarSpec("json_schema", _schema_text(schema, "response_format.json_schema.schema"))


def structured_outputs_grammar(value: Any) -> GrammarSpec | None:
    """The grammar of the ``structured_outputs`` extension (None: absent)."""
    param = "structured_outputs"
    if value is None:
        return None
    given = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else None
    if given is None or len(given) != 1 or next(iter(given)) not in STRUCTURED_KINDS:
        raise APIError(
            400,
            f"structured_outputs must be an object with exactly one of "
            f"{', '.join(STRUCTURED_KINDS)}",
            param=param,
        )
    key, v = next(iter(given.items()))
    where = f"{param}.{key}"
    kind = STRUCTURED_KINDS[key]
    if key == "json":
        # A schema may come as JSON text too (as vLLM takes it).
        if isinstance(v, str):
            v = _parse(v, where)
        return GrammarSpec(kind, _schema_text(v, where))
    if key == "json_object":
        if v is not True:
            raise APIError(400, f"{where} must be true", param=where)
        return GrammarSpec(kind)
    if key == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise APIError(
                400, f"{where} must be a non-empty list of non-empty strings", param=where
            )
        return GrammarSpec(kind, _limited(json.dumps(v), where))
    if key == "structural_tag":
        if isinstance(v, dict):
            v = json.dumps(v)
        if not isinstance(v, str):
            raise APIError(400, f"{where} must be an object or its JSON text", param=where)
        _parse(v, where)
        return GrammarSpec(kind, _limited(v, where))
    if not isinstance(v, str) or not v:
        raise APIError(400, f"{where} must be a non-empty string", param=where)
    return GrammarSpec(kind, _limited(v, where))


def _schema_text(schema: Any, param: str) -> str:
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{param} must be a JSON schema (an object)", param=param)
    return _limited(json.dumps(schema, ensure_ascii=False), param)


def _parse(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise APIError(400, f"{param} is not valid JSON: {e}", param=param) from None


def _limited(text: str, param: str) -> str:
    if len(text) > MAX_SPEC_CHARS:
        raise APIError(400, f"{param} is longer than {MAX_SPEC_CHARS} characters", param=param)
    return text


def one_constraint(*candidates: Constraint) -> Constraint:
    """The one grammar among those the request's fields give; two is a 400."""
    given = [c for c in candidates if c.grammar is not None]
    if len(given) > 1:
        raise APIError(
            400,
            f"{given[0].param} and {given[1].param} both constrain the output; give one",
            param=given[1].param,
        )
    return given[0] if given else Constraint()


def with_grammar(params: SamplingParams, grammar: GrammarSpec) -> SamplingParams:
    try:
        return msgspec.structs.replace(params, grammar=grammar)
    except InvalidSamplingParams as e:
        raise APIError(400, str(e), param=e.param) from None


async def first_event_checked(
    events: AsyncIterator[ChoiceEvent], timeout_s: float
) -> AsyncIterator[ChoiceEvent]:
    """``events`` after waiting for its first event here, so that a request
    the workers refuse (an ``APIError``) is answered before a stream begins."""
    try:
        first = await asyncio.wait_for(anext(events), timeout_s)
    except TimeoutError:
        await events.aclose()  # type: ignore[attr-defined]
        raise request_timeout(timeout_s) from None
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise

    async def chained() -> AsyncIterator[ChoiceEvent]:
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            yield first
            async for ev in events:
                yield ev

    return chained()
