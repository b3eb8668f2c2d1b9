"""The channel between callers' threads and the engine thread: commands in, a snapshot out."""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.engine.loop.commands import Command
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import StepSnapshot

if TYPE_CHECKING:
    from veloxquant_mlx.engine.loop.disk_tier import DiskTier
    from veloxquant_mlx.engine.loop.runner import Runner
    from veloxquant_mlx.engine.loop.scheduler import Scheduler


@dataclass(slots=True)
class Counters:
    """Request and token counters; guarded by the inbox lock."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: collections.Counter[str] = field(default_factory=collections.Counter)
    failed: collections.Counter[str] = field(default_factory=collections.Counter)  # by code


def disk_fields(disk: DiskTier) -> dict[str, Any]:
    """The disk tier's counters as they are now: its writer thread moves them between the
    engine's steps too, so a caller's thread reads them live, not from the last snapshot."""
    return {
        "prefix_disk": True,
        "prefix_disk_pages": disk.n_pages(),
        "prefix_disk_bytes": disk.bytes,
        "prefix_disk_hits_total": disk.hits,
        "prefix_disk_writes_total": disk.writes,
        "prefix_disk_dropped_total": disk.dropped,
        "prefix_disk_skipped_total": disk.skipped,
    }


def snapshot_of(sched: Scheduler, runner: Runner, holds_a_request: bool) -> StepSnapshot:
    """The engine as it is after a turn (engine thread); the disk tier's counters are read
    live by ``stats`` (``disk_fields``)."""
    cache = None if sched.cache is None else sched.cache.refresh_counts()
    extra: dict[str, Any] = {}
    if cache is not None:
        extra = {
            "prefix_caching": True,
            "cached_blocks": cache.blocks,
            "evictable_blocks": cache.evictable_blocks,
            "prefix_queries_total": cache.queries,
            "prefix_hits_total": cache.hits,
            "prefix_evictions_total": cache.evictions,
        }
    return StepSnapshot(
        running=len(sched.running),
        waiting=len(sched.waiting),
        blocks_in_use=sched.tables.blocks_in_use(),
        preemptions_total=sched.preemptions,
        kv_layout=runner.kv.kind,
        kv_format=sched.tables.kv_format,
        kv_format_blocks=tuple(sorted(sched.tables.blocks_by_format(sched.running).items()))
        if sched.tables.mixed
        else (),
        **_window(sched),
        ragged_attention=runner.kv.ragged.label,
        kv_working_bytes=runner.kv.nbytes(),
        mlx_memory=(
            ("active", mx.get_active_memory()),
            ("cache", mx.get_cache_memory()),
            ("peak", mx.get_peak_memory()),
        ),
        waiting_tokens=sum(len(s.tokens) - s.n_kv for s in sched.waiting),
        prefill_budget=sched.prefill_budget,
        holds_a_request=holds_a_request,
        **extra,
    )


class Inbox:
    """The one channel from callers' threads to the engine thread, and back (the snapshot).

    ``lock`` (a Condition) guards every field; it is never held across an MLX call.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.adds: collections.deque[RequestHandle] = collections.deque()
        self.cancels: set[int] = set()
        self.commands: collections.deque[tuple[Command, Future[Any]]] = collections.deque()
        self.draining = False
        self.drain_deadline: float | None = None
        self.alive = False
        self.counters = Counters()
        self.snapshot = StepSnapshot()
        # queued in the scheduler, mirrored for submit's bound: counted up as ``Turns._take``
        # takes requests, set when they are queued or cancelled and as each turn's plan leaves
        # them (``EngineCore._count_waiting``)
        self.n_waiting = 0
        # the disk tier, whose writer counts while the engine is idle (``disk_fields``)
        self.disk: DiskTier | None = None

    def close(self) -> tuple[list[RequestHandle], list[tuple[Command, Future[Any]]]]:
        """The engine is dead: no more intake. Returns what callers had sent that it never
        took (new requests, commands) so they can be answered."""
        with self.lock:
            self.alive = False
            adds, commands = list(self.adds), list(self.commands)
            self.adds.clear()
            self.commands.clear()
        return adds, commands


def _window(sched: Scheduler) -> dict[str, Any]:
    """The residual windows' format and the blocks they hold (--kv-recent-tokens)."""
    if not sched.blocks.windows:
        return {}
    return {"kv_window_format": sched.tables.window_format,
            "kv_window_blocks": sched.tables.window_blocks_in_use(sched.running)}  # fmt: skip
