"""Block tables against pool ownership through random join / step / leave / preempt sequences.

The scheduler (pure Python) and the paged layout's table mirror are driven the way the engine
core drives them, without a model: requests arrive, get admitted, "step" (each running request
needs room for one more token, preempting the newest when the pool is out, as
``Scheduler.make_room`` decides), finish, get cancelled while queued, or are preempted. After
every rule:

- every running request holds, per layer and stream, the blocks its KV fills and at most the
  one its next token goes to: ``ceil(n_kv / bs) <= blocks <= ceil(tokens / bs)`` (``tokens``:
  prompt and generated, the last one sampled but not yet in KV); each block is owned by it in
  the pool, no block is in two tables, and the pool's in-use count is their sum;
- waiting requests hold nothing;
- the paged layout's mirror of each row's table equals the scheduler's table.

At the end everything finishes and the pool is all free with no owner left.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.conftest import assert_pool_all_free
from veloxquant_mlx.engine.loop.scheduler import Scheduler
from veloxquant_mlx.engine.loop.seq import Seq, StepPlan
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams
from veloxquant_mlx.kv.paged import PagedKV
from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig

LAYERS, BLOCK = 2, 4


class Tables(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK, n_blocks=96))
        self.sched = Scheduler(self.pool, LAYERS, max_running=6, max_queue=64)
        self.kv = PagedKV(LAYERS, BLOCK, 96)
        self.rows: list[Seq | None] = []  # the runner's slots: a leaver leaves a hole
        self.next_id = 0

    # ------------------------------------------------------------------ the runner's side

    def _join(self, seq: Seq) -> None:
        slot = self.rows.index(None) if None in self.rows else len(self.rows)
        if slot == len(self.rows):
            self.rows.append(None)
        self.rows[slot] = seq
        self.kv.set_table(slot, seq.table)

    def _leave(self, seq: Seq) -> None:
        if seq in self.rows:
            slot = self.rows.index(seq)
            self.rows[slot] = None
            self.kv.set_hole(slot)
            while self.rows and self.rows[-1] is None:
                self.rows.pop()

    # ------------------------------------------------------------------ rules

    @rule(prompt=st.integers(1, 30))
    def arrive(self, prompt: int) -> None:
        request = GenerationRequest(tuple(range(3, 3 + prompt)), 8, SamplingParams())
        seq = Seq(RequestHandle(self.next_id, request), list(request.prompt_tokens), prompt)
        self.next_id += 1
        self.sched.waiting.append(seq)

    @rule()
    def admit(self) -> None:
        admitted, unservable = self.sched.admit()
        assert not unservable  # nothing shrinks here: everything offered fits alone
        for seq in admitted:
            seq.n_kv = len(seq.tokens)  # prefilled at once, and its first token sampled
            seq.decoding = True
            seq.tokens.append(7)
            self._join(seq)

    @precondition(lambda self: self.sched.running)
    @rule()
    def step(self) -> None:
        plan = StepPlan()
        self.sched.make_room(plan)  # the engine's rule: the newest preempted while out
        for victim in plan.preempted:
            self._leave(victim)
            assert victim.table == [] and victim.n_kv == 0 and not victim.decoding
        for seq, _ in plan.outgrown:  # outgrew the whole pool: "length"
            self._leave(seq)
            self.sched.finish(seq)
        for seq, before in plan.grown:
            self.kv.set_table(self.rows.index(seq), seq.table, before)
        self.sched.decoded(self.rows)
        for seq in self.sched.running:
            seq.tokens.append(7)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.sched.running))
        self._leave(seq)
        self.sched.finish(seq)

    @precondition(lambda self: self.sched.waiting)
    @rule(data=st.data())
    def cancel_waiting(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(list(self.sched.waiting)))
        self.sched.finish(seq)

    @precondition(lambda self: self.sched.running)
    @rule()
    def preempt_newest(self) -> None:
        seq = self.sched.victim()
        self._leave(seq)
        self.sched.preempt(seq)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tables_match_ownership(self) -> None:
        seen: set[int] = set()
        total = 0
        for seq in self.sched.running:
            per_stream = seq.n_blocks
            assert -(-seq.n_kv // BLOCK) <= per_stream <= -(-len(seq.tokens) // BLOCK)
            assert len(seq.table) == 2 * LAYERS
            assert all(len(ids) == per_stream for ids in seq.table)
            owned = {b.block_id for b in self.pool.blocks_for(seq.request_id)}
            mine = {i for ids in seq.table for i in ids}
            assert mine == owned and len(mine) == 2 * LAYERS * per_stream
            assert not seen & mine
            seen |= mine
            total += len(mine)
            slot = self.rows.index(seq)
            assert (self.kv._tables[slot, :, :per_stream] == seq.table).all()
        for seq in self.sched.waiting:
            assert seq.table == [] and self.pool.n_blocks_for(seq.request_id) == 0
        assert self.pool.stats.blocks_in_use() == total == self.sched.tables.blocks_in_use()
        assert all(s is None or s in self.sched.running for s in self.rows)
        self.pool.check_invariants()

    def teardown(self) -> None:
        for seq in [*self.sched.running, *self.sched.waiting]:
            self._leave(seq)
            self.sched.finish(seq)
        assert_pool_all_free(self.pool)


Tables.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_tables_follow_pool_ownership = Tables.TestCase
