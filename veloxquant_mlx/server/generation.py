"""Running one API request through the engine: prompt to tokens, events to OpenAI JSON/SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from veloxquant_mlx.engine.client import EngineClient
from veloxquant_mlx.engine.request.handle import Event, RequestHandle
from veloxquant_mlx.engine.types import FinishEvent, TokenEvent, rejection_of
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
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
        "peak_kv_blocks": u.peak_kv_blocks,
        "peak_kv_bytes": u.peak_kv_bytes,
    }


def usage_json_many(finishes: list[FinishEvent], n: int) -> dict[str, Any]:
    """Usage of ``n`` choices per prompt: each prompt counted once, every completion."""
    out = usage_json(finishes[0])
    prompt = sum(f.usage.prompt_tokens for f in finishes[::n])
    completion = sum(f.usage.completion_tokens for f in finishes)
    out.update(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        peak_kv_blocks=sum(f.usage.peak_kv_blocks for f in finishes),
        prompt_tokens_details={"cached_tokens": sum(f.usage.cached_tokens for f in finishes[::n])},
        peak_kv_bytes=sum(f.usage.peak_kv_bytes for f in finishes),
    )
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


async def _watch_disconnect(request: Request, engine: EngineClient, handle: RequestHandle) -> None:
    """Cancel ``handle`` when the client goes away. The body has been read, so the server's
    next ASGI message for this request is ``http.disconnect`` (sent when the client closes, or
    once the response is complete): one wait per request instead of polling it."""
    while not handle.done:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not handle.done:
                engine.cancel(handle)
            return


async def collect(
    request: Request, engine: EngineClient, handle: RequestHandle, metrics: Metrics, arrived: float
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
    if rejection_of(outcome.finish) is None:  # a refusal is counted as one, not as latency
        metrics.observe(arrived, [t.time for t in outcome.tokens], outcome.finish.time)
    if outcome.finish.finish_reason not in RESULTS:
        raise from_finish(outcome.finish)
    return outcome


async def first_batch(
    request: Request,
    engine: EngineClient,
    handle: RequestHandle,
    patience: float | None = None,
) -> tuple[list[Event] | None, AsyncIterator[list[Event]]]:
    """Wait for a stream's first events before any byte of the response is sent, so that a
    request that ends without a result before its first token (a shrink, a drain, its own
    fault) is answered with its real HTTP status instead of a 200 stream.

    Returns the first batch and the iterator of the rest. Raises the APIError for such an end.
    A client that disconnects meanwhile cancels the request. With ``patience`` (seconds), a
    first batch that has not come by then is left to the stream: the first is None and
    ``chain`` waits for it (with keep-alives), so a long prefill or queue does not keep the
    response silent (``--stream-keepalive``).
    """
    batches = handle.batches()
    watcher = asyncio.create_task(_watch_disconnect(request, engine, handle))
    pending = asyncio.ensure_future(anext(batches))
    try:
        done, _ = await asyncio.wait({pending}, timeout=patience)
    except BaseException:  # cancelled while waiting: the client is gone
        pending.cancel()
        engine.cancel(handle)
        raise
    finally:
        watcher.cancel()
    if not done:
        return None, _after(pending, batches)
    first = pending.result()
    last = first[-1]
    if isinstance(last, FinishEvent) and last.finish_reason not in RESULTS:
        raise from_finish(last)
    return first, batches


async def _after(
    pending: asyncio.Future[list[Event]], rest: AsyncIterator[list[Event]]
) -> AsyncIterator[list[Event]]:
    try:
        first = await pending
    finally:
        pending.cancel()  # closed before it came
    yield first
    if not isinstance(first[-1], FinishEvent):
        async for batch in rest:
            yield batch


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# What a stream sends while it waits for its first token, where its API has no event for it:
# an SSE comment, which clients skip.
SSE_KEEPALIVE = b": keep-alive\n\n"


async def chain(
    first: list[Event] | None, rest: AsyncIterator[list[Event]], keepalive: float = 0.0
) -> AsyncIterator[list[Event]]:
    """The batches of one request: ``first`` (from ``first_batch``), then the rest. A first
    of None (the stream started before it came) is waited for, with an empty batch every
    ``keepalive`` seconds meanwhile: the stream's cue to send a keep-alive."""
    if first is None:
        upcoming = asyncio.ensure_future(anext(rest))
        try:
            while not (await asyncio.wait({upcoming}, timeout=keepalive or None))[0]:
                yield []
        finally:
            upcoming.cancel()  # closed before it came
        first = upcoming.result()
    yield first
    if not isinstance(first[-1], FinishEvent):
        async for batch in rest:
            yield batch


