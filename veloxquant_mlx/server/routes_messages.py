"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API over the chat
path (``messages_api.to_chat``), streamed with Anthropic's event sequence."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import FinishEvent
from veloxquant_mlx.server.deps import AppState, state
from veloxquant_mlx.server.errors import APIError, describe_validation, from_finish
from veloxquant_mlx.server.generation import (
    RESULTS,
    Opening,
    chain,
    collect,
    ended_with,
    first_batch,
)
from veloxquant_mlx.server.messages_api import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error,
    content_blocks,
    stop_reason,
    to_chat,
    tool_use,
)
from veloxquant_mlx.server.reasoning import ReasoningSplitter, think_then_split
from veloxquant_mlx.server.routes_chat import prepare_chat
from veloxquant_mlx.server.schemas import ChatCompletionRequest
from veloxquant_mlx.server.streaming import DeadlineStreamingResponse
from veloxquant_mlx.server.submission import check_model
from veloxquant_mlx.server.tool_calls import ToolCallSplitter
from veloxquant_mlx.server.tools import (
    render_template,
    template_messages,
    template_tools,
    template_variables,
)

router = APIRouter(prefix="/v1")  # the API key is checked before the body (middleware)


def _chat(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    try:
        return to_chat(req)
    except ValidationError as exc:  # what the chat path refuses, named as far as it can be
        message, _ = describe_validation(list(exc.errors()))
        raise APIError(400, message, code="invalid_value", param="messages") from None


def _usage(finish: FinishEvent) -> dict[str, int]:
    u = finish.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens,
    }


@router.post("/messages", response_model=None)
async def messages(req: MessagesRequest, request: Request) -> Any:
    st = state(request)
    arrived = time.monotonic()
    prepared = await prepare_chat(st, _chat(req))
    handle, splitter = prepared.handles[0], prepared.splitters[0]
    reasoner = prepared.reasoners[0]
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    if req.stream:
        keepalive = st.settings.stream_keepalive
        first = await first_batch(request, st.engine, handle, keepalive or None)
        times: list[float] = []
        events = _events(st, req, message_id, handle, splitter, reasoner, first, times)
        return DeadlineStreamingResponse(
            ended_with(events, st.engine, handle, st.metrics, arrived, times),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            write_timeout=st.settings.stream_write_timeout,
        )
    outcome = await collect(request, st.engine, handle, st.metrics, arrived)
    finish = outcome.finish
    assert finish is not None
    if finish.finish_reason not in RESULTS:
        raise from_finish(finish)
    cut = finish.finish_reason == "length"
    thought, text, calls = think_then_split(reasoner, splitter, outcome.text, True, cut)
    thinking = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": thinking + content_blocks(text, calls),
        "stop_reason": stop_reason(finish.finish_reason, finish.stop_string, len(calls)),
        "stop_sequence": finish.stop_string,
        "usage": _usage(finish),
    }


async def _events(
    st: AppState,
    req: MessagesRequest,
    message_id: str,
    handle: RequestHandle,
    splitter: ToolCallSplitter | None,
    reasoner: ReasoningSplitter | None,
    first: Opening,
    times: list[float],
) -> AsyncGenerator[bytes, None]:
    """message_start, ping, content blocks (text_delta / input_json_delta), message_delta,
    message_stop: Anthropic's stream; a ``ping`` every ``--stream-keepalive`` seconds while
    the first token is awaited. Its tokens' times go to ``times``."""
    n_prompt = len(handle.request.prompt_tokens)

    def event(kind: str, **data: Any) -> bytes:
        payload = json.dumps({"type": kind, **data}, separators=(",", ":"))
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    start: dict[str, Any] = {
        "id": message_id, "type": "message", "role": "assistant", "model": req.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": n_prompt, "output_tokens": 0},
    }  # fmt: skip
    yield event("message_start", message=start) + event("ping")
    index, text_open, thinking_open, n_calls = 0, False, False, 0
    finish: FinishEvent | None = None
    async for batch in chain(*first, st.settings.stream_keepalive):
        if not batch:
            yield event("ping")
            continue
        out: list[bytes] = []
        for ev in batch:
            final = isinstance(ev, FinishEvent)
            if final:
                finish = ev  # type: ignore[assignment]
            else:
                times.append(ev.time)
            cut = final and ev.finish_reason == "length"  # type: ignore[union-attr]
            thought, text, calls = think_then_split(reasoner, splitter, ev.text, final, cut)
            if thought:
                if not thinking_open:
                    block = {"type": "thinking", "thinking": "", "signature": ""}
                    out.append(event("content_block_start", index=index, content_block=block))
                    thinking_open = True
                thinking_delta = {"type": "thinking_delta", "thinking": thought}
                out.append(event("content_block_delta", index=index, delta=thinking_delta))
            if thinking_open and (text or calls or final):
                out.append(event("content_block_stop", index=index))
                index, thinking_open = index + 1, False
            if text:
                if not text_open:
                    empty = {"type": "text", "text": ""}
                    out.append(event("content_block_start", index=index, content_block=empty))
                    text_open = True
                text_delta = {"type": "text_delta", "text": text}
                out.append(event("content_block_delta", index=index, delta=text_delta))
            for call in calls:
                if text_open:
                    out.append(event("content_block_stop", index=index))
                    index, text_open = index + 1, False
                use: dict[str, Any] = {**tool_use(call), "input": {}}
                json_delta = {"type": "input_json_delta",
                              "partial_json": call["function"]["arguments"]}  # fmt: skip
                out += [
                    event("content_block_start", index=index, content_block=use),
                    event("content_block_delta", index=index, delta=json_delta),
                    event("content_block_stop", index=index),
                ]
                index, n_calls = index + 1, n_calls + 1
        if out:
            yield b"".join(out)
    assert finish is not None
    if finish.finish_reason not in RESULTS:
        err = from_finish(finish)
        body = anthropic_error(err.status, err.message)
        yield f"event: error\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
        return
    tail = [event("content_block_stop", index=index)] if text_open else []
    reason = stop_reason(finish.finish_reason, finish.stop_string, n_calls)
    delta: dict[str, Any] = {"stop_reason": reason, "stop_sequence": finish.stop_string}
    yield b"".join(
        [*tail, event("message_delta", delta=delta, usage=_usage(finish)), event("message_stop")]
    )


@router.post("/messages/count_tokens", response_model=None)
async def count_tokens(req: CountTokensRequest, request: Request) -> Any:
    """The prompt's tokens as the chat template renders it (tools included): what a
    ``/v1/messages`` request with it would count as input."""
    st = state(request)
    check_model(st, req.model)
    body = _chat(req)
    tokenizer = st.engine.tokenizer

    def count() -> int:
        tools = template_tools(body, tokenizer)
        rendered = render_template(
            tokenizer, template_messages(body), tools, template_variables(body), tokenize=True
        )
        return len(rendered)

    try:  # tokenizing a long conversation is CPU work: off the event loop
        return {"input_tokens": await asyncio.to_thread(count)}
    except APIError:
        raise
    except Exception as exc:  # a template that rejects the conversation (roles, order)
        raise APIError(400, f"cannot format these messages: {exc}", param="messages") from None
