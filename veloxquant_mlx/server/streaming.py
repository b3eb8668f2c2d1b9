"""SSE responses with a write deadline: a client that takes no data is let go.

Starlette's ``StreamingResponse`` waits on each send for as long as the client takes: one that
reads at a trickle, or not at all, keeps its request generating into memory and its connection
open after generation ended (8 slow readers grew the server by 430 MB in two minutes). Here each
send may wait at most ``write_timeout`` seconds for the client to take data; past it the stream
is abandoned: its generator is closed (which cancels its engine requests and frees their
blocks) and the connection is dropped. What one stream buffers is then bounded by what its
requests make in that time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger("veloxquant.server")


class _ClientStalled(Exception):
    pass


class DeadlineStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` whose every send must complete within ``write_timeout``."""

    def __init__(self, content: Any, *, write_timeout: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout = write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_within(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, send_within)
        except _ClientStalled:
            log.warning(
                "a stream's client took no data for %.0f s: its requests were cancelled",
                self.write_timeout,
            )
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # its finally cancels the engine requests
            # Returning with the body unfinished makes the server close the connection.
