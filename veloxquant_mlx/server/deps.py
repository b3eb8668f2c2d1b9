"""Request-scoped dependencies: the app's long-lived objects (keys are checked by AuthGate)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from veloxquant_mlx.config import Settings
from veloxquant_mlx.engine.client import EngineClient
from veloxquant_mlx.server.answers import AnswerTokens
from veloxquant_mlx.server.errors import APIError
from veloxquant_mlx.server.metrics import Metrics
from veloxquant_mlx.server.rates import RateWindow
from veloxquant_mlx.server.registration import Registration
from veloxquant_mlx.server.response_store import ResponseStore


@dataclass(slots=True)
class AppState:
    """What the lifespan builds: read by routes, owned by the app."""

    settings: Settings
    engine: EngineClient
    metrics: Metrics
    model_name: str
    draining: bool = False
    registration: Registration | None = None  # --register-with
    rate: RateWindow = field(default_factory=RateWindow)  # generated tokens/s (/v1/loads)
    answers: AnswerTokens = field(default_factory=AnswerTokens)  # --resent-answers
    responses: ResponseStore = field(default_factory=ResponseStore)  # --responses-store
    started: int = field(default_factory=lambda: int(time.time()))  # unix time, for /v1/models


def state(request: Request) -> AppState:
    st: Any = getattr(request.app.state, "vq", None)
    if st is None:
        raise APIError(
            503, "the server is starting", code="not_ready", headers={"Retry-After": "5"}
        )
    return st
