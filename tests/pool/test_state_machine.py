"""The pool run beside a plain model; every invariant checked after every step."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from veloxquant_mlx.pool import (
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
    PoolConfig,
)

OWNERS = st.integers(min_value=0, max_value=5)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPoolAllocator | None = None

    @precondition(lambda self: self.pool is None)
    @rule(
        block_size=st.integers(1, 5),
        n_blocks=st.integers(0, 12),
        separate_kv=st.booleans(),
        grow=st.booleans(),
        extra=st.one_of(st.none(), st.integers(0, 8)),
    )
    def build(self, block_size, n_blocks, separate_kv, grow, extra):
        max_blocks = None if extra is None else n_blocks + extra
        self.cfg = PoolConfig(block_size, n_blocks, separate_kv, grow, max_blocks)
        self.pool = BlockPoolAllocator(self.cfg)
        self.streams = ("k", "v") if separate_kv else ("kv",)
        # model: owner -> list of (stream, n_used); free counts per stream; registered owners
        self.owned: dict[int, list[tuple[str, int]]] = {}
        self.registered: set[int] = set()
        n_v = n_blocks // 2 if separate_kv else 0
        self.free = {"k": n_blocks - n_v, "v": n_v} if separate_kv else {"kv": n_blocks}
        self.total = n_blocks
        self.n_allocations = self.n_exhausted = self.n_grown = self.n_retired = 0
        self.peak = 0

    def _stream(self, stream: str) -> str:
        return stream if self.cfg.separate_kv else "kv"

    @precondition(lambda self: self.pool is not None)
    @rule(owner=OWNERS, stream=st.sampled_from(["k", "v"]), n_tokens=st.integers(1, 30))
    def allocate(self, owner, stream, n_tokens):
        s = self._stream(stream)
        need = -(-n_tokens // self.cfg.block_size)
        short = need - self.free[s]
        before = self.pool.stats
        try:
            blocks = self.pool.allocate(stream, n_tokens, owner=owner)
        except BlockPoolExhaustedError:
            cap_ok = self.cfg.max_blocks is None or self.total + short <= self.cfg.max_blocks
            assert short > 0 and not (self.cfg.grow_on_exhaustion and cap_ok)
            after = self.pool.stats
            self.n_exhausted += 1
            # a failed allocation changes nothing but the exhaustion counter
            assert after.n_blocks == before.n_blocks
            assert after.blocks_in_use() == before.blocks_in_use()
            return
        if short > 0:
            assert self.cfg.grow_on_exhaustion
            self.free[s] += short
            self.total += short
            self.n_grown += short
        assert len(blocks) == need
        self.free[s] -= need
        self.n_allocations += 1
        used = [min(self.cfg.block_size, n_tokens - i * self.cfg.block_size) for i in range(need)]
        assert [b.n_used for b in blocks] == used
        self.owned.setdefault(owner, []).extend((s, u) for u in used)
        self.registered.add(owner)
        self.peak = max(self.peak, self._in_use())

    @precondition(lambda self: self.pool is not None)
    @rule(owner=OWNERS)
    def free_all(self, owner):
        self.pool.free_all(owner)
        self.pool.free_all(owner)  # idempotent
        for s, _ in self.owned.pop(owner, []):
            self.free[s] += 1
        self.registered.discard(owner)

    @precondition(lambda self: self.pool is not None)
    @rule(owner=OWNERS, data=st.data())
    def free_some(self, owner, data):
        blocks = self.pool.blocks_for(owner)
        if not blocks:
            return
        chosen = data.draw(st.lists(st.sampled_from(blocks), max_size=len(blocks)))
        chosen_ids = {b.block_id for b in chosen}
        self.pool.free(chosen)
        self.owned[owner] = [(b.stream, b.n_used) for b in blocks if b.block_id not in chosen_ids]
        for b in blocks:
            if b.block_id in chosen_ids:
                self.free[b.stream] += 1
        if not self.owned[owner]:
            del self.owned[owner]
            self.registered.discard(owner)

    @precondition(lambda self: self.pool is not None)
    @rule(owner=OWNERS, data=st.data())
    def mark_used(self, owner, data):
        blocks = self.pool.blocks_for(owner)
        if not blocks:
            return
        i = data.draw(st.integers(0, len(blocks) - 1))
        n_used = data.draw(st.integers(0, self.cfg.block_size))
        self.pool.mark_used(blocks[i], n_used)
        self.owned[owner][i] = (blocks[i].stream, n_used)

    @precondition(lambda self: self.pool is not None)
    @rule(stream=st.sampled_from(["k", "v"]), target_free=st.integers(0, 6))
    def shrink(self, stream, target_free):
        s = self._stream(stream)
        owned_before = {o: self.pool.blocks_for(o) for o in self.owned}
        retired = self.pool.shrink(stream, target_free)
        assert retired == max(0, self.free[s] - target_free)
        self.free[s] -= retired
        self.total -= retired
        self.n_retired += retired
        # shrink touches only free blocks
        for owner, blocks in owned_before.items():
            assert self.pool.blocks_for(owner) == blocks
            assert all(b.owner == owner for b in blocks)

    @precondition(lambda self: self.pool is not None)
    @rule(owner=OWNERS)
    def register(self, owner):
        try:
            self.pool.register_owner(owner)
        except OwnerAlreadyActiveError:
            assert owner in self.registered or owner in self.owned
            return
        assert owner not in self.registered and owner not in self.owned
        self.registered.add(owner)

    @precondition(lambda self: self.pool is not None)
    @rule(owner=OWNERS)
    def release(self, owner):
        self.pool.release_owner(owner)
        if owner not in self.owned:
            self.registered.discard(owner)

    def _in_use(self) -> int:
        return sum(len(v) for v in self.owned.values())

    @invariant()
    def pool_matches_model(self):
        if self.pool is None:
            return
        self.pool.check_invariants()  # conservation, disjoint owners, no duplicate free ids
        stats = self.pool.stats
        assert stats.n_blocks == self.total
        assert stats.blocks_in_use() == self._in_use()
        assert sum(self.free.values()) + self._in_use() == self.total
        for s in self.streams:
            assert self.pool.n_free(s) == self.free[s]
        assert stats.n_allocations == self.n_allocations
        assert stats.n_exhausted == self.n_exhausted
        assert stats.n_grown == self.n_grown
        assert stats.n_retired == self.n_retired
        assert stats.peak_blocks_in_use == self.peak
        fragmented = sum(
            1 for v in self.owned.values() for _, u in v if 0 < u < self.cfg.block_size
        )
        expected = fragmented / self.total if self.total else 0.0
        assert stats.fragmentation() == expected
        counts = self.pool.owner_block_counts()
        assert {o: n for o, n in counts.items() if n} == {o: len(v) for o, v in self.owned.items()}
        assert set(counts) == self.registered | set(self.owned)
        if self.cfg.grow_on_exhaustion and self.cfg.max_blocks is not None:
            assert stats.n_blocks <= self.cfg.max_blocks


PoolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase
