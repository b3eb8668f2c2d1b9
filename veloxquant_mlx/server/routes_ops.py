"""GET /health, GET /ready, GET /metrics, and the admin pool endpoints."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from veloxquant_mlx.engine.types import EngineError
from veloxquant_mlx.server.deps import state
from veloxquant_mlx.server.errors import APIError, error_body, from_engine
from veloxquant_mlx.server.metrics import as_dict
from veloxquant_mlx.server.schemas import ShrinkRequest

router = APIRouter()
admin = APIRouter(prefix="/admin")  # the admin key is checked before the body (AuthGate)


@router.get("/health", response_model=None)
async def health(request: Request) -> Any:
    """Liveness: 200 while the process can serve (loading, serving or draining); 503 once the
    engine has failed (the process is about to exit non-zero for its supervisor to restart),
    or has shown no progress with work to do for 4x ``--engine-stall-timeout``."""
    st = getattr(request.app.state, "vq", None)
    if st is not None and not st.engine.alive and not st.engine.draining:
        return JSONResponse(
            error_body(503, "the engine has failed; the server is exiting", "engine_dead"),
            status_code=503,
            headers={"Retry-After": "5"},
        )
    if st is not None and st.engine.stalled_for() > 4 * st.settings.engine_stall_timeout:
        return _stalled(st.engine.stalled_for())
    return {"status": "ok"}


def _stalled(seconds: float) -> JSONResponse:
    return JSONResponse(
        error_body(503, f"the engine has shown no progress for {seconds:.0f} s", "engine_stalled"),
        status_code=503,
        headers={"Retry-After": "5"},
    )


@router.get("/ready", response_model=None)
async def ready(request: Request) -> Any:
    st = getattr(request.app.state, "vq", None)
    if st is None or st.draining or not st.engine.ready or st.engine.draining:
        why = "draining" if st is not None and (st.draining or st.engine.draining) else "not ready"
        return JSONResponse(
            error_body(503, f"the server is {why}", "not_ready"),
            status_code=503,
            headers={"Retry-After": "5"},
        )
    stalled = st.engine.stalled_for()
    if stalled > st.settings.engine_stall_timeout:
        return _stalled(stalled)
    stats = await asyncio.to_thread(st.engine.stats)  # a round trip to an engine process
    if not stats.holds_a_request:  # shrunk below one request: a router should send elsewhere
        return JSONResponse(
            error_body(503, "the KV pool has been shrunk below one request", "capacity_reduced"),
            status_code=503,
            headers={"Retry-After": "30"},
        )
    return {"status": "ready", "model": st.model_name}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = state(request)
    view = await asyncio.to_thread(st.engine.view)  # a round trip when the engine is a process
    return Response(st.metrics.render(view), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _pool_view(request: Request) -> dict[str, Any]:
    st = state(request)
    view = await asyncio.to_thread(st.engine.view)
    pool = view.pool
    if pool is None:
        raise APIError(503, "the engine is not ready", code="not_ready")
    return {
        "block_size": pool.block_size,
        "separate_kv": pool.separate_kv,
        "kv_bytes_per_block": st.engine.kv_bytes_per_block,
        "blocks_in_use_by_running": view.stats.blocks_in_use,
        "prefix_cache": _prefix_view(view.stats),
        "stats": as_dict(pool.stats),
        "streams": {s: {"free": pool.free[s], "total": pool.total[s]} for s in pool.free},
        "owners": pool.owners,
        "group": await _group_view(st),
    }


async def _group_view(st: Any) -> dict[str, Any]:
    """The mx.distributed group: every rank's pool, read between steps, beside rank 0's."""
    info = st.engine.group_info
    view: dict[str, Any] = {"world_size": info.world_size, "mode": info.mode}
    if info.world_size > 1:
        try:
            rows = await asyncio.to_thread(st.engine.group_pools)
        except EngineError as exc:
            raise from_engine(exc) from None
        view["ranks"] = [
            {"rank": r, "blocks": n, "free": free, "in_use": used, "owners": owners}
            for r, n, free, used, owners in rows
        ]
    return view


def _prefix_view(stats: Any) -> dict[str, Any]:
    """The pool's blocks told apart: held by requests, cached and evictable, free."""
    return {
        "enabled": stats.prefix_caching,
        "cached_blocks": stats.cached_blocks,
        "evictable_blocks": stats.evictable_blocks,
        "queries_tokens": stats.prefix_queries_total,
        "hits_tokens": stats.prefix_hits_total,
        "evicted_pages": stats.prefix_evictions_total,
    }


@admin.get("/pool")
async def pool_view(request: Request) -> dict[str, Any]:
    return await _pool_view(request)


@admin.post("/pool/shrink")
async def pool_shrink(body: ShrinkRequest, request: Request) -> dict[str, Any]:
    st = state(request)
    try:
        # engine.shrink waits for the engine thread to do it between steps (no MLX here)
        retired = await asyncio.to_thread(st.engine.shrink, body.stream, body.target_free)
    except EngineError as exc:
        raise from_engine(exc) from None
    return {"retired": retired, **(await _pool_view(request))}


@admin.post("/prefix-cache/reset")
async def prefix_cache_reset(request: Request) -> dict[str, Any]:
    """Drop every cached block no request holds (those running requests hold stay)."""
    st = state(request)
    try:
        freed = await asyncio.to_thread(st.engine.reset_prefix_cache)
    except EngineError as exc:
        raise from_engine(exc) from None
    return {"freed_blocks": freed, **(await _pool_view(request))}
