"""Every request's blocks: its block table (per layer and stream), taken from the pool as its
tokens fill them, the cached pages it shares (the prefix cache's) and what it gives back. The
scheduler decides who runs; this keeps what each one holds. Engine thread only; no MLX.

A request holds, per layer and stream, the blocks its tokens fill and no more: ``2 * n_layers *
ceil(tokens / block_size)`` blocks, whatever it is batched with (``blocks.BlockMath``), and,
with ``--kv-recent-tokens``, its residual window's blocks in the model's type while it runs.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

from veloxquant_mlx.engine.loop import lookup
from veloxquant_mlx.engine.loop.blocks import BlockMath
from veloxquant_mlx.engine.loop.lookup import DiskReads
from veloxquant_mlx.engine.loop.prefix_cache import PrefixCache, SeqPages
from veloxquant_mlx.engine.loop.seq import Seq
from veloxquant_mlx.pool import BlockPoolAllocator, BlockPoolExhaustedError

STREAMS = ("k", "v")  # a shared pool resolves both to its one "kv" list


class BlockTables:
    """The requests' block tables over the shared pool, and the prefix cache's pages.

    The pool is the shared, thread-safe allocator; this is the only writer of the blocks it
    hands to requests.
    """

    def __init__(
        self,
        pool: BlockPoolAllocator,
        n_layers: int,
        prefix_caching: bool = False,
        *,
        answers_up_to: int | None = None,
        kv_format: str = "fp16",
        windows: dict[str, int] | None = None,
        window_format: str = "",
        spans: dict[str, int] | None = None,
    ) -> None:
        self.pool = pool
        self.cache = PrefixCache(pool, n_layers) if prefix_caching else None
        self.n_layers = n_layers
        # ``spans``: blocks per layer and stream a page of each format takes (--kv-formats;
        # "" for the server's own), None: one format.
        self.blocks = BlockMath(pool, n_layers, windows or {}, spans or {})
        # Cache a leaving row's generated pages too (``cache_leaving``) while at most this
        # many requests run (None: always); ``row_pages`` and ``prefill_pages`` are set by the
        # engine to the runner's (no MLX here).
        self.answers_up_to = answers_up_to
        self.kv_format = kv_format  # the format tag the pool records on blocks (kv.codec)
        # A row's residual window (--kv-recent-tokens), kept by the layout in the model's
        # type: ``blocks.window(format)`` blocks of each stream, tagged ``window_format``,
        # held while it runs.
        self.window_format = window_format
        self.row_pages: Callable[[Seq], Callable[[int], Any] | None] = lambda seq: None
        self.prefill_pages: Callable[[Seq], tuple[int, Any] | None] = lambda seq: None
        # The disk tier past the cached pages (the engine's, when --prefix-cache-dir is set)
        self.disk: DiskReads | None = None
        self.max_block_id = -1  # the highest block id ever handed out (sizes the paged store)

    # ------------------------------------------------------------------ taking

    def take(self, seq: Seq, hits: list[Any], n_tokens: int) -> bool:
        """Give ``seq`` its cached pages, blocks for the rest of ``n_tokens`` and what the
        disk tier read past its pages; False (and nothing held) if the pool cannot."""
        cache = self.cache
        if hits:
            assert cache is not None
            cache.acquire(hits)
            seq.table = [[b for p in hits for b in p.column(j)] for j in range(2 * self.n_layers)]
        if not self.grow(seq, n_tokens) or not self._take_window(seq):
            self.pool.free_all(seq.request_id)
            if hits:
                assert cache is not None
                cache.release(hits)
            seq.table = []
            return False  # counted when it is admitted, not at every try
        if cache is None:
            return True
        bs = self.blocks.block_size
        if hits:
            seq.pages = SeqPages(
                held=list(hits),
                n_known=len(hits),
                tail=hits[-1].serial,
                tail_digest=hits[-1].digest,
                n_cached=seq.pages.n_cached,
            )
        n_hit = (len(hits) + lookup.take_disk(self.disk, seq, len(hits))) * bs
        if seq.preemptions == 0:  # what the client's prompt found: usage.cached_tokens
            seq.pages.n_cached = n_hit
            cache.count_lookup(len(seq.tokens), n_hit)
        seq.n_kv = n_hit  # the runner's prefill starts here, from the pages' KV
        return True

    def grow(self, seq: Seq, n_tokens: int) -> bool:
        """Make ``seq``'s table hold ``n_tokens`` tokens in every layer; False (and nothing
        taken) if the pool cannot."""
        need = self.blocks.blocks_for(n_tokens, seq.kv_format) - seq.n_blocks
        if need <= 0:
            return True
        per_call = need * self.n_layers
        self._evict_for(per_call)
        taken: list[list[Any]] = []
        fmt = seq.kv_format or self.kv_format
        try:
            for stream in STREAMS:
                n_tokens_call = per_call * self.blocks.block_size
                taken.append(self.pool.allocate(stream, n_tokens_call, seq.request_id, fmt))
        except BlockPoolExhaustedError:
            for blocks in taken:
                self.pool.free(blocks, owner=seq.request_id)
            return False
        if not seq.table:
            seq.table = [[] for _ in range(2 * self.n_layers)]
        for s, blocks in enumerate(taken):
            ids = [b.block_id for b in blocks]
            for layer in range(self.n_layers):
                seq.table[2 * layer + s].extend(ids[layer * need : (layer + 1) * need])
            self.max_block_id = max(self.max_block_id, max(ids))
        return True

    def _take_window(self, seq: Seq) -> bool:
        """The blocks ``seq``'s residual window takes (in the model's type, while it runs);
        False if the pool cannot give them (the caller frees what ``seq`` holds)."""
        window = self.blocks.window(seq.kv_format)
        if not window:
            return True
        self._evict_for(window)
        try:
            for stream in STREAMS:
                self.pool.allocate(
                    stream,
                    window * self.blocks.block_size,
                    seq.request_id,
                    self.window_format,
                )
        except BlockPoolExhaustedError:
            return False
        return True

    def _free_lists_min(self) -> int:
        return min(self.pool.n_free(s) for s in self.blocks.streams)

    def free_now(self) -> int:
        """Free blocks per free list, counting the cached ones nobody holds (evictable)."""
        free = self._free_lists_min()
        if self.cache is not None:
            per_page = self.blocks.per_page
            free += self.cache.n_evictable() * per_page
        return free

    def _evict_for(self, per_call: int) -> None:
        """Evict cached pages until the free lists hold ``per_call`` blocks per stream."""
        if self.cache is None:
            return
        need = self.blocks.per_stream(per_call)
        short = need - self._free_lists_min()
        if short > 0:
            per_page = self.blocks.per_page
            self.cache.evict_units(-(-short // per_page))

    # ------------------------------------------------------------------ giving back

    def release(self, seq: Seq) -> None:
        """Give back every block of ``seq`` (finish, cancel, failure or preemption); the cached
        pages it held stay cached (evictable once nobody holds them)."""
        if self.cache is not None:
            self.cache.release(seq.pages.held)
        n_cached = seq.pages.n_cached
        seq.pages = SeqPages(n_cached=n_cached)
        seq.preloaded = seq.disk_read = None
        seq.disk_turn = False
        self.pool.free_all(seq.request_id)
        seq.table = []
        seq.n_kv = 0
        seq.decoding = False

    def register(self, seq: Seq, n_tokens: int, kv_of: Any) -> None:
        """Cache ``seq``'s full pages among its first ``n_tokens`` tokens (their KV written);
        ``kv_of(index)`` gives a page's KV payload (None where the layout keeps it)."""
        if self.cache is not None and seq.table:
            fmt = seq.kv_format
            self.cache.register(
                seq.pages,
                seq.tokens,
                n_tokens,
                seq.table,
                seq.request_id,
                kv_of,
                fmt,
                self.blocks.span(fmt),
            )

    def cache_leaving(self, seq: Seq, n_running: int) -> None:
        """A request leaves (finish, cancel or preemption) while ``n_running`` run: cache the
        full pages its KV holds beyond those cached already. A row of the batch: the pages it
        generated, so the next turn of a conversation, which resends the answer, prefills only
        what is new (while at most ``answers_up_to`` requests run); ``row_pages(seq)`` is the
        layout's ``kv_of`` for the row (the runner's: nothing to copy where the layout keeps
        pages in the pool's blocks, a copy out of the dense working set otherwise). A prompt
        cut short in its prefill (``prefill_pages``): the pages its chunks wrote, so that a
        retry (an agent whose timeout ended a long prefill resends the prompt) or its return
        after a preemption starts from them instead of from nothing."""
        if self.cache is None:
            return
        rows = self.row_pages(seq)
        if rows is not None:
            up_to = self.answers_up_to
            if up_to is None or n_running <= up_to:
                self.register(seq, min(seq.n_kv, len(seq.tokens)), rows)
            return
        cut = self.prefill_pages(seq)
        if cut is not None:
            self.register(seq, *cut)

    def reset_cache(self) -> int:
        """Drop every cached page no request holds; returns the blocks freed."""
        return 0 if self.cache is None else self.cache.reset()

    # ------------------------------------------------------------------ counts

    def blocks_in_use(self) -> int:
        """Blocks running requests hold (a shared page counted once); the pool's own count also
        has the cached pages nobody holds (evictable: free for any allocation)."""
        cache = self.cache
        evictable = 0 if cache is None else cache.n_evictable() * cache.blocks_per_page
        return self.pool.stats.blocks_in_use() - evictable

    @property
    def mixed(self) -> bool:
        """Requests may ask for a KV format of their own (--kv-formats)."""
        return bool(self.blocks.spans)

    def blocks_by_format(self, running: Sequence[Seq]) -> dict[str, int]:
        """Pool blocks held, by the KV format they hold (the ``running`` requests' own and
        every cached page; the windows apart): what ``blocks_in_use`` counts, split."""
        out: collections.Counter[str] = collections.Counter()
        for seq in running:  # O(1) each: the pool counts an owner's blocks
            out[seq.kv_format or self.kv_format] += self.pool.n_blocks_for(seq.request_id)
        if self.cache is not None:
            for fmt, units in self.cache.units_by_format.items():
                out[fmt or self.kv_format] += units * 2 * self.n_layers
        return dict(out)

    def window_blocks_in_use(self, running: Sequence[Seq]) -> int:
        """Blocks the ``running`` rows' windows hold (both streams)."""
        return sum(2 * self.blocks.window(s.kv_format) for s in running)
