"""PoolBackedKVCache: mlx_lm's KVCache protocol, with every buffer slot accounted in the pool."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.cache.lease import RowLease, blocks_for_slots, grown_length
from veloxquant_mlx.pool import BlockPoolAllocator

# mlx_lm's KVCache grows by 256 slots; growing in pool-block-sized chunks instead cost 8-10%
# decode throughput (MLX dispatch cost tracks concatenate calls, not bytes).
_DEFAULT_GROWTH_STEP = 256


def default_step(pool: BlockPoolAllocator) -> int:
    """The seed's default growth chunk: ``max(pool.config.block_size, 256)``."""
    return max(pool.config.block_size, _DEFAULT_GROWTH_STEP)


class PoolBackedKVCache:
    """Drop-in replacement for mlx_lm.models.cache.KVCache whose growth is tracked by a pool.

    Keeps stock KVCache's contiguous-buffer growth (attention wants one contiguous
    ``(B, n_kv_heads, seq_len, head_dim)`` tensor every step) and its exact arithmetic, so
    outputs are bit-identical; every growth step first checks out blocks from the pool. The
    blocks held always cover the slots the buffers really hold: per stream, ``B *
    ceil(capacity / block_size)`` blocks, where ``capacity`` includes the unused tail of the last
    growth chunk. Blocks are marked full when checked out (the memory behind them is allocated);
    ``size()`` is the number of tokens actually written.

    Owns: the K/V buffers, ``offset``, and one :class:`RowLease` (this layer's blocks of this
    request). Caches made together by :func:`build_pooled_caches` share a group, so
    ``release()`` on any layer resets every layer and frees the owner's blocks once.
    Not thread-safe: use it on the thread that runs the model (MLX streams are thread-local).

    Args:
        pool: Shared BlockPoolAllocator to draw growth accounting from.
        owner: Opaque id of this cache's request. Two concurrent caches of different requests
            must use different owners so release() only reclaims their own blocks.
        step: Token-chunk size to grow the backing buffer by; defaults to
            ``max(pool.config.block_size, 256)``.

    Raises:
        ValueError: If ``step`` is not a positive int.
    """

    def __init__(self, pool: BlockPoolAllocator, owner: int = -1, step: int | None = None) -> None:
        if step is None:
            step = default_step(pool)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step must be a positive int, got {step!r}")
        self.pool = pool
        self.owner = owner
        self.step = step
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self._lease = RowLease(pool, owner, self)
        self._group: list[PoolBackedKVCache] = [self]

    # ------------------------------------------------------------------ mlx_lm protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append one step's keys/values and return the full history.

        Args:
            keys: New keys, shape (B, n_kv_heads, S, head_dim).
            values: New values, shape (B, n_kv_heads, S, head_dim).

        Returns:
            (keys, values) accumulated so far, each shape (B, n_kv_heads, offset, head_dim).

        Raises:
            BlockPoolExhaustedError: If growth is due and the pool cannot cover it; the cache
                is unchanged then.
        """
        prev = self.offset
        n_new = keys.shape[2]
        capacity = None if self.keys is None else self.keys.shape[2]
        new_len = grown_length(capacity, prev, n_new, self.step)
        if new_len is not None:
            self._grow(keys, values, prev, new_len)
        self.offset = prev + n_new
        self.keys[..., prev : self.offset, :] = keys  # type: ignore[index]
        self.values[..., prev : self.offset, :] = values  # type: ignore[index]
        return self._fetch()

    def _grow(self, keys: mx.array, values: mx.array, prev: int, new_len: int) -> None:
        batch, n_kv_heads, _, k_head_dim = keys.shape
        # Accounting first: a refused growth leaves buffers and pool untouched.
        self._lease.resize(batch * blocks_for_slots(new_len, self.pool.config.block_size))
        old_len = 0 if self.keys is None else self.keys.shape[2]
        if self.keys is not None and prev % self.step != 0:
            old_len = prev
            self.keys = self.keys[..., :prev, :]
            self.values = self.values[..., :prev, :]  # type: ignore[index]
        chunk = new_len - old_len
        new_k = mx.zeros((batch, n_kv_heads, chunk, k_head_dim), keys.dtype)
        new_v = mx.zeros((batch, n_kv_heads, chunk, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)  # type: ignore[list-item]

    def _fetch(self) -> tuple[mx.array, mx.array]:
        assert self.keys is not None and self.values is not None, "fetch from an empty cache"
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def size(self) -> int:
        """Number of tokens currently stored (the cache's offset)."""
        return self.offset

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        """(keys, values) trimmed to the current offset; ``()`` while empty.

        The setter accepts what the getter returns, a 3-tuple ``(keys, values, offset)`` as
        mlx_lm 0.32's KVCache uses, or an empty/None state (which empties the cache). It
        re-accounts the blocks to the new buffers before adopting them.
        """
        if self.keys is None:
            return ()
        return self._fetch()

    @state.setter
    def state(self, v: Any) -> None:
        if v is None or len(v) == 0 or v[0] is None:
            self._lease.resize(0)
            self.keys = self.values = None
            self.offset = 0
            return
        if len(v) not in (2, 3):
            raise ValueError(f"state must be (keys, values[, offset]), got {len(v)} items")
        keys, values = v[0], v[1]
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys/values must be (B, heads, seq, dim) alike, got {keys.shape} {values.shape}"
            )
        offset = int(v[2]) if len(v) == 3 else keys.shape[2]
        if not 0 <= offset <= keys.shape[2]:
            raise ValueError(f"offset {offset} outside the buffer (length {keys.shape[2]})")
        bs = self.pool.config.block_size
        self._lease.resize(keys.shape[0] * blocks_for_slots(keys.shape[2], bs))
        self.keys, self.values, self.offset = keys, values, offset

    @property
    def meta_state(self) -> str:
        """No extra metadata for this cache type; always empty."""
        return ""

    @meta_state.setter
    def meta_state(self, v: Any) -> None:
        if v:
            raise ValueError("PoolBackedKVCache has no meta state")

    def is_trimmable(self) -> bool:
        """Always True: offset can be rewound via trim()."""
        return True

    def trim(self, n: int) -> int:
        """Rewind the offset by up to ``n`` tokens; returns the amount actually trimmed.

        The buffers keep their length (as in stock KVCache), so the blocks stay accounted.
        """
        n = min(self.offset, max(0, n))
        self.offset -= n
        return n

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        """Build an attention mask for the current offset via mlx_lm's create_attention_mask."""
        return mlx_cache.create_attention_mask(*args, offset=self.offset, **kwargs)  # type: ignore[misc]

    def empty(self) -> bool:
        """True if no keys/values have been written yet."""
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Combined byte size of the backing keys and values buffers."""
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @classmethod
    def merge(cls, caches: list[PoolBackedKVCache]) -> Any:
        """Merge single-sequence caches into a pool-accounted batch cache (for BatchGenerator).

        Each cache's blocks move to the batch as that row's lease (still under the row's
        owner); the merged caches give up their accounting. See PoolBackedBatchKVCache.
        """
        from veloxquant_mlx.cache.pool_backed_batch import PoolBackedBatchKVCache

        return PoolBackedBatchKVCache.merge(caches)

    @classmethod
    def from_state(cls, state: Any) -> PoolBackedKVCache:
        """Rebuild from a saved state (mlx_lm.load_prompt_cache). Not attached to any pool.

        A pool cannot be named in a file; the result accounts nothing until :meth:`attach`.
        """
        obj = cls.__new__(cls)
        obj.pool = None  # type: ignore[assignment]
        obj.owner = -1
        obj.step = _DEFAULT_GROWTH_STEP
        obj.keys = obj.values = None
        obj.offset = 0
        obj._lease = _NullLease()  # type: ignore[assignment]
        obj._group = [obj]
        keys, values = state[0], state[1]
        obj.keys, obj.values = keys, values
        obj.offset = int(state[2]) if len(state) == 3 else keys.shape[2]
        return obj

    def attach(self, pool: BlockPoolAllocator, owner: int) -> None:
        """Account this cache's current buffers in ``pool`` under ``owner`` (after from_state).

        Raises:
            BlockPoolExhaustedError: If the pool cannot hold the buffers; nothing changes then.
            ValueError: If the cache is already attached.
        """
        if self.pool is not None:
            raise ValueError("cache is already attached to a pool")
        lease = RowLease(pool, owner, self)
        if self.keys is not None:
            lease.resize(
                self.keys.shape[0] * blocks_for_slots(self.keys.shape[2], pool.config.block_size)
            )
        self.pool, self.owner, self._lease = pool, owner, lease
        if self.step == _DEFAULT_GROWTH_STEP:
            self.step = default_step(pool)

    # ------------------------------------------------------------------ pool side

    def release(self) -> None:
        """Return every block this request's growth checked out to the pool. Idempotent.

        Every layer of the request shares one owner, so this frees all of them
        (``pool.free_all(owner)``) and resets every cache made with this one by
        build_pooled_caches to empty; the buffers are dropped for MLX to reclaim.
        """
        for cache in self._group:
            cache._lease.forget()
            cache.keys = cache.values = None
            cache.offset = 0
        if self.pool is not None:
            self.pool.free_all(self.owner)

    def n_blocks_held(self) -> int:
        """K + V blocks this layer's buffers hold in the pool."""
        return 2 * self._lease.n_blocks

    def __repr__(self) -> str:
        return (
            f"PoolBackedKVCache(owner={self.owner!r}, offset={self.offset}, "
            f"blocks={self.n_blocks_held()}, step={self.step})"
        )


