"""What a waiting request starts from: the cached pages its prompt begins with, whether it
should wait for a request prefilling its next page, and the pages the disk tier reads past
them. Functions of the scheduler's admission (engine thread). No MLX.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Protocol

from veloxquant_mlx.engine.loop.prefix_cache import Page, PrefixCache
from veloxquant_mlx.engine.loop.seq import Seq

log = logging.getLogger("veloxquant.engine")

# Waiting requests holding a disk read (in flight, or done and not yet admitted) at most: a
# read's KV is memory outside the pool until its request is admitted.
MAX_DISK_READS = 2


class DiskReads(Protocol):
    """The prefix cache's disk tier as admission uses it (``disk_tier.DiskTier``)."""

    def start_read(
        self, tokens: list[int], first: int, parent: bytes, limit: int, bs: int
    ) -> Future[Any] | None:
        """Read the pages of ``tokens`` from page ``first`` on (up to ``limit``) off the
        engine thread; None when the tier lacks page ``first``."""

    def has_page(self, tokens: list[int], first: int, parent: bytes, bs: int) -> bool:
        """Whether the tier holds page ``first`` of ``tokens`` (its parent's digest
        ``parent``)."""

    def run_kv(self, run: Any, skip: int) -> Any:
        """A finished read's KV past its first ``skip`` pages (``run.first``, ``run.n_pages``
        say which it holds)."""


def hits(cache: PrefixCache | None, seq: Seq) -> list[Page]:
    """The cached pages ``seq``'s tokens start with, leaving at least its last token to
    prefill (its logits sample the next one)."""
    if cache is None:
        return []
    return cache.match(seq.tokens, len(seq.tokens) - 1, seq.kv_format)


def shares_a_prefill(cache: PrefixCache | None, seq: Seq, n_hits: int, running: list[Seq]) -> bool:
    """Whether a running request still prefilling has ``seq``'s next full page (after its
    ``n_hits`` cached ones) in its own prompt, not yet cached: admitted now, ``seq`` would
    prefill the same tokens beside it; admitted once that prompt is in (its pages
    registered), it hits them. Sessions of an agent that start together with one long
    system prompt then prefill it once, not once each. (A request of another KV format
    would not hit them: it does not wait.)"""
    if cache is None:
        return False
    b = (n_hits + 1) * cache.block_size
    if len(seq.tokens) <= b:  # no full page left to share (the last token is prefilled)
        return False
    prefix = seq.tokens[:b]
    return any(
        not other.decoding and other.kv_format == seq.kv_format and other.tokens[:b] == prefix
        for other in running
    )


def disk_ready(
    disk: DiskReads | None,
    cache: PrefixCache | None,
    seq: Seq,
    hits: list[Page],
    waiting: Iterable[Seq],
) -> bool:
    """Whether ``seq`` may be admitted as far as the disk tier goes: the tier has no page
    past its ``hits``, or the reader has read them. The first time, starts that read (the
    server's own KV format only: the tier's files hold that one), unless requests of
    ``waiting`` hold ``MAX_DISK_READS`` already: then it waits its turn."""
    if disk is None or cache is None or seq.kv_format:
        return True
    if seq.disk_read is None:
        bs = cache.block_size
        parent = hits[-1].digest if hits else cache.root
        limit = (len(seq.tokens) - 1) // bs  # its last token is prefilled
        seq.disk_turn = False
        if len(hits) >= limit or not disk.has_page(seq.tokens, len(hits), parent, bs):
            return True
        if sum(s.disk_read is not None for s in waiting) >= MAX_DISK_READS:
            seq.disk_turn = True  # until a read finishes (its callback wakes the engine)
            return False
        seq.disk_read = disk.start_read(seq.tokens, len(hits), parent, limit, bs)
        if seq.disk_read is None:
            return True
    return bool(seq.disk_read.done())


def take_disk(disk: DiskReads | None, seq: Seq, n_hits: int) -> int:
    """The pages the disk tier read for ``seq`` past its ``n_hits`` cached ones (their KV
    in ``seq.preloaded``): what the read found from where the memory hits end now (pages
    cached meanwhile are skipped; if memory lost pages before the read's first, none)."""
    future, seq.disk_read = seq.disk_read, None
    if future is None or disk is None:
        return 0
    try:
        run = future.result(0)
    except Exception:  # the reader's own bug: the pages are prefilled instead
        log.exception("prefix cache on disk: a read failed")
        return 0
    skip = n_hits - run.first
    if skip < 0 or run.n_pages <= skip:
        return 0
    seq.preloaded = disk.run_kv(run, skip)
    return int(run.n_pages - skip)
