"""ASGI middleware: request body size limit (413), and CORS everywhere but /admin."""

from __future__ import annotations

import json
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from veloxquant_mlx.server.errors import error_body


class BodyLimit:
    """Answers 413 in OpenAI's shape when a body is (or turns out to be) over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await _reject(send, self.max_bytes)
                    return
        seen = 0
        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _TooLarge:
            if not started:
                await _reject(send, self.max_bytes)


class _TooLarge(Exception):
    pass


async def _reject(send: Send, max_bytes: int) -> None:
    body = json.dumps(error_body(413, f"request body over {max_bytes} bytes")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body})


class CORSExceptAdmin:
    """CORS for the configured origins on every path except /admin (operators only)."""

    def __init__(self, app: ASGIApp, origins: list[str]) -> None:
        self.app = app
        self.cors: Any = CORSMiddleware(
            app,
            allow_origins=origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "content-type"],
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("path", "").startswith("/admin"):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
