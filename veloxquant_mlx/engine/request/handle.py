"""RequestHandle: the caller's end of one request's event stream, usable from asyncio or threads."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Protocol

from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, TokenEvent

Event = TokenEvent | FinishEvent


class EventSink(Protocol):
    """Where the events of handles made with a sink go instead of their queues (the engine
    process forwards them to the server's process): called on the engine thread, one call per
    step for every such handle that has events."""

    def deliver(self, items: list[tuple[RequestHandle, Sequence[Event]]]) -> None: ...


class _Discard:
    """The sink of requests this rank only computes (another rank answers them)."""

    def deliver(self, items: list[tuple[RequestHandle, Sequence[Event]]]) -> None:
        pass


DISCARD: EventSink = _Discard()


class RequestHandle:
    """Events of one submitted request, in order, ending with exactly one FinishEvent.

    Made by ``Engine.submit``. When submitted from a running event loop, the engine thread
    delivers events with ``loop.call_soon_threadsafe`` and ``async for`` consumes them without
    blocking the loop; otherwise ``events()`` blocks a thread; with a ``sink``, events go to the
    sink instead (``tag`` is the sink's name for the request). Owns its queue; the engine is the
    only producer.
    """

    def __init__(
        self,
        request_id: int,
        request: GenerationRequest,
        sink: EventSink | None = None,
        tag: Any = None,
    ) -> None:
        self.request_id = request_id
        self.request = request
        self.sink = sink
        self.tag = tag
        self.submitted_at = time.monotonic()
        self.finish: FinishEvent | None = None
        self.first_token_at: float | None = None  # the first token's time (time.monotonic)
        # Sees every event as the consumer takes it (on its side: the event loop), before it
        # is handed on; the server's record of an answer's tokens (server.answers).
        self.tap: Callable[[Event], None] | None = None
        self._done = threading.Event()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._async_queue: asyncio.Queue[Event] | None = (
            asyncio.Queue() if self._loop is not None else None
        )
        self._sync_queue: queue.SimpleQueue[Event] = queue.SimpleQueue()

    # ------------------------------------------------------------------ engine side

    def _push(self, event: Event) -> None:
        """Deliver an event (engine thread). Safe after the consumer's loop has closed."""
        if isinstance(event, FinishEvent):
            self.finish = event
        if self.sink is not None:
            self.sink.deliver([(self, [event])])
        elif self._loop is not None and self._async_queue is not None:
            # A closed loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)
        else:
            self._sync_queue.put(event)
        if isinstance(event, FinishEvent):
            self._done.set()

    @staticmethod
    def push_tokens(items: list[tuple[RequestHandle, list[TokenEvent]]]) -> None:
        """Deliver one step's token events, in order per handle (engine thread): one wake-up
        per event loop per step instead of one per token, which matters when dozens of requests
        decode together. Empty lists are skipped."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, list[TokenEvent]]]] = {}
        by_sink: dict[EventSink, list[tuple[RequestHandle, Sequence[Event]]]] = {}
        for handle, events in items:
            if not events:
                continue
            if handle.first_token_at is None:
                handle.first_token_at = events[0].time
            if handle.sink is not None:
                by_sink.setdefault(handle.sink, []).append((handle, events))
            elif handle._loop is not None and handle._async_queue is not None:
                by_loop.setdefault(handle._loop, []).append((handle, events))
            else:
                for event in events:
                    handle._sync_queue.put(event)
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_deliver, batch)
        for sink, sunk in by_sink.items():
            sink.deliver(sunk)

    # ------------------------------------------------------------------ consumer side

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Event]:
        if self._async_queue is None:
            raise RuntimeError("this handle was not submitted from an event loop; use events()")
        while True:
            event = await self._async_queue.get()
            if self.tap is not None:
                self.tap(event)
            yield event
            if isinstance(event, FinishEvent):
                return

    async def batches(self) -> AsyncIterator[list[Event]]:
        """As ``async for``, but every event already delivered at once, oldest first (the
        last list ends with the FinishEvent): a consumer can write them out together."""
        queue = self._async_queue
        if queue is None:
            raise RuntimeError("this handle was not submitted from an event loop; use events()")
        while True:
            batch = [await queue.get()]
            while not queue.empty() and not isinstance(batch[-1], FinishEvent):
                batch.append(queue.get_nowait())
            if self.tap is not None:
                for event in batch:
                    self.tap(event)
            yield batch
            if isinstance(batch[-1], FinishEvent):
                return

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iteration (threads). Raises queue.Empty if no event comes within timeout."""
        if self._async_queue is not None:
            raise RuntimeError("this handle was submitted from an event loop; use async for")
        while True:
            event = self._sync_queue.get(timeout=timeout)
            yield event
            if isinstance(event, FinishEvent):
                return

    def collect(self, timeout: float | None = None) -> tuple[list[TokenEvent], FinishEvent]:
        """All token events and the finish event (threads)."""
        tokens: list[TokenEvent] = []
        for event in self.events(timeout):
            if isinstance(event, TokenEvent):
                tokens.append(event)
            else:
                return tokens, event
        raise AssertionError("event stream ended without a FinishEvent")

    def text(self, timeout: float | None = None) -> str:
        tokens, finish = self.collect(timeout)
        return "".join(t.text for t in tokens) + finish.text

    def __repr__(self) -> str:
        state: Any = self.finish.finish_reason if self.finish else "pending"
        return f"RequestHandle(request_id={self.request_id}, {state})"


def _deliver(batch: list[tuple[RequestHandle, list[TokenEvent]]]) -> None:
    """On the event loop: hand each event to its handle's queue."""
    for handle, events in batch:
        assert handle._async_queue is not None
        for event in events:
            handle._async_queue.put_nowait(event)
