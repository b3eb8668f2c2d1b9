"""GET /v1/models, GET /v1/models/{id}, POST /v1/completions."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from veloxquant_mlx.engine.types import FinishEvent, TokenEvent
from veloxquant_mlx.server.deps import AppState, state
from veloxquant_mlx.server.errors import APIError
from veloxquant_mlx.server.generation import collect_all, new_id, usage_json_many
from veloxquant_mlx.server.schemas import CompletionRequest
from veloxquant_mlx.server.submission import (
    check_model,
    fingerprint,
    model_card,
    sse_response,
    submit_all,
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


def _prompts(st: AppState, body: CompletionRequest) -> list[list[int]]:
    """The prompt(s) as token ids: a string, token ids, or a list of either (one choice set
    per prompt)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], (str, list)):
        prompts = list(prompt)
    else:
        prompts = [prompt]
    if len(prompts) > st.settings.max_n:
        raise APIError(
            400,
            f"at most {st.settings.max_n} prompts per request on this server (--max-n)",
            code="invalid_value",
            param="prompt",
        )
    return [
        (st.engine.tokenizer.encode(p) if p else []) if isinstance(p, str) else [int(t) for t in p]
        for p in prompts
    ]


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    st = state(request)
    arrived = time.monotonic()
    check_model(st, body.model)
    k = body.logprobs
    handles = submit_all(
        st, _prompts(st, body), body.n, body.max_tokens, body,
        logprobs=k is not None, top_logprobs=k or 0,
    )  # fmt: skip
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

        def chunk(index: int, event: TokenEvent | FinishEvent) -> dict[str, Any]:
            if isinstance(event, TokenEvent):
                choice = {
                    "index": index,
                    "text": event.text,
                    "logprobs": logprobs_json([event]),
                    "finish_reason": None,
                }
            else:
                choice = {
                    "index": index,
                    "text": event.text,
                    "logprobs": None,
                    "finish_reason": event.finish_reason,
                }
            return {**base, "choices": [choice]}

        return await sse_response(request, st, body, handles, arrived, base, chunk, body.n)
    outcomes = await collect_all(request, st.engine, handles, st.metrics, arrived)
    choices = []
    for index, outcome in enumerate(outcomes):
        assert outcome.finish is not None
        choices.append(
            {
                "index": index,
                "text": outcome.text,
                "logprobs": logprobs_json(outcome.tokens),
                "finish_reason": outcome.finish.finish_reason,
            }
        )
    finishes = [o.finish for o in outcomes if o.finish is not None]
    return {**base, "choices": choices, "usage": usage_json_many(finishes, body.n)}
