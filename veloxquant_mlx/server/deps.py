"""Request-scoped dependencies: the app's long-lived objects and key checks."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from veloxquant_mlx.config import Settings
from veloxquant_mlx.engine.engine import Engine
from veloxquant_mlx.server.errors import APIError
from veloxquant_mlx.server.metrics import Metrics


@dataclass(slots=True)
class AppState:
    """What the lifespan builds: read by routes, owned by the app."""

    settings: Settings
    engine: Engine
    metrics: Metrics
    model_name: str
    draining: bool = False


def state(request: Request) -> AppState:
    st: Any = getattr(request.app.state, "vq", None)
    if st is None:
        raise APIError(
            503, "the server is starting", code="not_ready", headers={"Retry-After": "5"}
        )
    return st


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _check(request: Request, key: str | None, what: str) -> None:
    if key is None:
        return
    given = _bearer(request)
    if given is None or not secrets.compare_digest(given.encode(), key.encode()):
        raise APIError(
            401,
            f"missing or wrong {what} key (send 'Authorization: Bearer <key>')",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_api_key(request: Request) -> None:
    _check(request, state(request).settings.api_key, "API")


def require_admin_key(request: Request) -> None:
    _check(request, state(request).settings.admin_key, "admin")
