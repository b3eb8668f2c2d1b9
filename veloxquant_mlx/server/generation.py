"""Running one API request through the engine: prompt to tokens, events to OpenAI JSON/SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from veloxquant_mlx.engine.engine import Engine
from veloxquant_mlx.engine.handle import Event, RequestHandle
from veloxquant_mlx.engine.types import FinishEvent, TokenEvent
from veloxquant_mlx.server.errors import error_body, from_finish
from veloxquant_mlx.server.metrics import Metrics

RESULTS = ("stop", "length")  # the finish reasons a client may see; the rest are errors


@dataclass(slots=True)
class Outcome:
    """What a finished request produced."""

    text: str = ""
    tokens: list[TokenEvent] = field(default_factory=list)
    finish: FinishEvent | None = None


def usage_json(finish: FinishEvent) -> dict[str, Any]:
    u = finish.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},  # no prefix cache yet
        "completion_tokens_details": {"reasoning_tokens": 0},
        "peak_kv_blocks": u.peak_kv_blocks,
        "peak_kv_bytes": u.peak_kv_bytes,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


async def _watch_disconnect(request: Request, engine: Engine, handle: RequestHandle) -> None:
    while not handle.done:
        if await request.is_disconnected():
            engine.cancel(handle)
            return
        await asyncio.sleep(0.05)


async def collect(
    request: Request, engine: Engine, handle: RequestHandle, metrics: Metrics, arrived: float
) -> Outcome:
    """Wait for the whole result; a client that disconnects cancels the request."""
    outcome = Outcome()
    watcher = asyncio.create_task(_watch_disconnect(request, engine, handle))
    try:
        async for event in handle:
            if isinstance(event, TokenEvent):
                outcome.tokens.append(event)
                outcome.text += event.text
            else:
                outcome.finish = event
                outcome.text += event.text
    finally:
        watcher.cancel()
        if not handle.done:  # this coroutine was cancelled: the client is gone
            engine.cancel(handle)
    assert outcome.finish is not None
    metrics.observe(arrived, [t.time for t in outcome.tokens], outcome.finish.time)
    if outcome.finish.finish_reason not in RESULTS:
        raise from_finish(outcome.finish)
    return outcome


async def first_batch(
    request: Request, engine: Engine, handle: RequestHandle
) -> tuple[list[Event], AsyncIterator[list[Event]]]:
    """Wait for a stream's first events before any byte of the response is sent, so that a
    request that ends without a result before its first token (a shrink, a drain, its own
    fault) is answered with its real HTTP status instead of a 200 stream.

    Returns the first batch and the iterator of the rest. Raises the APIError for such an end.
    A client that disconnects meanwhile cancels the request.
    """
    batches = handle.batches()
    watcher = asyncio.create_task(_watch_disconnect(request, engine, handle))
    try:
        first = await anext(batches)
    except BaseException:  # cancelled while waiting: the client is gone
        engine.cancel(handle)
        raise
    finally:
        watcher.cancel()
    last = first[-1]
    if isinstance(last, FinishEvent) and last.finish_reason not in RESULTS:
        raise from_finish(last)
    return first, batches


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _chain(first: list[Event], rest: AsyncIterator[list[Event]]):
    yield first
    if not isinstance(first[-1], FinishEvent):
        async for batch in rest:
            yield batch


async def stream_events(
    engine: Engine,
    handle: RequestHandle,
    metrics: Metrics,
    arrived: float,
    chunk: Any,
    include_usage: bool,
    usage_chunk: Any,
    first: tuple[list[Event], AsyncIterator[list[Event]]],
) -> AsyncIterator[bytes]:
    """SSE bytes: ``chunk(event)`` per event, then usage if asked, then ``[DONE]``. Events
    that arrived together are written together. ``first`` is what ``first_batch`` returned.

    If the client goes away, Starlette cancels this generator and the request is cancelled.
    A request that ends without a result mid-stream gets an error event (OpenAI's error shape,
    the code saying why), then ``[DONE]``.
    """
    times: list[float] = []
    finish: FinishEvent | None = None
    try:
        async for batch in _chain(*first):
            out = []
            for event in batch:
                if isinstance(event, TokenEvent):
                    times.append(event.time)
                    if event.text or event.logprob is not None:
                        data = chunk(event)  # None: nothing to send yet (held back)
                        if data is not None:
                            out.append(sse(data))
                else:
                    finish = event
            if out:
                yield b"".join(out)
        assert finish is not None
        if finish.finish_reason not in RESULTS:
            err = from_finish(finish)
            yield sse(error_body(err.status, err.message, err.code))
        else:
            yield sse(chunk(finish))
            if include_usage:
                yield sse(usage_chunk(finish))
        yield b"data: [DONE]\n\n"
    finally:
        if not handle.done:
            engine.cancel(handle)
        with contextlib.suppress(Exception):
            metrics.observe(arrived, times, finish.time if finish else time.monotonic())
