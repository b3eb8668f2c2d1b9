"""GET /v1/models, GET /v1/models/{id}, POST /v1/completions."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

from fastapi import APIRouter, Request

from veloxquant_mlx.engine.types import EngineError, FinishEvent, TokenEvent
from veloxquant_mlx.server.deps import AppState, state
from veloxquant_mlx.server.errors import APIError, from_engine
from veloxquant_mlx.server.generation import collect_all, new_id, usage_json_many
from veloxquant_mlx.server.schemas import CompletionRequest
from veloxquant_mlx.server.submission import (
    OFF_LOOP_CHARS,
    check_model,
    fingerprint,
    model_card,
    model_cards,
    sse_response,
    submit_all,
    token_text,
)

router = APIRouter(prefix="/v1")  # the API key is checked before the body (middleware)


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    """OpenAI's list, with Anthropic's paging fields (one page)."""
    cards = model_cards(state(request))
    return {"object": "list", "data": cards, "has_more": False,
            "first_id": cards[0]["id"], "last_id": cards[-1]["id"]}  # fmt: skip


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    st = state(request)
    check_model(st, model_id)
    return model_card(st, model_id)


# ---------------------------------------------------------------------- completions


async def _prompts(st: AppState, body: CompletionRequest) -> list[list[int]]:
    """The prompt(s) as token ids: a string, token ids, or a list of either (one choice set
    per prompt). Long text is tokenized on a worker thread, off the event loop."""
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

    def encode() -> list[list[int]]:
        return [
            (st.engine.tokenizer.encode(p) if p else [])
            if isinstance(p, str)
            else [int(t) for t in p]
            for p in prompts
        ]

    long = sum(len(p) for p in prompts if isinstance(p, str)) > OFF_LOOP_CHARS
    return await asyncio.to_thread(encode) if long else encode()


async def _echoes(
    request: Request, st: AppState, body: CompletionRequest, prompts: list[list[int]]
) -> list[Any]:
    """Per prompt: its text and, when logprobs are asked, each token's score (engine thread, a
    chunk a turn beside the decode steps; a client that leaves stops it)."""
    out = []
    for prompt in prompts:
        if not prompt:
            raise APIError(
                400, "the prompt must not be empty", code="invalid_value", param="prompt"
            )
        scores = None
        if body.logprobs is not None:
            scores = await _score(request, st, tuple(prompt), body.logprobs)
        out.append((st.engine.tokenizer.decode(prompt), prompt, scores))
    return out


async def _score(request: Request, st: AppState, prompt: tuple[int, ...], top: int) -> Any:
    """``prompt``'s scores, watching the client: when it disconnects the engine stops scoring
    at its next chunk and this raises CancelledError (nobody is left to answer)."""
    cancelled = threading.Event()
    scoring = asyncio.ensure_future(
        asyncio.to_thread(st.engine.score, prompt, top, 300.0, cancelled)
    )
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({scoring, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not scoring.done():
            cancelled.set()
        watcher.cancel()
    try:
        return await scoring
    except concurrent.futures.CancelledError:
        raise asyncio.CancelledError from None
    except EngineError as exc:
        raise from_engine(exc) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read: the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    st = state(request)
    arrived = time.monotonic()
    check_model(st, body.model)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(
            400, "max_tokens 0 is only allowed with echo: true", code="invalid_value",
            param="max_tokens",
        )  # fmt: skip
    if body.echo and body.stream:
        raise APIError(
            400, "echo is not supported with stream: true", code="invalid_value", param="echo"
        )
    k = body.logprobs
    prompts = await _prompts(st, body)
    echoes = await _echoes(request, st, body, prompts) if body.echo else None
    handles = (
        submit_all(
            st,
            prompts,
            body.n,
            body.max_tokens,
            body,
            logprobs=k is not None,
            top_logprobs=k or 0,
        )
        if body.max_tokens != 0
        else []
    )
    rid, created = new_id("cmpl"), int(time.time())
    base = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": st.model_name,
        "system_fingerprint": fingerprint(st),
    }

    def logprobs_json(
        ids: list[int], lps: list[float | None], tops: list[Any], start: int = 0
    ) -> dict[str, Any] | None:
        if k is None:
            return None
        texts = [token_text(st, t) for t in ids]
        offsets, pos = [], start
        for text in texts:
            offsets.append(pos)
            pos += len(text)
        return {
            "tokens": texts,
            "token_logprobs": lps,
            "top_logprobs": [
                {token_text(st, t): lp for t, lp in top} if k and top else None for top in tops
            ],
            "text_offset": offsets,
        }

    def events_json(events: list[TokenEvent], start: int = 0) -> dict[str, Any] | None:
        return logprobs_json(
            [e.token_id for e in events],
            [e.logprob for e in events],
            [e.top_logprobs for e in events],
            start,
        )

    if body.stream:

        def chunk(index: int, event: TokenEvent | FinishEvent) -> dict[str, Any]:
            if isinstance(event, TokenEvent):
                choice = {
                    "index": index,
                    "text": event.text,
                    "logprobs": events_json([event]),
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
    outcomes = (
        await collect_all(request, st.engine, handles, st.metrics, arrived) if handles else []
    )
    choices = []
    for index in range(len(prompts) * body.n):
        outcome = outcomes[index] if outcomes else None
        text, lp = "", None
        if echoes is not None:
            text, prompt, scores = echoes[index // body.n]
            if scores is not None:
                lp = logprobs_json(prompt, [s[0] for s in scores], [s[1] for s in scores])
        if outcome is not None:
            more = events_json(outcome.tokens, len(text))
            if lp is not None and more is not None:
                lp = {key: lp[key] + more[key] for key in lp}
            elif more is not None:
                lp = more
            text += outcome.text
        finish = outcome.finish.finish_reason if outcome and outcome.finish else "length"
        choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
    if outcomes:
        finishes = [o.finish for o in outcomes if o.finish is not None]
        usage = usage_json_many(finishes, body.n)
    else:  # scored only
        n_prompt = sum(len(p) for p in prompts)
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": 0,
            "total_tokens": n_prompt,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }
    return {**base, "choices": choices, "usage": usage}
