"""JSON schemas to compiled llguidance grammars, decided before the request is queued.

Every problem a schema can have is a 400 naming the field, found here: size and nesting limits
(checked by a walk that cannot recurse), what llguidance refuses, and a compile over the time
budget. The compile itself runs on the engine's ``GrammarCompiler`` workers, so neither the
event loop nor the engine thread ever waits on it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from veloxquant_mlx.engine.request.grammar import Grammar, GrammarBusyError, GrammarError
from veloxquant_mlx.server.errors import APIError
from veloxquant_mlx.server.schemas import ResponseFormat

# Compact JSON: no free whitespace between tokens. Under a grammar that allows it, a weak model
# can spend its whole max_tokens on spaces and newlines (seen with random sampling here).
COMPACT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
}

# OpenAI's structured-output limits, but for nesting (theirs is 10 schema levels; a nesting of
# 64 JSON containers is about 30 schema levels, and keeps every walk far from Python's limit).
MAX_NESTING = 64
MAX_PROPERTIES = 5_000
# llguidance branches over every optional property at each key of an object, and over those of
# every alternative of an anyOf (about four parser items a property, against its row limit of
# 2,000): past this, decoding fails at the first key.
MAX_OPTIONAL_PROPERTIES = 400
MAX_ENUM_VALUES = 1_000
MAX_STRING_CHARS = 120_000  # property names, enum values and consts, all together


def check_schema(schema: Any, param: str) -> None:
    """Refuse a schema over the limits above, before any recursive code sees it. O(schema).

    Raises:
        APIError: 400 naming ``param`` and the limit.
    """
    n_properties = n_chars = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise _too_big(param, f"is nested deeper than {MAX_NESTING} levels")
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        properties = node.get("properties")
        if isinstance(properties, dict):
            n_properties += len(properties)
            n_chars += sum(len(str(k)) for k in properties)
        # The keys an object may start with: its optional properties, or those of all the
        # objects an anyOf / oneOf offers there.
        choices = [node, *(a for k in ("anyOf", "oneOf") for a in _list(node.get(k)))]
        if sum(_n_optional(c) for c in choices) > MAX_OPTIONAL_PROPERTIES:
            raise _too_big(
                param,
                f"offers more than {MAX_OPTIONAL_PROPERTIES} optional properties at one key "
                "(list them in 'required', or split the object)",
            )
        enum = node.get("enum")
        if isinstance(enum, list):
            if len(enum) > MAX_ENUM_VALUES:
                raise _too_big(param, f"has an enum of more than {MAX_ENUM_VALUES} values")
            n_chars += sum(len(json.dumps(v)) for v in enum)
        if "const" in node:
            n_chars += len(json.dumps(node["const"]))
        if n_properties > MAX_PROPERTIES:
            raise _too_big(param, f"has more than {MAX_PROPERTIES} properties")
        if n_chars > MAX_STRING_CHARS:
            raise _too_big(
                param, f"has more than {MAX_STRING_CHARS} characters of names, enums and consts"
            )
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples"):
                stack.append((value, depth + 1))


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _n_optional(node: Any) -> int:
    """Properties of the object ``node`` not in its ``required`` list (0 for anything else)."""
    properties = node.get("properties") if isinstance(node, dict) else None
    if not isinstance(properties, dict):
        return 0
    required = node.get("required")
    names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    return len(properties) - len(names & set(properties))


def _unconstrained(param: str) -> APIError:
    return APIError(
        400,
        "constrained decoding (structured outputs, forced tool calls) is not supported for "
        "this model's tokenizer",
        code="unsupported_value",
        param=param,
    )


def _too_big(param: str, what: str) -> APIError:
    return APIError(400, f"the JSON schema {what}", code="invalid_value", param=param)


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists properties
    and says nothing about others (vLLM's xgrammar does the same by default). JSON Schema allows
    extra keys unless told otherwise, and a weak model then writes keys nobody asked for; the
    clients that send schemas (the SDK's ``parse``, instructor, LangChain, pydantic-ai) mean
    only the fields they declare. A schema that sets ``additionalProperties`` keeps it.
    Recursive: call it on a schema ``check_schema`` passed (its nesting is bounded)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k != "const" and k != "enum" and k != "default" else v
           for k, v in schema.items()}  # fmt: skip
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def schema_grammar(schema: Any, param: str) -> str:
    """The llguidance grammar (text) for a JSON ``schema`` of the field ``param``.

    Raises:
        APIError: 400 for a schema over the limits or one llguidance cannot read.
    """
    import llguidance

    check_schema(schema, param)
    if not isinstance(schema, dict):
        raise APIError(400, "a JSON schema must be an object", code="invalid_value", param=param)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(closed(schema)),
            defaults=COMPACT,  # type: ignore[arg-type]
        )
    except (ValueError, TypeError) as exc:
        raise APIError(
            400, f"invalid JSON schema: {exc}", code="invalid_value", param=param
        ) from None


async def compile_grammar(engine: Any, text: str, param: str, timeout: float) -> Grammar:
    """``text`` compiled by the engine's ``GrammarCompiler``, waited for at most ``timeout``
    seconds (the compile goes on, and is cached, if the wait ends first).

    Raises:
        APIError: 400 when the model cannot be constrained, the grammar is refused or its
            compile outlasts ``timeout``; 503 with Retry-After when the compiler is full.
    """
    grammars = engine.grammars
    if grammars is None:
        raise _unconstrained(param)
    try:
        future = grammars.submit(text)
    except GrammarBusyError:
        raise APIError(
            503,
            "too many structured-output requests are compiling; try again shortly",
            code="server_busy",
            headers={"Retry-After": "1"},
        ) from None
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
    except TimeoutError:
        raise APIError(
            400,
            f"the JSON schema is too complex: its grammar did not compile in {timeout:g} s",
            code="invalid_value",
            param=param,
        ) from None
    except GrammarError as exc:
        raise APIError(
            400, f"unsupported JSON schema: {exc}", code="invalid_value", param=param
        ) from None


async def grammar_for(fmt: ResponseFormat | None, engine: Any, timeout: float) -> Grammar | None:
    """The compiled grammar that ``fmt`` asks for (None for plain text).

    Raises:
        APIError: See ``schema_grammar`` and ``compile_grammar``.
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema: Any = {"type": "object"}
        param = "response_format"
    else:
        assert fmt.json_schema is not None
        schema, param = fmt.json_schema.schema_, "response_format.json_schema.schema"
    if engine.grammars is None:  # before any work on the schema
        raise _unconstrained("response_format")
    # Walking and rewriting a large schema is plain CPU: off the event loop.
    text = await asyncio.to_thread(schema_grammar, schema, param)
    return await compile_grammar(engine, text, param, timeout)
