"""ASGI middleware at the HTTP edge: authentication before the body, the body read whole under
a size limit and a deadline (413, 408), and CORS everywhere but /admin."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import uuid
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from veloxquant_mlx.server.access_log import note_error
from veloxquant_mlx.server.errors import error_body, speaks_anthropic
from veloxquant_mlx.server.messages_api import anthropic_error


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str | None,
    headers: list[tuple[bytes, bytes]] | None = None,
    path: str = "",
) -> None:
    """A complete JSON error response in OpenAI's shape (Anthropic's on its API's ``path``)."""
    note_error(code or str(status), message)
    shaped = error_body(status, message, code)
    if speaks_anthropic(path):
        shaped = anthropic_error(status, message)
    body = json.dumps(shaped).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


class RequestId:
    """Every response carries ``x-request-id``: the client's own (printable ASCII, at most 128
    characters) or a new one, so a client's log line and ours can be matched."""

    _VALID = re.compile(rb"^[\x21-\x7e]{1,128}$")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        rid = given if given and self._VALID.match(given) else f"req-{uuid.uuid4().hex}".encode()

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid)],
                }
            await send(message)

        await self.app(scope, receive, tagged)


class AuthGate:
    """Bearer keys checked from the headers alone, before a byte of the body is read: /admin
    needs the admin key, /v1 the API key when one is set. CORS preflights pass (they never
    carry credentials)."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_key: str) -> None:
        self.app = app
        self.keys = {"/v1": api_key, "/admin": admin_key}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path: str = scope.get("path", "")
            for prefix, key in self.keys.items():
                guarded = key is not None and (path == prefix or path.startswith(prefix + "/"))
                if guarded and not self._valid(scope, key):  # type: ignore[arg-type]
                    what = "admin" if prefix == "/admin" else "API"
                    await send_error(
                        send,
                        401,
                        f"missing or wrong {what} key (send 'Authorization: Bearer <key>' or "
                        "'x-api-key: <key>')",
                        "invalid_api_key",
                        [(b"www-authenticate", b"Bearer")],
                        path,
                    )
                    return
        await self.app(scope, receive, send)

    @staticmethod
    def _valid(scope: Scope, key: str) -> bool:
        """``Authorization: Bearer KEY``, or Anthropic's clients' ``x-api-key: KEY``."""
        header = (_header(scope, b"authorization") or b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if not token:
            token = (_header(scope, b"x-api-key") or b"").decode("latin-1").strip()
        return bool(token) and secrets.compare_digest(token.encode("latin-1"), key.encode())


class BodyGuard:
    """Reads a request's whole body before the app runs: over ``max_bytes`` (declared or, for a
    chunked body, as it arrives) is 413, a body not complete within ``timeout`` seconds is 408
    (both close the connection). The app then gets the body in one message, and later
    ``receive`` calls go to the server (disconnect detection keeps working)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        close = [(b"connection", b"close")]
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(
                send, 413, f"request body over {self.max_bytes} bytes", "body_too_large", close
            )
            return
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read(receive)
        except TimeoutError:
            await send_error(
                send, 408, f"request body not received within {self.timeout:g} s",
                "request_timeout", close,
            )  # fmt: skip
            return
        except _TooLarge:
            await send_error(
                send, 413, f"request body over {self.max_bytes} bytes", "body_too_large", close
            )
            return
        if body is None:  # the client went away mid-body: nobody to answer
            return
        if (_header(scope, b"content-type") or b"application/x-www-form-urlencoded").startswith(
            b"application/x-www-form-urlencoded"
        ):
            # The API speaks JSON only; `curl -d '{...}'` labels it a form. Read it as JSON.
            scope = {**scope, "headers": [
                *(h for h in scope["headers"] if h[0] != b"content-type"),
                (b"content-type", b"application/json"),
            ]}  # fmt: skip
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge  # stop reading here: the rest is not wanted
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


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
