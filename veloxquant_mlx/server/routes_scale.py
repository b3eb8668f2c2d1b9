"""The router contract: ``GET /v1/loads``, the load one replica reports to a router.

The schema is SMG's (the Shepherd Model Gateway polls ``/v1/loads`` of every HTTP worker for its
load-aware policies: ``WorkerLoadResponse`` with one ``SchedulerLoadSnapshot`` per data-parallel
rank; we are one rank). Tokens are the pool's, as it is now: capacity after any shrink, used =
the blocks running requests hold (a token block is ``2 x layers`` pool blocks: K and V of every
layer), so a shrunk or busy replica reports less room and a router sends its traffic elsewhere.
Cached blocks no request holds are free to any allocation (evicted first) and do not count as
used. Health for routers is ``GET /ready`` (503 while loading or draining, or with the pool
shrunk below one request), never ``/health``.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request

from veloxquant_mlx.engine.types import EngineView
from veloxquant_mlx.server.deps import AppState, state

router = APIRouter()


def load_report(st: AppState, view: EngineView, include: set[str]) -> dict[str, Any]:
    """``WorkerLoadResponse`` for ``view``; ``include`` may add "memory" and "queues"."""
    stats, pool = view.stats, view.pool
    per_token_block = 2 * max(1, st.engine.kv_layers)
    block_size = pool.block_size if pool is not None else st.settings.block_size
    capacity = (pool.stats.n_blocks if pool is not None else 0) // per_token_block * block_size
    used = min(capacity, -(-stats.blocks_in_use // per_token_block) * block_size)
    queries = stats.prefix_queries_total
    running, waiting = stats.running, stats.waiting
    snapshot: dict[str, Any] = {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": capacity,
        "token_usage": used / capacity if capacity else 1.0,
        "gen_throughput": st.rate.update(stats.generated_tokens_total),
        "cache_hit_rate": stats.prefix_hits_total / queries if queries else 0.0,
        "utilization": running / st.settings.max_running,
        "max_running_requests": st.settings.max_running,
        "num_waiting_uncached_tokens": stats.waiting_tokens,
    }
    if "memory" in include:
        per_block = stats.kv_bytes_per_block
        snapshot["memory"] = {
            "kv_cache_gb": (pool.stats.n_blocks if pool else 0) * per_block / 1e9,
            "token_capacity": capacity,
        }
    if "queues" in include:
        snapshot["queues"] = {"waiting": waiting, "retracted": 0}
    group = st.engine.group_info
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "dp_rank_count": 1,  # a group over mx.distributed is one replica to a router
        "world_size": group.world_size,
        "parallel": group.mode,
        "loads": [snapshot],
        "aggregate": {
            "total_running_reqs": running,
            "total_waiting_reqs": waiting,
            "total_reqs": running + waiting,
            "avg_token_usage": snapshot["token_usage"],
            "avg_throughput": snapshot["gen_throughput"],
            "avg_utilization": snapshot["utilization"],
        },
    }


@router.get("/v1/loads")
async def loads(request: Request, include: str = "core") -> dict[str, Any]:
    """This replica's load, in SMG's ``/v1/loads`` schema (``?include=core,memory,queues``)."""
    st = state(request)
    view = await asyncio.to_thread(st.engine.view)
    return load_report(st, view, {part.strip() for part in include.split(",")})
