"""Who runs and who waits, and what each step does: admission against the pool, block tables,
preemption, the prefill budget. Every scheduling decision is made here (``schedule``); the
runner executes the plan and the core delivers. No MLX.

A request holds, per layer and stream, the blocks its tokens fill and no more: ``2 * n_layers *
ceil(tokens / block_size)`` blocks, whatever it is batched with (``blocks.BlockMath``). It is
admitted when the pool can hold its prompt now (``max_tokens`` is not reserved); it gets one
more block per layer and stream when its tokens fill the last one. When the pool runs out
mid-decode, the newest running request is preempted: its blocks go back, it returns to the head
of the queue, and later its prompt and the tokens it has generated are prefilled again (vLLM's
recompute policy), so no running request ever fails for lack of memory and nobody's budget is
held hostage by a ``max_tokens`` that is rarely used.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

from veloxquant_mlx.engine.loop import lookup
from veloxquant_mlx.engine.loop.blocks import BlockMath
from veloxquant_mlx.engine.loop.lookup import DiskReads
from veloxquant_mlx.engine.loop.prefill_budget import PrefillBudget
from veloxquant_mlx.engine.loop.prefill_parts import PrefillParts
from veloxquant_mlx.engine.loop.prefill_plan import plan_prefill
from veloxquant_mlx.engine.loop.prefix_cache import PrefixCache, SeqPages
from veloxquant_mlx.engine.loop.seq import Seq, StepPlan
from veloxquant_mlx.pool import BlockPoolAllocator, BlockPoolExhaustedError

STREAMS = ("k", "v")  # a shared pool resolves both to its one "kv" list


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
        *,
        prefill_step: int = 512,
        prefill_budget: int = 512,
        idle_prefill_budget: int = 2048,
        stall_ratio: float = 0.0,
        prefill_parts: int | None = 1,
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
        self.max_running = max_running
        self.max_queue = max_queue
        self.prefill_step = prefill_step  # prompt tokens per forward at most
        # Prompt tokens per step at most, rows decoding (moved by measurement under a stall
        # ratio: prefill_budget.py) and none decoding (``idle``)
        self.budget = PrefillBudget(prefill_budget, idle_prefill_budget, stall_ratio)
        # The parts a chunk beside decoding rows is launched in (None: adaptive, sized by the
        # budget's reference gaps: prefill_parts.py)
        self.parts = PrefillParts(prefill_parts, self.budget.gaps)
        # Cache a leaving row's generated pages too (``cache_leaving``) while at most this
        # many requests run (None: always); ``row_pages`` and ``prefill_pages`` are set by the
        # engine to the runner's (the scheduler runs no MLX).
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
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.max_block_id = -1  # the highest block id ever handed out (sizes the paged store)
        self.preemptions = 0

    @property
    def prefill_budget(self) -> int:
        return self.budget.tokens

    @property
    def idle_prefill_budget(self) -> int:
        return self.budget.idle

    # ------------------------------------------------------------------ blocks

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
            self.cache.evict_units(-(-short // per_page))

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

    def cache_leaving(self, seq: Seq) -> None:
        """A request leaves (finish, cancel or preemption): cache the full pages its KV holds
        beyond those cached already. A row of the batch: the pages it generated, so the next
        turn of a conversation, which resends the answer, prefills only what is new (while at
        most ``answers_up_to`` requests run); ``row_pages(seq)`` is the layout's ``kv_of`` for
        the row (the runner's: nothing to copy where the layout keeps pages in the pool's
        blocks, a copy out of the dense working set otherwise). A prompt cut short in its
        prefill (``prefill_pages``): the pages its chunks wrote, so that a retry (an agent
        whose timeout ended a long prefill resends the prompt) or its return after a
        preemption starts from them instead of from nothing."""
        if self.cache is None:
            return
        rows = self.row_pages(seq)
        if rows is not None:
            up_to = self.answers_up_to
            if up_to is None or len(self.running) <= up_to:
                self.register(seq, min(seq.n_kv, len(seq.tokens)), rows)
            return
        cut = self.prefill_pages(seq)
        if cut is not None:
            self.register(seq, *cut)

    def reset_cache(self) -> int:
        """Drop every cached page no request holds; returns the blocks freed."""
        return 0 if self.cache is None else self.cache.reset()

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

    def blocks_by_format(self) -> dict[str, int]:
        """Pool blocks held, by the KV format they hold (running requests' own and every
        cached page; the windows apart): what ``blocks_in_use`` counts in the pool, split."""
        out: collections.Counter[str] = collections.Counter()
        for seq in self.running:  # O(1) each: the pool counts an owner's blocks
            out[seq.kv_format or self.kv_format] += self.pool.n_blocks_for(seq.request_id)
        if self.cache is not None:
            for fmt, units in self.cache.units_by_format.items():
                out[fmt or self.kv_format] += units * 2 * self.n_layers
        return dict(out)

    # ------------------------------------------------------------------ queue

    def share(self) -> int:
        """The running slots one group may hold while another waits under its own: the slots
        split evenly between the groups running or waiting (at least one each)."""
        groups = {s.group for s in self.running} | {s.group for s in self.waiting}
        return max(1, -(-self.max_running // max(1, len(groups))))

    def admit(self) -> tuple[list[Seq], list[Seq]]:
        """Admit waiting requests in FIFO order while the pool holds their prompts now (plus
        the first generated token), keeping one block per running row in reserve. A request
        whose group holds its share of the running slots (``share``) is passed over, keeping
        its place, while a request of a group under its share waits behind it.

        Returns:
            (admitted, unservable): the admitted in order, with their blocks; the ones a
            shrink made too large for the pool, taken out of the queue for the caller to answer.
        """
        admitted: list[Seq] = []
        unservable: list[Seq] = []
        share = self.share()
        held = collections.Counter(s.group for s in self.running)
        under = {s.group for s in self.waiting if held[s.group] < share}  # waiting, under share
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_running:
            head = self.waiting[i]
            n = len(head.tokens) + 1
            fmt, span = head.kv_format, self.blocks.span(head.kv_format)
            if not self.blocks.could_ever_fit(n, fmt):
                unservable.append(head)
                del self.waiting[i]
                continue
            if held[head.group] >= share and under - {head.group}:
                i += 1  # at its share while another group waits under its own
                continue
            hits = lookup.hits(self.cache, head)
            if lookup.shares_a_prefill(self.cache, head, len(hits), self.running):
                i += 1  # its next pages are being prefilled by another: it will hit them
                continue
            reserve = self.blocks.per_stream(self.n_layers * len(self.running))
            free = self._free_now() - self.blocks.per_stream(
                self.n_layers * sum(p.span for p in hits if p.refs == 0)
            )
            need = self.blocks.per_stream(
                self.n_layers * (self.blocks.blocks_for(n, fmt) - len(hits) * span)
                + self.blocks.window(fmt)
            )
            if self.running and free - need < reserve:
                break  # FIFO for memory: nobody overtakes the head
            # its next pages are on disk: read only for a request the pool holds now, a few
            # at a time (a read's KV waits outside the pool until it is admitted)
            if not lookup.disk_ready(self.disk, self.cache, head, hits, self.waiting):
                i += 1  # being read (or waiting for a reader's turn): the others go on
                continue
            if not self._take(head, hits, n):
                break
            del self.waiting[i]
            self.running.append(head)
            held[head.group] += 1
            if held[head.group] >= share:
                under.discard(head.group)
            admitted.append(head)
        return admitted, unservable

    def reclaim(self, plan: StepPlan) -> None:
        """The running slots are full and a group under its share waits: preempt the newest
        request of the group furthest over its share (it is recomputed later, from its cached
        pages), until the waiting group has a slot."""
        while len(self.running) >= self.max_running and self.waiting:
            share = self.share()
            held = collections.Counter(s.group for s in self.running)
            if not any(held[s.group] < share for s in self.waiting):
                return
            over = [g for g, c in held.items() if c > share]
            if not over:
                return
            group = max(over, key=lambda g: held[g])
            victim = next(s for s in reversed(self.running) if s.group == group)
            self.preempt(victim)
            plan.preempted.append(victim)

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

    def window_blocks_in_use(self) -> int:
        """Blocks the running rows' windows hold (both streams)."""
        return sum(2 * self.blocks.window(s.kv_format) for s in self.running)

    def _take(self, seq: Seq, hits: list[Any], n_tokens: int) -> bool:
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

    def ready(self) -> bool:
        """Whether a step has work: a request runs, or one waits that is not waiting for the
        disk tier's reader (whose finished reads wake the engine), or for a reader's turn."""
        return bool(self.running) or any(
            not s.disk_turn and (s.disk_read is None or s.disk_read.done()) for s in self.waiting
        )

    def victim(self) -> Seq:
        """The request to preempt when the pool runs out: the newest running one."""
        return self.running[-1]

    def preempt(self, seq: Seq) -> None:
        """Free ``seq``'s blocks and put it back at the head of the queue. The full pages it
        computed stay cached (evictable): its return may hit them."""
        self.cache_leaving(seq)
        self.running.remove(seq)
        self.release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ the plan

    def schedule(self, prefill: bool = True) -> StepPlan:
        """Decide this step: take back slots a group holds over its fair share while another
        waits, admit, make room for every decoding row's next token (preempting the newest
        requests while the pool is out), then spend the prefill budget (not with ``prefill``
        False: a chunk planned earlier is still being launched a part a turn).
        Writes the planned ``n_kv`` of the prefilled requests; ``decoded`` advances the
        decoding rows' once the step is built."""
        plan = StepPlan()
        self.reclaim(plan)
        plan.admitted, plan.unservable = self.admit()
        self.make_room(plan)
        decoding = sum(s.decoding for s in self.running)
        if prefill:
            plan_prefill(
                plan,
                self.running,
                self.prefill_budget,
                self.idle_prefill_budget,
                self.prefill_step,
            )
        if decoding and plan.chunks:
            plan.chunks = self.parts.assign(plan.chunks, decoding)
        for seq in [*plan.together, *(c.seq for c in plan.chunks if c.completes)]:
            # Admission took blocks for the prompt and the first token: nothing to grow.
            need = self.blocks.blocks_for(seq.n_kv + 1, seq.kv_format)
            assert seq.n_blocks >= need, "a row joins short"
        return plan

    @property
    def learns(self) -> bool:
        """Whether the budget or the parts move by the turns' gaps (``turn_ended``)."""
        return self.budget.adaptive or self.parts.auto

    def turn_ended(self, gap: float, prefilled: int, launched: float, decoding: int) -> None:
        """A turn ended ``gap`` seconds after the previous one, having planned ``prefilled``
        prompt tokens and launched ``launched`` tokens' worth of prefill (parts of chunks
        planned earlier included) beside ``decoding`` rows: what the budget and the parts
        learn from."""
        counted = self.budget.observe(gap, prefilled, decoding, touched=launched > 0)
        self.parts.observe(gap, launched, decoding, counted)

    def decoded(self, rows: list[Seq | None]) -> None:
        """The step over ``rows`` (the batch's, holes as None) is built: each row's KV now
        holds (or will, when it runs) one more token."""
        for seq in rows:
            if seq is not None:
                seq.n_kv += 1

    def make_room(self, plan: StepPlan) -> None:
        """Give each decoding row (oldest first) the block its next token needs; while the pool
        is out, preempt the newest running request. A request that outgrows the whole pool
        alone goes to ``plan.outgrown``."""
        for seq in [s for s in self.running if s.decoding]:
            while seq.decoding:  # until it has room; False once preempted (released)
                before = seq.n_blocks
                if self.grow(seq, seq.n_kv + 1):
                    if seq.n_blocks != before:
                        plan.grown.append((seq, before))
                    break
                victim = self.victim()
                if victim is seq and len(self.running) == 1:
                    configured = not self.blocks.fits_configured(seq.n_kv + 1, seq.kv_format)
                    plan.outgrown.append((seq, configured))
                    break
                self.preempt(victim)
                plan.preempted.append(victim)

    def finish(self, seq: Seq) -> None:
        """Take ``seq`` out (running or waiting) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self.release(seq)
