"""GET /v1/models, GET /v1/models/{id}, POST /v1/completions."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from veloxquant_mlx.engine.types import FinishEvent, TokenEvent
from veloxquant_mlx.server.deps import state
from veloxquant_mlx.server.generation import collect, new_id, usage_json
from veloxquant_mlx.server.schemas import CompletionRequest
from veloxquant_mlx.server.submission import (
    check_model,
    fingerprint,
    model_card,
    sse_response,
    submit,
    token_text,
)

router = APIRouter(prefix="/v1")  # the API key is checked before the body (middleware)


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(state(request))]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    st = state(request)
    check_model(st, model_id)
    return model_card(st)


# ---------------------------------------------------------------------- completions


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    st = state(request)
    arrived = time.monotonic()
    check_model(st, body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    tokens: list[int] = (
        (st.engine.tokenizer.encode(prompt) if prompt else [])
        if isinstance(prompt, str)
        else [int(t) for t in prompt]  # type: ignore[arg-type]
    )
    k = body.logprobs
    handle = submit(st, tokens, body.max_tokens, body, logprobs=k is not None, top_logprobs=k or 0)
    rid, created = new_id("cmpl"), int(time.time())
    base = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": st.model_name,
        "system_fingerprint": fingerprint(st),
    }

    def logprobs_json(events: list[TokenEvent]) -> dict[str, Any] | None:
        if k is None:
            return None
        offsets, pos, texts = [], 0, []
        for e in events:
            offsets.append(pos)
            pos += len(e.text)
            texts.append(token_text(st, e.token_id))
        return {
            "tokens": texts,
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [
                {token_text(st, t): lp for t, lp in e.top_logprobs} if k else None for e in events
            ],
            "text_offset": offsets,
        }

    if body.stream:

        def chunk(event: TokenEvent | FinishEvent) -> dict[str, Any]:
            if isinstance(event, TokenEvent):
                choice = {
                    "index": 0,
                    "text": event.text,
                    "logprobs": logprobs_json([event]),
                    "finish_reason": None,
                }
            else:
                choice = {
                    "index": 0,
                    "text": event.text,
                    "logprobs": None,
                    "finish_reason": event.finish_reason,
                }
            return {**base, "choices": [choice]}

        return await sse_response(request, st, body, handle, arrived, base, chunk)
    outcome = await collect(request, st.engine, handle, st.metrics, arrived)
    assert outcome.finish is not None
    choice = {
        "index": 0,
        "text": outcome.text,
        "logprobs": logprobs_json(outcome.tokens),
        "finish_reason": outcome.finish.finish_reason,
    }
    return {**base, "choices": [choice], "usage": usage_json(outcome.finish)}
