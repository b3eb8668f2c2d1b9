"""The settings of the HTTP edge: body, header and idle limits, connection caps, how long a
stream's client or a grammar's compile may take. Each is a flag and a ``VQ_`` variable of
``Settings``, which takes them from here (docs/operations.md, "A guarded HTTP edge")."""

from __future__ import annotations

from pydantic import BaseModel, Field


class EdgeSettings(BaseModel):
    """The HTTP edge's limits (a part of ``Settings``)."""

    grammar_timeout: float = Field(
        5.0,
        gt=0,
        description="Seconds a structured-output or forced-tool schema may take to compile "
        "(then 400).",
    )
    stream_write_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds a stream's client may take no data before the stream is cancelled "
        "and its connection dropped.",
    )
    stream_keepalive: float = Field(
        10.0,
        ge=0,
        description="Seconds a stream waits for its first token before it starts anyway (the "
        "API's opening event, then a keep-alive every this many seconds until the first "
        "token), so that clients with an idle timeout (Codex's is 300 s) keep waiting "
        "through a long prefill or queue; an error after that start is an error event in the "
        "stream. 0: nothing is sent before the first token (every error an HTTP status).",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body (413).")
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, le=16 << 20, description="Largest request line + headers (431)."
    )
    header_timeout: float = Field(
        10.0, gt=0, description="Seconds a request's line and headers may take to arrive (408)."
    )
    body_timeout: float = Field(
        30.0, gt=0, description="Seconds a request's body may take to arrive (408)."
    )
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="Seconds an idle connection is kept open (then closed)."
    )
    max_connections: int = Field(
        1024,
        ge=1,
        description="Open connections at most; more are answered 503 and closed (8 more are "
        "kept for GET /health, /ready and /metrics).",
    )
    max_connections_per_client: int = Field(
        256,
        ge=1,
        description="Open connections from one client address at most (then 503); addresses "
        "in --trusted-proxies are held only to --max-connections.",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Reverse-proxy addresses whose connections are not counted per client "
        "(all their clients arrive from them), e.g. '[\"10.0.0.5\"]'.",
    )