class _NullLease:
    """The lease of a cache not attached to a pool: accounts nothing."""

    n_blocks = 0

    def resize(self, n_blocks: int) -> None:
        pass

    def forget(self) -> None:
        pass

    def drop(self, holder: object) -> None:
        pass


def register_with_mlx_lm() -> None:
    """Make ``mlx_lm.models.cache.load_prompt_cache`` able to load a saved PoolBackedKVCache
    (it looks cache classes up by name in its own module). Idempotent; an explicit call, never
    an import's side effect."""
    mlx_cache.PoolBackedKVCache = PoolBackedKVCache  # type: ignore[attr-defined]


def build_pooled_caches(
    model: Any, pool: BlockPoolAllocator, owner: int, step: int | None = None
) -> list[Any]:
    """Build one PoolBackedKVCache per language-model layer.

    Drop-in replacement for ``mlx_lm.models.cache.make_prompt_cache`` / ``model.make_cache()``:
    every layer whose stock cache is a plain ``KVCache`` gets a PoolBackedKVCache sharing
    ``pool`` and ``owner``, so one ``pool.free_all(owner)`` (or ``release()`` on any of them)
    releases every layer's blocks at once. Layers whose stock cache is something else
    (sliding-window ``RotatingKVCache``, SSM/``ArraysCache`` layers of hybrid models) keep the
    model's own cache object: their memory is bounded by the window or the state size and is not
    accounted in the pool (documented fallback; ``pooled_layer_fraction`` reports how much of a
    model is accounted).

    Args:
        model: Loaded mlx_lm model instance.
        pool: Shared BlockPoolAllocator every layer's cache draws from.
        owner: Opaque id (e.g. request id) shared by every layer's cache for this request.
        step: Growth chunk size in tokens; defaults to ``max(pool.config.block_size, 256)``.

    Returns:
        One cache per layer, in layer order.
    """
    stock = mlx_cache.make_prompt_cache(model)
    caches: list[Any] = []
    group: list[PoolBackedKVCache] = []
    for layer_cache in stock:
        if type(layer_cache) is mlx_cache.KVCache:
            cache = PoolBackedKVCache(pool, owner=owner, step=step)
            cache._group = group
            group.append(cache)
            caches.append(cache)
        else:
            caches.append(layer_cache)
    return caches


def pooled_layer_fraction(caches: list[Any]) -> float:
    """Fraction of layers whose cache is accounted in the pool (1.0 for plain models)."""
    if not caches:
        return 1.0
    return sum(isinstance(c, PoolBackedKVCache) for c in caches) / len(caches)
