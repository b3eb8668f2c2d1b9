"""The thread-safe block pool: which block ids are free, who owns which, and the counters."""

from __future__ import annotations

import operator
import threading
from collections import deque
from collections.abc import Hashable

from veloxquant_mlx.pool.block import Block
from veloxquant_mlx.pool.config import PoolConfig
from veloxquant_mlx.pool.errors import BlockPoolExhaustedError, OwnerAlreadyActiveError
from veloxquant_mlx.pool.invariants import check_pool_locked
from veloxquant_mlx.pool.owners import Owned, check_owner
from veloxquant_mlx.pool.stats import AllocationStats

DEFAULT_HISTORY_SIZE = 256
_VALID_STREAMS = ("k", "v", "kv")


def _as_count(name: str, value: object) -> int:
    """``value`` as a plain int (numpy ints welcome), or ValueError for floats, bools, str..."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


class BlockPoolAllocator:
    """Fixed-size block allocator for KV-cache storage.

    Pre-allocates ``n_blocks`` fixed-size blocks up front and hands them out on request, avoiding
    per-token malloc/free during generation. Freed blocks return to a free list and are reused by
    later allocations (LIFO: a just-freed block tends to be cache-hot), so steady-state generation
    performs zero new-memory allocation once the pool is warm.

    Keys and values can be tracked on independent free lists (``PoolConfig.separate_kv=True``,
    the default) so K-heavy and V-heavy workloads don't compete for the same blocks, or share a
    single free list for tighter packing when K/V pressure is uneven across requests.

    Owns: one :class:`Block` per live block id, one LIFO free list per stream (a Python list whose
    end is the top: ``allocate`` takes from the end, ``free`` pushes onto it; a fresh pool hands
    out the lowest ids first), each owner's blocks in allocation order, the live
    :class:`AllocationStats` and the ``history`` deque. Everyone else holds block ids, ``Block``
    references while they own them, or snapshots.

    Thread-safe: every mutating and read method acquires one internal lock, so one pool can be
    shared across threads without external synchronization. The lock is a plain (non-reentrant)
    ``threading.Lock``; nothing that runs under it calls out of this class.

    This class only manages block bookkeeping; it owns no array storage. Pair it with a backing
    store (e.g. ``veloxquant_mlx.memory.mlx_storage.MLXBlockStorage``) indexed by block id.

    ``history`` is a bounded deque (``history_size`` snapshots, oldest dropped first). A snapshot
    is appended on every event that changes the pool's shape or signals pressure: a failed
    allocation, growth, a shrink that retired blocks; and whenever :meth:`record_history` is
    called (a server calls it on a timer or per scrape). The allocate/free hot path does not
    snapshot, so it stays within a small factor of a bare free list.

    Args:
        config: Pool sizing/behavior configuration (``PoolConfig()`` when None).
        history_size: How many snapshots ``history`` keeps (>= 1).

    Example::

        pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=256))
        blocks = pool.allocate(stream="k", n_tokens=40, owner=request_id, format="int2")
        ...
        pool.free_all(owner=request_id)
    """

    history: deque[AllocationStats]

    def __init__(
        self, config: PoolConfig | None = None, *, history_size: int = DEFAULT_HISTORY_SIZE
    ) -> None:
        if config is None:
            config = PoolConfig()
        if not isinstance(config, PoolConfig):
            raise ValueError(f"config must be a PoolConfig, got {type(config).__name__}")
        if _as_count("history_size", history_size) < 1:
            raise ValueError(f"history_size must be >= 1, got {history_size}")
        self.config = config
        self._block_size = config.block_size
        self._streams: tuple[str, ...] = ("k", "v") if config.separate_kv else ("kv",)
        # stream name a caller may pass -> the free list it means
        self._stream_of = (
            {"k": "k", "v": "v"} if config.separate_kv else {"k": "kv", "v": "kv", "kv": "kv"}
        )
        self._lock = threading.Lock()
        self._blocks: dict[int, Block] = {}
        # Each free list is [never-allocated blocks..., freed blocks...]: allocate pops the top
        # (the end), free pushes onto it and growth inserts at the bottom, so the fresh blocks
        # always form a prefix of length _n_fresh[stream] and reuse is counted without a flag test.
        self._free: dict[str, list[Block]] = {s: [] for s in self._streams}
        self._n_fresh: dict[str, int] = dict.fromkeys(self._streams, 0)
        self._n_total_by_stream: dict[str, int] = dict.fromkeys(self._streams, 0)
        # An owner is active while it has an entry here (register_owner makes an empty one).
        self._owners: dict[Hashable, Owned] = {}
        self._next_block_id = 0
        self._stats = AllocationStats(n_blocks=0)
        self.history = deque(maxlen=history_size)
        if config.separate_kv:
            n_v = config.n_blocks // 2
            self._add_blocks("k", config.n_blocks - n_v)
            self._add_blocks("v", n_v)
        else:
            self._add_blocks("kv", config.n_blocks)

    # ------------------------------------------------------------------ internals (lock held)

    def _add_blocks(self, stream: str, count: int) -> None:
        start = self._next_block_id
        self._next_block_id += count
        new = [Block(block_id=i, stream=stream) for i in range(start, start + count)]
        for block in new:
            self._blocks[block.block_id] = block
        # At the bottom, lowest id deepest-last: a fresh pool hands out the lowest ids first.
        self._free[stream][0:0] = new[::-1]
        self._n_fresh[stream] += count
        self._n_total_by_stream[stream] += count
        self._stats.n_blocks += count

    def _resolve_stream(self, stream: str) -> str:
        s = self._stream_of.get(stream) if isinstance(stream, str) else None
        if s is None:
            raise ValueError(
                f"stream must be 'k' or 'v', got {stream!r}"
                + (" ('kv' only on a separate_kv=False pool)" if stream == "kv" else "")
            )
        return s

    def _snapshot_locked(self) -> AllocationStats:
        snap = self._stats.snapshot()
        snap._free_by_stream = {s: len(free) for s, free in self._free.items()}
        return snap

    def _record_locked(self) -> None:
        self.history.append(self._snapshot_locked())

    def _grow_locked(self, stream: str, n_short: int) -> bool:
        cap = self.config.max_blocks
        if not self.config.grow_on_exhaustion or (
            cap is not None and len(self._blocks) + n_short > cap
        ):
            return False
        self._add_blocks(stream, n_short)
        self._stats.n_grown += n_short
        return True

    def _own_block_locked(self, block: object) -> Block:
        if not isinstance(block, Block) or self._blocks.get(block.block_id) is not block:
            raise ValueError(f"{block!r} is not a live block of this pool")
        return block

    # ------------------------------------------------------------------ owners

    def register_owner(self, owner: int) -> None:
        """Mark ``owner`` as active, guarding against accidental id reuse.

        allocate() calls this automatically for any owner not yet seen, but a second allocate()
        for an owner that is already active is treated as that same request continuing to grow,
        not a collision. Call register_owner() yourself (once, before any allocate() calls for
        this owner) if you want a genuine collision (a wrapped request-id counter, two callers
        racing on one id) to raise immediately, including on a second register_owner() call for a
        still-active id. O(1), thread-safe.

        Raises:
            OwnerAlreadyActiveError: If ``owner`` already has blocks checked out or was registered
                and not yet released.
            ValueError: If ``owner`` is None (None means "free" on a Block) or unhashable.
        """
        check_owner(owner)
        with self._lock:
            if owner in self._owners:
                raise OwnerAlreadyActiveError(
                    f"owner {owner!r} is already active (holds blocks or was registered and not "
                    "released); use another id, or free_all(owner) first"
                )
            self._owners[owner] = Owned()

    def release_owner(self, owner: int) -> None:
        """Clear ``owner`` from the active-owner set without freeing blocks.

        Rarely needed directly: free_all() does this once an owner's last block is freed. Useful
        if you registered an owner via register_owner() but never allocated anything for it. An
        owner that still holds blocks stays active (its blocks are never orphaned): free them
        with free_all(). Unknown owners are ignored. O(1), thread-safe.
        """
        with self._lock:
            record = self._owners.get(owner)
            if record is not None and not record.blocks:
                del self._owners[owner]

    # ------------------------------------------------------------------ allocate / free

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        """Allocate enough blocks to hold ``n_tokens`` slots.

        Needs ``ceil(n_tokens / block_size)`` blocks; each comes back with ``owner`` and
        ``format`` set and ``n_used`` filled in order (every block full but the last). O(blocks
        allocated), thread-safe.

        Args:
            stream: "k" or "v" (ignored, treated as "kv", when the pool was built with
                separate_kv=False; "kv" is accepted there too).
            n_tokens: Number of token slots needed (an int > 0).
            owner: Opaque id (e.g. request id) the blocks are checked out to. Repeated allocate()
                calls for an owner that is already active are treated as that same request
                growing and never raise; call register_owner() yourself before the first
                allocate() to catch a different caller reusing a still-active id.
            format: Compression-format tag to record on each block.

        Returns:
            List of newly allocated Block instances, in order.

        Raises:
            BlockPoolExhaustedError: If fewer than the required number of free blocks remain and
                the pool cannot grow enough to cover the gap (see PoolConfig.grow_on_exhaustion /
                max_blocks). No blocks are allocated and nothing grows on failure
                (all-or-nothing); only ``n_exhausted`` counts it and a history snapshot is taken.
            ValueError: If n_tokens <= 0 (or not an int), stream is invalid, or owner is None.
        """
        if type(n_tokens) is not int:
            n_tokens = _as_count("n_tokens", n_tokens)
        if n_tokens <= 0:
            raise ValueError(f"n_tokens must be > 0, got {n_tokens}")
        try:
            s = self._stream_of[stream]
        except (KeyError, TypeError):
            s = self._resolve_stream(stream)  # raises the explanatory ValueError
        block_size = self._block_size
        n_needed = -(-n_tokens // block_size)
        with self._lock:
            record = self._owners.get(owner)
            if record is None:
                check_owner(owner)
            free = self._free[s]
            n_free = len(free)
            grew = n_free < n_needed
            if grew:
                if not self._grow_locked(s, n_needed - n_free):
                    self._stats.n_exhausted += 1
                    self._record_locked()
                    raise BlockPoolExhaustedError(
                        f"need {n_needed} free {s!r} block(s) for {n_tokens} token(s), "
                        f"{n_free} free of {len(self._blocks)} in the pool"
                    )
                n_free = n_needed
            if record is None:
                record = self._owners[owner] = Owned()
            stats = self._stats
            if n_needed == 1 and self._n_fresh[s] < n_free:
                # Decode-time growth: one reused block; no slicing, no temporary dict.
                block = free.pop()
                block.owner = owner
                block.format = format
                record.blocks[block.block_id] = block
                stats.n_allocations += 1
                stats.n_reused += 1
                if n_tokens < block_size:
                    block.n_used = n_tokens
                    record.n_fragmented += 1
                    stats._fragmented_count += 1
                else:
                    block.n_used = block_size
                in_use = stats._blocks_in_use = stats._blocks_in_use + 1
                if in_use > stats.peak_blocks_in_use:
                    stats.peak_blocks_in_use = in_use
                return [block]
            taken = free[-n_needed:]
            del free[-n_needed:]
            taken.reverse()  # the top of the stack (most recently freed) comes first
            held = record.blocks
            for block in taken:
                block.owner = owner
                block.format = format
                block.n_used = block_size
                held[block.block_id] = block
            # The fresh prefix sits deepest, so fresh blocks taken are the last ones in `taken`.
            n_fresh_taken = n_needed - (n_free - self._n_fresh[s])
            if n_fresh_taken > 0:
                self._n_fresh[s] -= n_fresh_taken
                for block in taken[-n_fresh_taken:]:
                    block.ever_allocated = True
            else:
                n_fresh_taken = 0
            last_used = n_tokens - (n_needed - 1) * block_size
            if last_used < block_size:
                taken[-1].n_used = last_used
                record.n_fragmented += 1
                stats._fragmented_count += 1
            stats.n_allocations += 1
            stats.n_reused += n_needed - n_fresh_taken
            in_use = stats._blocks_in_use = stats._blocks_in_use + n_needed
            if in_use > stats.peak_blocks_in_use:
                stats.peak_blocks_in_use = in_use
            if grew:
                self._record_locked()
            return taken

    def free(self, blocks: list[Block], *, owner: int | None = None) -> None:
        """Return blocks to the free list for their stream.

        Blocks that are already free are skipped, so freeing twice is harmless (but a stale
        reference to a block that has since been handed to another owner frees that owner's
        block: hold blocks only while you own them). An owner whose last block is freed here
        stops being active. Cost O(len(blocks)): an owner's blocks are a dict by id, so each one
        leaves it in O(1), however many the owner holds (free_all frees a whole owner at once).
        Thread-safe; validated before anything changes.

        Args:
            blocks: Blocks previously returned by allocate().
            owner: If given, only blocks still checked out to this owner are freed; the rest are
                skipped. Holders that may outlive their owner's ``free_all`` (a cache whose
                request was already released) pass it so they can never free a block that has
                since been handed to someone else.

        Raises:
            ValueError: If an item is not a live block of this pool (another pool's, or retired).
        """
        blocks = list(blocks)
        block_size = self._block_size
        with self._lock:
            for block in blocks:
                self._own_block_locked(block)
            owners, free, stats = self._owners, self._free, self._stats
            by_owner: dict[Hashable, dict[int, Block]] = {}
            for block in blocks:
                if block.owner is not None and (owner is None or block.owner == owner):
                    by_owner.setdefault(block.owner, {})[block.block_id] = block  # dedupes too
            for holder, freed in by_owner.items():
                record = owners[holder]
                held = record.blocks
                for block_id in freed:
                    del held[block_id]
                if not held:
                    del owners[holder]
                for block in freed.values():
                    if 0 < block.n_used < block_size:
                        record.n_fragmented -= 1
                        stats._fragmented_count -= 1
                    block.owner = None
                    block.n_used = 0
                    free[block.stream].append(block)
                stats._blocks_in_use -= len(freed)
            stats.n_frees += 1

    def free_all(self, owner: int) -> None:
        """Free every block currently checked out to ``owner``.

        Pops the owner's block list in one step instead of locating each block, so the cost is
        O(blocks freed), with no per-block search. Also clears the owner's registration. Idempotent:
        a second call, or a call for an owner the pool never saw, changes nothing and does not
        count in ``n_frees``. Thread-safe.

        Args:
            owner: Opaque id passed to a prior allocate() call.
        """
        with self._lock:
            record = self._owners.pop(owner, None)
            if record is None or not record.blocks:
                return
            blocks = record.blocks.values()
            free = self._free
            for block in blocks:
                block.owner = None
                block.n_used = 0
                free[block.stream].append(block)
            stats = self._stats
            stats._fragmented_count -= record.n_fragmented
            stats._blocks_in_use -= len(blocks)
            stats.n_frees += 1

    def transfer(self, blocks: list[Block], *, owner: int, new_owner: int) -> int:
        """Hand blocks checked out to ``owner`` over to ``new_owner``, in place (same ids, same
        contents): how a request's full KV blocks become a prefix cache's. Blocks not held by
        ``owner`` are skipped. Nothing is allocated or freed, so ``blocks_in_use`` is unchanged.
        An owner left with no block stops being active. O(blocks), thread-safe.

        Returns:
            How many blocks changed hands.

        Raises:
            ValueError: If an item is not a live block of this pool, or ``new_owner`` is None.
        """
        check_owner(new_owner)
        block_size = self._block_size
        with self._lock:
            moving = {}
            for block in blocks:
                if self._own_block_locked(block).owner == owner:
                    moving[block.block_id] = block
            if not moving or owner == new_owner:
                return 0
            record = self._owners[owner]
            held = record.blocks
            target = self._owners.setdefault(new_owner, Owned())
            for block_id, block in moving.items():
                del held[block_id]
                block.owner = new_owner
                target.blocks[block_id] = block
                if 0 < block.n_used < block_size:
                    record.n_fragmented -= 1
                    target.n_fragmented += 1
            if not record.blocks:
                del self._owners[owner]
            return len(moving)

    # ------------------------------------------------------------------ reads

    def blocks_for(self, owner: int) -> list[Block]:
        """Return the blocks currently checked out to ``owner``, in allocation order.

        A new list of the live Block objects (empty for an unknown owner). O(blocks), thread-safe.
        """
        with self._lock:
            record = self._owners.get(owner)
            return list(record.blocks.values()) if record else []

    def n_blocks_for(self, owner: int) -> int:
        """Number of blocks checked out to ``owner`` (0 if unknown). O(1), thread-safe."""
        with self._lock:
            record = self._owners.get(owner)
            return len(record.blocks) if record else 0

    def is_live(self, block_id: int) -> bool:
        """True if ``block_id`` is managed by the pool (free or not); False once retired. O(1)."""
        with self._lock:
            return block_id in self._blocks

    def n_free(self, stream: str = "k") -> int:
        """Number of free blocks remaining for ``stream``.

        On a shared (separate_kv=False) pool every stream name means the one "kv" list; on a
        separate pool "kv" means both lists together. O(1), thread-safe.

        Raises:
            ValueError: If ``stream`` is not "k", "v" or "kv".
        """
        if stream not in _VALID_STREAMS:
            raise ValueError(f"stream must be 'k', 'v' or 'kv', got {stream!r}")
        with self._lock:
            if not self.config.separate_kv:
                return len(self._free["kv"])
            if stream == "kv":
                return len(self._free["k"]) + len(self._free["v"])
            return len(self._free[stream])

    def n_total(self, stream: str = "kv") -> int:
        """Blocks the pool manages for ``stream`` (free or not); "kv" means all. O(1)."""
        if stream not in _VALID_STREAMS:
            raise ValueError(f"stream must be 'k', 'v' or 'kv', got {stream!r}")
        with self._lock:
            if stream == "kv" or not self.config.separate_kv:
                return len(self._blocks)
            return self._n_total_by_stream[stream]

    @property
    def streams(self) -> tuple[str, ...]:
        """The free lists this pool keeps: ("k", "v") or ("kv",)."""
        return self._streams

    @property
    def stats(self) -> AllocationStats:
        """A snapshot of the counters (free blocks per stream filled in). O(1), thread-safe."""
        with self._lock:
            return self._snapshot_locked()

    def record_history(self) -> AllocationStats:
        """Append a snapshot to ``history`` and return it. O(1), thread-safe."""
        with self._lock:
            self._record_locked()
            return self.history[-1]

    def owner_block_counts(self) -> dict[Hashable, int]:
        """A new dict of owner -> blocks held, for every active owner. O(owners), thread-safe."""
        with self._lock:
            return {owner: len(record.blocks) for owner, record in self._owners.items()}

    # ------------------------------------------------------------------ shrink / fill level

    def shrink(self, stream: str, target_free: int) -> int:
        """Permanently retire fully-free blocks from ``stream`` down to ``target_free``.

        Use this to give memory back when a pool was sized for peak load well above steady state.
        Only blocks on the free list are eligible (the top of the LIFO stack goes first), so this
        never touches a live request. Retired blocks are removed from the pool's bookkeeping
        entirely and their ids are never handed out again, so external storage indexed by block
        id (e.g. MLXBlockStorage) may drop the buffers. O(blocks retired), thread-safe.

        Args:
            stream: "k" or "v" (ignored, treated as "kv", when the pool was built with
                separate_kv=False).
            target_free: Desired number of free blocks to retain for this stream after
                shrinking. If the stream already has this many or fewer free blocks, this is a
                no-op.

        Returns:
            Number of blocks actually retired.

        Raises:
            ValueError: If target_free < 0 (or not an int), or stream is invalid.
        """
        target_free = _as_count("target_free", target_free)
        if target_free < 0:
            raise ValueError(f"target_free must be >= 0, got {target_free}")
        s = self._resolve_stream(stream)
        with self._lock:
            free = self._free[s]
            n_retire = len(free) - target_free
            if n_retire <= 0:
                return 0
            for block in free[-n_retire:]:
                del self._blocks[block.block_id]
            del free[-n_retire:]
            self._n_fresh[s] = min(self._n_fresh[s], len(free))
            self._stats.n_blocks -= n_retire
            self._n_total_by_stream[s] -= n_retire
            self._stats.n_retired += n_retire
            self._record_locked()
            return n_retire

    def mark_used(self, block: Block, n_used: int) -> None:
        """Update ``block.n_used`` and keep fragmentation stats consistent.

        Callers that track a block's fill level themselves (e.g. PooledKVCache, which appends
        token by token to an already-checked-out block) must go through this instead of writing
        ``block.n_used`` directly: the fragmented count is kept incrementally, not recounted by a
        scan. O(1), thread-safe.

        Args:
            block: A block currently checked out from this pool (owner is not None). Blocks that
                are free are never fragmented by definition, so calling this on one is a no-op
                for stats (n_used is still updated).
            n_used: New fill level, 0 <= n_used <= block_size.

        Raises:
            ValueError: If ``n_used`` is out of range or ``block`` is not a live block of this pool.
        """
        n_used = _as_count("n_used", n_used)
        block_size = self._block_size
        if not 0 <= n_used <= block_size:
            raise ValueError(f"n_used must be in [0, {block_size}], got {n_used}")
        with self._lock:
            self._own_block_locked(block)
            record = self._owners.get(block.owner)
            if record is not None:
                delta = (0 < n_used < block_size) - (0 < block.n_used < block_size)
                record.n_fragmented += delta
                self._stats._fragmented_count += delta
            block.n_used = n_used

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Recount everything from scratch and assert it matches the incremental state.

        For tests and debugging: O(blocks), under the lock. Raises AssertionError naming the
        first violation (see ``pool/invariants.py``).
        """
        with self._lock:
            check_pool_locked(self)

    def __repr__(self) -> str:
        stats = self.stats
        return (
            f"BlockPoolAllocator(block_size={self._block_size}, streams={self._streams}, "
            f"in_use={stats.blocks_in_use()}/{stats.n_blocks}, owners={len(self._owners)})"
        )
