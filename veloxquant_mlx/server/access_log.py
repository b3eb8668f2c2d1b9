"""The access log: one line per HTTP request (``--access-log``, on by default).

``AccessLog`` is the outermost middleware: it sees every request that reached the app (401s,
404s and 400s included; a request the edge refuses before HTTP parsing never does), its final
status, the ``x-request-id`` the response carries, and the time until its last byte. The
engine requests a route submits are noted in ``HANDLES`` (a context variable the middleware
sets for the request), so the line carries their prompt, completion and cached tokens once they
end, and the time from the request's arrival to the first token the engine made for it
(``ttft``: templating, tokenizing, queueing and prefill; not the network's part), and how
they ended (``finish``: ``stop``, ``length``, ``cancelled`` when the client went away, ``error``),
and, for a request answered with an error, its code and message (``error``: what the client
was told, so an operator sees why a client's requests fail without its logs).
A client that goes away mid-stream ends the route before the engine has ended its requests: the
line then waits for their ends (at most ``SETTLE_S``; the client is gone, nobody waits on it), so
it counts the tokens made until then. Under ``--log-format json`` the fields are the line's own
JSON keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("veloxquant.access")

# The engine requests of the HTTP request being served (None outside the access log).
HANDLES: ContextVar[list[Any] | None] = ContextVar("vq_request_handles", default=None)
# How long a line waits for the engine to end requests whose route ended first (a client that
# went away mid-stream: the engine ends them at its next turn).
SETTLE_S = 2.0


# The error answers of the HTTP request being served: "code: message" (the error handlers').
ERRORS: ContextVar[list[str] | None] = ContextVar("vq_request_errors", default=None)
# An error's message is cut to this many characters in the line
ERROR_CHARS = 300


def note_error(code: str, message: str) -> None:
    """Show the error the current request is answered with in its access line."""
    noted = ERRORS.get()
    if noted is not None:
        noted.append(f"{code}: {message[:ERROR_CHARS]}")


def note_handles(handles: list[Any]) -> None:
    """Count ``handles``' tokens in the current request's access line."""
    noted = HANDLES.get()
    if noted is not None:
        noted.extend(handles)


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        seen: dict[str, Any] = {"status": 0, "id": ""}
        handles: list[Any] = []
        errors: list[str] = []
        token, error_token = HANDLES.set(handles), ERRORS.set(errors)

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                for key, value in message.get("headers", []):
                    if key == b"x-request-id":
                        seen["id"] = value.decode("ascii", "replace")
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            HANDLES.reset(token)
            ERRORS.reset(error_token)
            seconds = time.monotonic() - started
            try:
                await _settle(handles)
            finally:
                self._line(scope, seen, handles, started, seconds, errors)

    @staticmethod
    def _line(
        scope: Scope,
        seen: dict[str, Any],
        handles: list[Any],
        started: float,
        seconds: float,
        errors: list[str],
    ) -> None:
        finishes = [h.finish for h in handles if h.finish is not None]
        firsts = [h.first_token_at for h in handles if h.first_token_at is not None]
        fields = {
            "method": scope.get("method", ""),
            "path": scope.get("path", ""),
            "status": seen["status"] or 499,  # no response started: the client went away
            "ms": round(seconds * 1e3, 1),
            "request_id": seen["id"],
            "prompt_tokens": sum(f.usage.prompt_tokens for f in finishes),
            "completion_tokens": sum(f.usage.completion_tokens for f in finishes),
            "cached_tokens": sum(f.usage.cached_tokens for f in finishes),
            # the first token made, from the request's arrival (None: no token made)
            "ttft_ms": round(max(0.0, min(firsts) - started) * 1e3, 1) if firsts else None,
            # how its engine requests ended, each reason once in order (None: no request)
            "finish": ",".join(dict.fromkeys(f.finish_reason for f in finishes)) or None,
            # the error the request was answered with (None: none)
            "error": errors[-1] if errors else None,
        }
        *shown, ttft_ms, finish, error = fields.values()
        ttft = "-" if ttft_ms is None else f"{ttft_ms:.1f} ms"
        log.info(
            "%s %s %d %.1f ms id=%s prompt=%d completion=%d cached=%d ttft=%s finish=%s%s",
            *shown,
            ttft,
            finish or "-",
            "" if error is None else f" error={error!r}",
            extra={"fields": fields},
        )


async def _settle(handles: list[Any]) -> None:
    """Wait (at most ``SETTLE_S``) until every one of ``handles`` has ended: polled from 5 ms
    up to every 100 ms, so that many clients hanging up at once cost the event loop little."""
    deadline = time.monotonic() + SETTLE_S
    pause = 0.005
    while any(h.finish is None for h in handles) and time.monotonic() < deadline:
        await asyncio.sleep(pause)
        pause = min(0.1, pause * 2)