async def ended_with(
    events: AsyncGenerator[bytes, None],
    engine: EngineClient,
    handle: RequestHandle,
    metrics: Metrics,
    arrived: float,
    times: list[float],
) -> AsyncIterator[bytes]:
    """One request's stream ``events`` (which appends its tokens' times to ``times``); however
    it ends, the request is cancelled if it has not ended (closed early: the client left) and
    its times go to the request metrics."""
    try:
        async for chunk in events:
            yield chunk
    finally:
        await events.aclose()  # its own waits (a first token's) end with it
        if not handle.done:
            engine.cancel(handle)
        ended = handle.finish.time if handle.finish is not None else time.monotonic()
        metrics.observe(arrived, times, ended)


# What ``first_batch`` returns: a request's first batch (None: not come yet) and the rest.
Opening = tuple[list[Event] | None, AsyncIterator[list[Event]]]


async def _tagged(
    firsts: list[Opening], keepalive: float
) -> AsyncGenerator[tuple[int, list[Event]], None]:
    """Every choice's batches as ``(choice index, batch)`` in arrival order (empty batches:
    ``chain``'s keep-alive cues). One choice is read directly; several are pumped into a
    queue by a task each (cancelled when this closes)."""
    if len(firsts) == 1:
        async for batch in chain(*firsts[0], keepalive):
            yield 0, batch
        return
    queue: asyncio.Queue[tuple[int, list[Event]]] = asyncio.Queue()

    async def pump(index: int, first: list[Event] | None, rest: AsyncIterator[list[Event]]) -> None:
        async for batch in chain(first, rest, keepalive):
            await queue.put((index, batch))

    pumps = [asyncio.ensure_future(pump(i, first, rest)) for i, (first, rest) in enumerate(firsts)]
    try:
        while True:
            yield await queue.get()
    finally:
        for task in pumps:
            task.cancel()


async def collect_all(
    request: Request,
    engine: EngineClient,
    handles: list[RequestHandle],
    metrics: Metrics,
    arrived: float,
) -> list[Outcome]:
    """``collect`` for several choices at once; the first failure cancels the rest."""
    tasks = [asyncio.ensure_future(collect(request, engine, h, metrics, arrived)) for h in handles]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task, handle in zip(tasks, handles, strict=True):
            task.cancel()
            engine.cancel(handle)
        raise


async def stream_choices(
    engine: EngineClient,
    handles: list[RequestHandle],
    metrics: Metrics,
    arrived: float,
    chunk: Any,
    include_usage: bool,
    usage_chunk: Any,
    firsts: list[Opening],
    keepalive: float = 0.0,
) -> AsyncIterator[bytes]:
    """SSE bytes for one or more choices: ``chunk(index, event)`` per event as each choice's
    events arrive (events that arrived together are written together; ``chunk`` may return
    None to hold text back), each choice's finish chunk when it ends, then
    ``usage_chunk(finishes)`` if asked, then ``[DONE]``. ``firsts`` are what ``first_batch``
    returned per choice; while a choice's first has not come, an SSE comment is sent every
    ``keepalive`` seconds.

    A choice that ends without a result gets an error event (OpenAI's error shape, the code
    saying why; the other choices are cancelled), then ``[DONE]``. If the client goes away,
    Starlette cancels this generator and every choice is cancelled.
    """
    finishes: dict[int, FinishEvent] = {}
    times: list[float] = []
    batches = _tagged(firsts, keepalive)
    try:
        async for index, batch in batches:
            if not batch:
                yield SSE_KEEPALIVE
                continue
            out = []
            for event in batch:
                if isinstance(event, TokenEvent):
                    times.append(event.time)
                    if event.text or event.logprob is not None:
                        data = chunk(index, event)
                        if data is not None:
                            out.append(sse(data))
                    continue
                finishes[index] = event
                if event.finish_reason not in RESULTS:
                    if out:
                        yield b"".join(out)
                    err = from_finish(event)
                    yield sse(error_body(err.status, err.message, err.code))
                    yield b"data: [DONE]\n\n"
                    return
                out.append(sse(chunk(index, event)))
            if out:
                yield b"".join(out)
            if len(finishes) == len(handles):
                break
        if include_usage:
            yield sse(usage_chunk([finishes[i] for i in range(len(handles))]))
        yield b"data: [DONE]\n\n"
    finally:
        await batches.aclose()
        for handle in handles:
            if not handle.done:
                engine.cancel(handle)
        with contextlib.suppress(Exception):
            ended = max((f.time for f in finishes.values()), default=time.monotonic())
            metrics.observe(arrived, times, ended)
