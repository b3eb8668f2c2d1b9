"""The messages between the server's ``EngineProcess`` and its child (``hosts.child``): frozen
values, pickled over one duplex pipe (``multiprocessing.connection``).

    server -> engine  Config (first), Add, Cancel, Call, Shutdown
    engine -> server  Ready | LoadError (once), Events (one a step, FinishEvents last),
                      Return (a Call's answer), Dead, Exit

Ids are the server's; the child's ``Engine`` keeps its own request ids (the pool's owners). A
refusal only the child can decide (queue full, a pool shrunk below the prompt, draining) comes
back as a FinishEvent carrying a ``types.Refusal``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.types import EngineInfo, FinishEvent, GenerationRequest, TokenEvent


@dataclass(frozen=True, slots=True)
class Config:
    config: EngineConfig
    log_format: str
    log_level: str
    switch_interval: float | None


@dataclass(frozen=True, slots=True)
class Add:
    request_id: int
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: int


@dataclass(frozen=True, slots=True)
class Call:
    """One of ``CALLS`` on the child's Engine, answered by a ``Return`` with ``call_id``."""

    call_id: int
    name: str
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Shutdown:
    drain_timeout: float


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class LoadError:
    kind: str  # the exception's type name (a builtin's is raised as itself)
    message: str


@dataclass(frozen=True, slots=True)
class Events:
    items: list[tuple[int, list[TokenEvent | FinishEvent]]]


@dataclass(frozen=True, slots=True)
class Return:
    call_id: int
    ok: bool
    value: Any  # the result, or the exception to raise


@dataclass(frozen=True, slots=True)
class Dead:
    message: str


@dataclass(frozen=True, slots=True)
class Exit:
    pass


# What the server may call on the child's Engine (anything else is refused).
CALLS = ("shrink", "reset_prefix_cache", "score", "view", "cancel_score")
