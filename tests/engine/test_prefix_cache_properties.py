"""Prefix-cache references and pool ownership through random sharing, forking and abandoning.

The scheduler with its prefix cache (pure Python) is driven the way the engine core drives it,
without a model: requests whose prompts share prefixes (two "system prompts", forks of each
other's generated text) arrive, get admitted (taking cached pages), are "prefilled" (their
prompt's pages registered), step (one more token each, preempting the newest when the pool is
out; allocation evicts cached pages first), finish or are preempted (their generated pages
registered), get cancelled while queued, and the cache is reset. After every rule:

- every block in a running request's table is its own in the pool, or belongs to a cached page
  it holds (and that page's key is the request's tokens at that index);
- a page's reference count is the number of running requests holding it, and the evictable
  pages are exactly those with none; waiting requests hold nothing;
- every cached block is checked out to ``CACHE_OWNER``; the pool's in-use count is the distinct
  blocks of all tables and pages; no block is in two tables unless in a shared page.

At the end everything finishes, the cache is reset, and the pool is all free with no owner.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.conftest import assert_pool_all_free
from veloxquant_mlx.engine.loop.prefix_cache import CACHE_OWNER
from veloxquant_mlx.engine.loop.scheduler import Scheduler
from veloxquant_mlx.engine.loop.seq import Seq
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams
from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig

LAYERS, BLOCK = 2, 4
SYSTEM = [list(range(10, 20)), list(range(30, 39))]  # 2.5 and 2.25 blocks


class Sharing(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK, n_blocks=120))
        self.sched = Scheduler(self.pool, LAYERS, max_running=5, max_queue=64, prefix_caching=True)
        assert self.sched.cache is not None
        self.cache = self.sched.cache
        self.next_id = 1
        self.done: list[list[int]] = []  # finished sequences: later prompts fork them

    def _seq(self, tokens: list[int]) -> Seq:
        request = GenerationRequest(tuple(tokens), 8, SamplingParams())
        seq = Seq(RequestHandle(self.next_id, request), list(tokens), len(tokens))
        self.next_id += 1
        return seq

    def _register(self, seq: Seq) -> None:
        self.sched.tables.register(seq, min(seq.n_kv, len(seq.tokens)), lambda i: None)

    # ------------------------------------------------------------------ rules

    @rule(
        system=st.sampled_from([0, 1, None]), suffix=st.lists(st.sampled_from([3, 4]), max_size=7)
    )
    def arrive(self, system: int | None, suffix: list[int]) -> None:
        prompt = (SYSTEM[system] if system is not None else []) + suffix
        self.sched.waiting.append(self._seq(prompt or [5]))

    @precondition(lambda self: self.done)
    @rule(data=st.data(), extra=st.lists(st.sampled_from([3, 4]), max_size=5))
    def fork(self, data: st.DataObject, extra: list[int]) -> None:
        """The next turn of a finished conversation: its whole text, then more."""
        base = data.draw(st.sampled_from(self.done))
        cut = data.draw(st.integers(1, len(base)))
        self.sched.waiting.append(self._seq(base[:cut] + extra))

    @rule()
    def admit(self) -> None:
        admitted, unservable = self.sched.admit()
        assert not unservable
        for seq in admitted:
            hit = seq.n_kv
            assert hit % BLOCK == 0 and hit < len(seq.tokens)
            seq.n_kv = len(seq.tokens)  # prefilled, its first token sampled
            self._register(seq)
            seq.tokens.append(7 + len(seq.tokens) % 3)

    @precondition(lambda self: self.sched.running)
    @rule()
    def step(self) -> None:
        for seq in list(self.sched.running):
            if seq not in self.sched.running:
                continue
            while True:
                if self.sched.tables.grow(seq, seq.n_kv + 1):
                    seq.n_kv += 1
                    seq.tokens.append(7 + len(seq.tokens) % 3)
                    break
                victim = self.sched.victim()
                if victim is seq and len(self.sched.running) == 1:
                    self._end(seq)
                    break
                self._register(victim)
                self.sched.preempt(victim)
                if victim is seq:
                    break

    def _end(self, seq: Seq) -> None:
        self._register(seq)
        self.done.append(list(seq.tokens[: seq.n_kv]))
        self.sched.finish(seq)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._end(data.draw(st.sampled_from(self.sched.running)))

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        """Cancelled mid-decode: nothing more is registered."""
        self.sched.finish(data.draw(st.sampled_from(self.sched.running)))

    @precondition(lambda self: self.sched.waiting)
    @rule(data=st.data())
    def cancel_waiting(self, data: st.DataObject) -> None:
        self.sched.finish(data.draw(st.sampled_from(list(self.sched.waiting))))

    @rule()
    def reset(self) -> None:
        evictable = self.cache.n_evictable()
        assert self.sched.tables.reset_cache() == evictable * 2 * LAYERS
        assert self.cache.n_evictable() == 0

    # ------------------------------------------------------------------ invariants

    @invariant()
    def references_and_ownership(self) -> None:
        pages = self.cache.pages()
        refs = {id(p): 0 for p in pages}
        in_tables: dict[int, int] = {}
        for seq in self.sched.running:
            own = {b.block_id for b in self.pool.blocks_for(seq.request_id)}
            shared: set[int] = set()
            columns = list(zip(*seq.table, strict=True))
            for page in seq.pages.held:
                refs[id(page)] += 1
                i = columns.index(tuple(page.ids))  # the page sits at one index of the table
                assert page.key[1] == tuple(seq.tokens[i * BLOCK : (i + 1) * BLOCK])
                shared |= set(page.ids)
            table = {b for ids in seq.table for b in ids}
            assert table == own | shared and not own & shared
            assert seq.n_blocks >= -(-seq.n_kv // BLOCK)
            for b in table:
                in_tables[b] = in_tables.get(b, 0) + 1
        for seq in self.sched.waiting:
            assert seq.table == [] and seq.pages.held == []
            assert self.pool.n_blocks_for(seq.request_id) == 0
        cached = {b for p in pages for b in p.ids}
        assert all(n == 1 or b in cached for b, n in in_tables.items())
        assert [p.refs for p in pages] == [refs[id(p)] for p in pages]
        assert self.cache.n_evictable() == sum(p.refs == 0 for p in pages)
        assert {b.block_id for b in self.pool.blocks_for(CACHE_OWNER)} == cached
        assert len(cached) == 2 * LAYERS * len(pages)
        assert self.pool.stats.blocks_in_use() == len(cached | set(in_tables))
        evictable = 2 * LAYERS * self.cache.n_evictable()
        assert self.sched.tables.blocks_in_use() == self.pool.stats.blocks_in_use() - evictable
        self.pool.check_invariants()

    def teardown(self) -> None:
        for seq in [*self.sched.running, *self.sched.waiting]:
            self.sched.finish(seq)
        self.sched.tables.reset_cache()
        assert self.cache.pages() == []
        assert_pool_all_free(self.pool)


Sharing.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_prefix_cache_references_follow_pool_ownership = Sharing.TestCase
