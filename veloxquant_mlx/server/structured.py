"""``response_format`` to an llguidance grammar, checked before the request is queued."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from veloxquant_mlx.engine.client import EngineClient
from veloxquant_mlx.server.errors import APIError
from veloxquant_mlx.server.schemas import ResponseFormat

# Compact JSON: no free whitespace between tokens. Under a grammar that allows it, a weak model
# can spend its whole max_tokens on spaces and newlines (seen with random sampling here).
COMPACT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
}


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists properties
    and says nothing about others (vLLM's xgrammar does the same by default). JSON Schema allows
    extra keys unless told otherwise, and a weak model then writes keys nobody asked for; the
    clients that send schemas (the SDK's ``parse``, instructor, LangChain, pydantic-ai) mean
    only the fields they declare. A schema that sets ``additionalProperties`` keeps it."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k != "const" and k != "enum" and k != "default" else v
           for k, v in schema.items()}  # fmt: skip
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema_grammar(schema: dict[str, Any]) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(closed(schema)),
        defaults=COMPACT,  # type: ignore[arg-type]
    )


async def grammar_for(fmt: ResponseFormat | None, engine: EngineClient) -> str | None:
    """The grammar that ``fmt`` asks for (None for plain text).

    Raises:
        APIError: 400 when the model's tokenizer cannot be constrained, or the schema uses
            something the grammar engine does not support (the message names it).
    """
    if fmt is None or fmt.type == "text":
        return None
    if engine.ll_tokenizer is None:
        raise APIError(
            400,
            "structured outputs are not supported for this model's tokenizer",
            code="unsupported_value",
            param="response_format",
        )
    if fmt.type == "json_object":
        schema: dict[str, Any] = {"type": "object"}
        param = "response_format"
    else:
        assert fmt.json_schema is not None
        schema, param = fmt.json_schema.schema_, "response_format.json_schema.schema"
    try:
        grammar = _schema_grammar(schema)
    except ValueError as exc:
        raise APIError(
            400, f"invalid JSON schema: {exc}", code="invalid_value", param=param
        ) from None
    # Compiling a large schema can take a while: off the event loop (it is plain CPU, no MLX).
    from veloxquant_mlx.engine.grammar import check_grammar

    problem = await asyncio.to_thread(check_grammar, grammar, engine.ll_tokenizer)
    if problem is not None:
        raise APIError(
            400, f"unsupported JSON schema: {problem}", code="invalid_value", param=param
        )
    return grammar
