"""PoolBackedBatchKVCache: mlx_lm's BatchKVCache with each row's slots accounted to its owner."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from veloxquant_mlx.cache.lease import RowLease, blocks_for_slots, grown_length, resize_all
from veloxquant_mlx.cache.pool_backed import PoolBackedKVCache, default_step
from veloxquant_mlx.pool import BlockPoolAllocator


class PoolBackedBatchKVCache(BatchKVCache):
    """A left-padded batch KV cache whose every row holds pool blocks under the row's owner.

    mlx_lm's ``BatchKVCache`` holds ``rows x capacity`` slots per stream: each row's tokens,
    its left padding, and the unused tail of the last growth chunk. This class charges each row
    ``ceil(capacity / block_size)`` blocks per stream, padding included (what MLX really holds),
    and keeps that true through growth (checked out before the buffers grow), ``filter`` (a
    dropped row's blocks go back to the pool; a left shift frees the columns it removes),
    ``extend``, ``merge``, state restore and ``copy.deepcopy`` (mlx_lm's prefill-to-decode
    split deep-copies the batch, then filters both copies: the copy shares each row's
    :class:`RowLease`, so every row's blocks end up held by exactly one live cache and are never
    copied or freed twice).

    ``extract(idx)`` returns a stock, unaccounted ``KVCache`` copy, as mlx_lm does: it is the
    finished row's prompt cache that BatchGenerator hands back, lazily built and usually dropped.

    Owns: the batch buffers (via BatchKVCache) and one lease per row, in row order. Not
    thread-safe: use it on the thread that runs the model.
    """

    def __init__(
        self,
        left_padding: list[int],
        pool: BlockPoolAllocator,
        leases: list[RowLease],
        step: int | None = None,
    ) -> None:
        super().__init__(left_padding)
        if len(leases) != len(left_padding):
            raise ValueError(f"{len(leases)} leases for {len(left_padding)} rows")
        self.pool = pool
        self.step = default_step(pool) if step is None else step
        self._leases = leases
        for lease in leases:
            lease.holders.add(self)

    # ------------------------------------------------------------------ accounting

    def _capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _reaccount(self) -> None:
        resize_all(self._leases, blocks_for_slots(self._capacity(), self.pool.config.block_size))

    @property
    def owners(self) -> list[Any]:
        """The owner of each row, in row order."""
        return [lease.owner for lease in self._leases]

    def n_blocks_held(self) -> int:
        """K + V blocks all rows of this layer hold."""
        return 2 * sum(lease.n_blocks for lease in self._leases)

    # ------------------------------------------------------------------ BatchKVCache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append one step for every row; check out blocks first when the buffers must grow.

        Raises:
            BlockPoolExhaustedError: If growth is due and the pool cannot cover every row; the
                cache is unchanged then.
        """
        capacity = None if self.keys is None else self.keys.shape[2]
        new_len = grown_length(capacity, self._idx, keys.shape[2], self.step)
        if new_len is not None:
            resize_all(self._leases, blocks_for_slots(new_len, self.pool.config.block_size))
        return super().update_and_fetch(keys, values)

    def filter(self, batch_indices: Any) -> None:
        """Keep only ``batch_indices`` rows; dropped rows give their blocks back."""
        keep = [
            int(i)
            for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist") else batch_indices)
        ]
        if not keep:  # mlx_lm clears the list instead; filtering to nothing empties the cache
            self.release()
            return
        kept = set(keep)
        for i, lease in enumerate(self._leases):
            if i not in kept:
                lease.drop(self)
        self._leases = [self._leases[i] for i in keep]
        super().filter(batch_indices)
        self._reaccount()  # a left shift shortens the buffers

    def extend(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows (their leases move here); rows are re-padded to one length."""
        if not isinstance(other, PoolBackedBatchKVCache):
            raise TypeError("can only extend with another PoolBackedBatchKVCache")
        if other.pool is not self.pool:
            raise ValueError("cannot extend with rows accounted in another pool")
        super().extend(other)
        for lease in other._leases:
            lease.holders.discard(other)
            lease.holders.add(self)
        self._leases = self._leases + other._leases
        other._leases = []
        self._reaccount()

    @classmethod
    def merge(cls, caches: list[Any]) -> PoolBackedBatchKVCache:
        """Left-pad single-sequence PoolBackedKVCaches into one batch; their blocks move along.

        Raises:
            ValueError: If a cache is not a pool-attached PoolBackedKVCache of one sequence, or
                the caches draw from different pools.
        """
        if not caches:
            raise ValueError("merge needs at least one cache")
        pool = caches[0].pool
        for c in caches:
            if not isinstance(c, PoolBackedKVCache) or c.pool is None:
                raise ValueError(f"can only merge pool-attached PoolBackedKVCaches, got {c!r}")
            if c.pool is not pool:
                raise ValueError("cannot merge caches of different pools")
            if c.keys is not None and c.keys.shape[0] != 1:
                raise ValueError("can only merge single-sequence caches")
        lengths = [c.size() for c in caches]
        max_length = max(lengths)
        padding = [max_length - n for n in lengths]
        leases = []
        for c in caches:
            lease = c._lease
            lease.holders.discard(c)
            c._lease = RowLease(pool, c.owner, c)  # the single cache gives up its accounting
            leases.append(lease)
        batch = cls(padding if max_length else [0] * len(caches), pool, leases, caches[0].step)
        if max_length == 0:
            batch._reaccount()
            return batch
        present = [c for c in caches if c.keys is not None]
        n_heads = max(c.keys.shape[1] for c in present)
        k_dim = max(c.keys.shape[3] for c in present)
        v_dim = max(c.values.shape[3] for c in present)
        dtype = present[0].keys.dtype
        rows = len(caches)
        keys = mx.zeros((rows, n_heads, max_length, k_dim), dtype=dtype)
        values = mx.zeros((rows, n_heads, max_length, v_dim), dtype=dtype)
        for i, (pad, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None:
                continue
            keys[i : i + 1, :, pad : pad + c.offset] = c.keys[..., : c.offset, :]
            values[i : i + 1, :, pad : pad + c.offset] = c.values[..., : c.offset, :]
        batch.keys, batch.values = keys, values  # type: ignore[assignment]
        batch.offset += max_length
        batch._idx = max_length
        batch._reaccount()
        return batch

    @property
    def state(self) -> Any:
        """As BatchKVCache: (keys, values, offset, left_padding, idx)."""
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        keys = v[0]
        rows = len(self._leases)
        if keys is not None and keys.shape[0] != rows:
            raise ValueError(f"state has {keys.shape[0]} rows, this batch has {rows}")
        if keys is not None:
            bs = self.pool.config.block_size
            resize_all(self._leases, blocks_for_slots(keys.shape[2], bs))
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        if keys is None:
            self._reaccount()

    def __deepcopy__(self, memo: dict[int, Any]) -> PoolBackedBatchKVCache:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name not in ("pool", "_leases"):
                setattr(new, name, copy.deepcopy(value, memo))
        new.pool = self.pool  # one pool: never copied (it holds a lock)
        new._leases = list(self._leases)
        for lease in new._leases:
            lease.holders.add(new)
        return new

    def release(self) -> None:
        """Give back every row's blocks held by this cache and empty it. Idempotent."""
        for lease in self._leases:
            lease.drop(self)
        self._leases = []
        self.keys = self.values = None
        self.offset = mx.array([], dtype=mx.int32)
        self.left_padding = mx.array([], dtype=mx.int32)
        self._idx = 0
