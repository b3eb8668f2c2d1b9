"""Who runs and who waits: admission against the pool, block tables, preemption. No MLX.

A request holds, per layer and stream, the blocks its tokens fill and no more: ``2 * n_layers *
ceil(tokens / block_size)`` blocks, whatever it is batched with. It is admitted when the pool can
hold its prompt now (``max_tokens`` is not reserved); it gets one more block per layer and
stream when its tokens fill the last one. When the pool runs out mid-decode, the newest running
request is preempted: its blocks go back, it returns to the head of the queue, and later its
prompt and the tokens it has generated are prefilled again (vLLM's recompute policy), so no
running request ever fails for lack of memory and nobody's budget is held hostage by a
``max_tokens`` that is rarely used.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any

from veloxquant_mlx.engine.loop.blocks import BlockMath
from veloxquant_mlx.engine.loop.prefix_cache import PrefixCache, SeqPages
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.pool import BlockPoolAllocator, BlockPoolExhaustedError

STREAMS = ("k", "v")  # a shared pool resolves both to its one "kv" list


@dataclass(eq=False, slots=True)
class Seq:
    """One request's tokens and block table. Owned by the scheduler; the runner reads it.

    ``table[2 * layer]`` lists the K block ids of ``layer`` in position order, ``[2 * layer +
    1]`` its V blocks. ``tokens`` is the prompt then every generated token; ``n_kv`` how many of
    them have KV written (or in flight).
    """

    handle: RequestHandle
    tokens: list[int]
    n_prompt: int
    table: list[list[int]] = field(default_factory=list)
    n_kv: int = 0
    preemptions: int = 0
    state: Any = None  # the runner's per-request MLX state (sampler, processors, prefill)
    pages: SeqPages = field(default_factory=SeqPages)  # its side of the prefix cache
    out: Any = None  # the core's per-request output state (detokenizer, stops, counts)

    @property
    def request_id(self) -> int:
        return self.handle.request_id

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def n_blocks(self) -> int:
        """Blocks per layer and stream."""
        return len(self.table[0]) if self.table else 0


class Scheduler:
    """The waiting FIFO, the running list (admission order) and every request's blocks.

    Engine thread only, except ``n_waiting`` (a length read). The pool is the shared,
    thread-safe allocator; this is the only writer of the blocks it hands to requests.
    """

    def __init__(
        self,
        pool: BlockPoolAllocator,
        n_layers: int,
        max_running: int,
        max_queue: int,
        prefix_caching: bool = False,
    ) -> None:
        self.pool = pool
        self.cache = PrefixCache(pool, n_layers) if prefix_caching else None
        self.n_layers = n_layers
        self.blocks = BlockMath(pool, n_layers)
        self.block_size = pool.config.block_size
        self.max_running = max_running
        self.max_queue = max_queue
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.max_block_id = -1  # the highest block id ever handed out (sizes the paged store)
        self.preemptions = 0

    # ------------------------------------------------------------------ blocks

    def grow(self, seq: Seq, n_tokens: int) -> bool:
        """Make ``seq``'s table hold ``n_tokens`` tokens in every layer; False (and nothing
        taken) if the pool cannot."""
        need = self.blocks.blocks_for(n_tokens) - seq.n_blocks
        if need <= 0:
            return True
        per_call = need * self.n_layers
        self._evict_for(per_call)
        taken: list[list[Any]] = []
        try:
            for stream in STREAMS:
                taken.append(self.pool.allocate(stream, per_call * self.block_size, seq.request_id))
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

    def _free_lists_min(self) -> int:
        return min(self.pool.n_free(s) for s in self.blocks.streams)

    def _free_now(self) -> int:
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
            self.cache.evict(-(-short // per_page))

    def release(self, seq: Seq) -> None:
        """Give back every block of ``seq`` (finish, cancel, failure or preemption); the cached
        pages it held stay cached (evictable once nobody holds them)."""
        if self.cache is not None:
            self.cache.release(seq.pages.held)
        n_cached = seq.pages.n_cached
        seq.pages = SeqPages(n_cached=n_cached)
        self.pool.free_all(seq.request_id)
        seq.table = []
        seq.n_kv = 0

    def register(self, seq: Seq, n_tokens: int, kv_of: Any) -> None:
        """Cache ``seq``'s full pages among its first ``n_tokens`` tokens (their KV written);
        ``kv_of(index)`` gives a page's KV payload (None where the layout keeps it)."""
        if self.cache is not None and seq.table:
            self.cache.register(seq.pages, seq.tokens, n_tokens, seq.table, seq.request_id, kv_of)

    def reset_cache(self) -> int:
        """Drop every cached page no request holds; returns the blocks freed."""
        return 0 if self.cache is None else self.cache.reset()

    def blocks_in_use(self) -> int:
        """Blocks running requests hold (a shared page counted once); the pool's own count also
        has the cached pages nobody holds (evictable: free for any allocation)."""
        cache = self.cache
        evictable = 0 if cache is None else cache.n_evictable() * cache.blocks_per_page
        return self.pool.stats.blocks_in_use() - evictable

    # ------------------------------------------------------------------ queue

    def admit(self) -> tuple[list[Seq], list[Seq]]:
        """Admit waiting requests in FIFO order while the pool holds their prompts now (plus
        the first generated token), keeping one block per running row in reserve.

        Returns:
            (admitted, unservable): the admitted in order, with their blocks; the ones a
            shrink made too large for the pool, taken out of the queue for the caller to answer.
        """
        admitted: list[Seq] = []
        unservable: list[Seq] = []
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            n = len(head.tokens) + 1
            if not self.blocks.could_ever_fit(n):
                unservable.append(self.waiting.popleft())
                continue
            hits = self._hits(head)
            reserve = self.blocks.per_stream(self.n_layers * len(self.running))
            free = self._free_now() - self.blocks.per_stream(
                self.n_layers * sum(1 for p in hits if p.refs == 0)
            )
            need = self.blocks.per_stream(self.n_layers * (self.blocks.blocks_for(n) - len(hits)))
            if self.running and free - need < reserve:
                break  # FIFO: nobody overtakes the head
            if not self._take(head, hits, n):
                break
            self.waiting.popleft()
            self.running.append(head)
            admitted.append(head)
        return admitted, unservable

    def _hits(self, seq: Seq) -> list[Any]:
        """The cached pages ``seq``'s tokens start with, leaving at least its last token to
        prefill (its logits sample the next one)."""
        if self.cache is None:
            return []
        return self.cache.match(seq.tokens, len(seq.tokens) - 1)

    def _take(self, seq: Seq, hits: list[Any], n_tokens: int) -> bool:
        """Give ``seq`` its cached pages and blocks for the rest of ``n_tokens``; False (and
        nothing held) if the pool cannot."""
        if not hits:
            if not self.grow(seq, n_tokens):
                return False  # counted when it is admitted, not at every try
            if self.cache is not None and seq.preemptions == 0:
                self.cache.count_lookup(len(seq.tokens), 0)
            return True
        assert self.cache is not None
        self.cache.acquire(hits)
        seq.table = [[p.ids[j] for p in hits] for j in range(2 * self.n_layers)]
        if not self.grow(seq, n_tokens):
            self.cache.release(hits)
            seq.table = []
            return False
        n_hit = len(hits) * self.block_size
        seq.pages = SeqPages(list(hits), len(hits), hits[-1].serial, seq.pages.n_cached)
        if seq.preemptions == 0:  # what the client's prompt found: usage.cached_tokens
            seq.pages.n_cached = n_hit
            self.cache.count_lookup(len(seq.tokens), n_hit)
        seq.n_kv = n_hit  # the runner's prefill starts here, from the pages' KV
        return True

    def victim(self) -> Seq:
        """The request to preempt when the pool runs out: the newest running one."""
        return self.running[-1]

    def preempt(self, seq: Seq) -> None:
        """Free ``seq``'s blocks and put it back at the head of the queue."""
        self.running.remove(seq)
        self.release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Seq) -> None:
        """Take ``seq`` out (running or waiting) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self.release(seq)
