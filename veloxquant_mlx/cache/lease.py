"""Row leases: the pool blocks one sequence's K and V buffers hold in one layer."""

from __future__ import annotations

import weakref
from typing import Any

from veloxquant_mlx.pool import Block, BlockPoolAllocator


class RowLease:
    """The K and V blocks backing one row (one sequence) of one layer's KV buffers.

    Owns: two block lists, checked out to ``owner`` on ``pool``, always of equal length (growth
    is all-or-nothing across K and V). ``holders`` is the set of live caches whose buffers hold
    this row. mlx_lm's ``PromptProcessingBatch.split`` deep-copies a batch cache and filters
    both copies; the copy joins the holders instead of copying blocks, and the blocks go back to
    the pool when the last live holder drops the row. Holders are weak, so a cache that is simply
    discarded (mlx_lm clears a batch's cache list instead of filtering it to nothing) stops
    counting at once. Used only from the thread that runs the model.
    """

    __slots__ = ("__weakref__", "_k", "_v", "holders", "owner", "pool")

    def __init__(self, pool: BlockPoolAllocator, owner: Any, holder: object) -> None:
        self.pool = pool
        self.owner = owner
        self._k: list[Block] = []
        self._v: list[Block] = []
        self.holders: weakref.WeakSet[object] = weakref.WeakSet([holder])

    @property
    def n_blocks(self) -> int:
        """Blocks held per stream (the same for K and V)."""
        return len(self._k)

    def resize(self, n_blocks: int) -> None:
        """Hold exactly ``n_blocks`` per stream: allocate or free the difference. O(change).

        Raises:
            BlockPoolExhaustedError: If the pool cannot supply both the K and the V blocks;
                nothing changes then (a K allocation is undone when its V allocation fails).
        """
        have = len(self._k)
        if n_blocks > have:
            n_tokens = (n_blocks - have) * self.pool.config.block_size
            k = self.pool.allocate("k", n_tokens, self.owner)
            try:
                v = self.pool.allocate("v", n_tokens, self.owner)
            except BaseException:
                self.pool.free(k, owner=self.owner)
                raise
            self._k.extend(k)
            self._v.extend(v)
        elif n_blocks < have:
            surplus = self._k[n_blocks:] + self._v[n_blocks:]
            del self._k[n_blocks:], self._v[n_blocks:]
            self.pool.free(surplus, owner=self.owner)

    def forget(self) -> None:
        """Drop the block lists without freeing (their owner was already freed as a whole)."""
        self._k.clear()
        self._v.clear()

    def drop(self, holder: object) -> None:
        """``holder`` lets go of the row; the last live holder returns the blocks. Idempotent."""
        self.holders.discard(holder)
        if not self.holders:
            self.resize(0)


def resize_all(leases: list[RowLease], n_blocks: int) -> None:
    """Resize every lease to ``n_blocks``, all or none: on failure the grown ones shrink back."""
    before = [lease.n_blocks for lease in leases]
    try:
        for lease in leases:
            lease.resize(n_blocks)
    except BaseException:
        for lease, n in zip(leases, before, strict=True):
            lease.resize(min(n, lease.n_blocks))
        raise


def grown_length(capacity: int | None, prev: int, n_new: int, step: int) -> int | None:
    """The buffer length mlx_lm's KVCache growth rule gives, or None if no growth is due.

    Mirrors ``KVCache.update_and_fetch``: grow by whole ``step`` chunks, first trimming a
    partially used tail, so accounting can run (and fail) before any buffer changes.
    """
    if capacity is not None and prev + n_new <= capacity:
        return None
    chunk = ((step + n_new - 1) // step) * step
    if capacity is None:
        return chunk
    return (prev if prev % step != 0 else capacity) + chunk


def blocks_for_slots(n_slots: int, block_size: int) -> int:
    """Blocks needed for ``n_slots`` token slots of one row (ceil division)."""
    return -(-n_slots // block_size)
