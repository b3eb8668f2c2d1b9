"""A restarted engine's conversations back into memory before it is ready
(``--prefix-cache-preload-gb``): the budget in pages, the conversations the disk tier names
(``DiskTier.chains``), each cut to what the pool can hold, and one log line before and after.
Engine thread, at start."""

from __future__ import annotations

import logging
import time

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.loop.core import EngineCore
from veloxquant_mlx.engine.loop.disk_tier import DiskTier
from veloxquant_mlx.engine.loop.warmup import PRELOAD_ID
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams

log = logging.getLogger("veloxquant.engine")


def preload(core: EngineCore, disk: DiskTier, cfg: EngineConfig, block_bytes: int) -> None:
    """Read the disk tier's most recent conversations into ``core``'s prefix cache, up to
    ``cfg.prefix_cache_preload_gb`` GiB of KV (None: half the pool); ``block_bytes``: one
    block's (one layer's K or V of ``block_size`` tokens)."""
    blocks = core.scheduler.blocks
    pool_pages = min(blocks.pool.n_total(s) for s in blocks.streams) // blocks.per_page
    pages = pool_pages // 2
    if cfg.prefix_cache_preload_gb is not None:
        page_bytes = block_bytes * 2 * blocks.n_layers  # K and V of every layer
        pages = min(int(cfg.prefix_cache_preload_gb * 2**30) // max(1, page_bytes), pool_pages - 1)
    if pages <= 0:
        return
    started = time.monotonic()
    runs = []
    for tokens in disk.chains(pages):
        while tokens and not blocks.could_ever_fit(len(tokens) + 1):
            tokens = tokens[: -cfg.block_size]
        if tokens:
            runs.append(tokens)
    if not runs:
        return
    log.info(
        "prefix cache: reading %d conversations (%d tokens) from disk into memory before "
        "the server is ready (--prefix-cache-preload-gb)", len(runs), sum(map(len, runs)),
    )  # fmt: skip
    read = read_back(core, disk, runs[::-1])  # the most recent last: the newest in the LRU
    log.info(
        "prefix cache: %d pages of %d conversations read from disk into memory in %.1f s",
        read, len(runs), time.monotonic() - started,
    )  # fmt: skip


def read_back(core: EngineCore, disk: DiskTier, prompts: list[list[int]]) -> int:
    """A one-token request for each of ``prompts`` (the most recent last), each its tokens
    and one more, so every full page of it is read from disk and cached in memory as if its
    conversation had just run; the counters stay as they were (nothing was asked). Returns
    the pages read from disk."""
    cache = core.scheduler.cache
    if cache is None:
        return 0
    before, counts = disk.hits, (cache.counts.queries, cache.counts.hits)
    greedy = SamplingParams(temperature=0.0)
    core.run_before_ready(
        [GenerationRequest((*tokens, tokens[-1]), 1, greedy) for tokens in prompts], PRELOAD_ID
    )
    read, disk.hits = disk.hits - before, before
    cache.counts.queries, cache.counts.hits = counts
    core.reset_after_start()
    return read
