"""PooledKVCache: a VeloxQuant KVCache whose token appends check out blocks from a shared pool."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.veloxquant.base import KVCache
from veloxquant_mlx.pool import Block, BlockPoolAllocator


class PooledKVCache(KVCache):
    """Wraps any VeloxQuant KVCache with block-pool-backed memory accounting.

    The wrapped cache still owns and drives its own storage (its compression format may be any
    method of KVCacheFactory); this wrapper checks out and returns fixed-size blocks from a shared
    BlockPoolAllocator in lock-step with token appends, so a multi-request server can track
    allocation counts, reuse and fragmentation across every active cache from one pool.

    A new block is requested only when the previous one fills up: O(tokens / block_size) pool
    calls, never one lock per token. A fresh block is checked out with ``n_used=1`` (it is
    partially used, hence fragmented) and marked full by ``mark_used`` when its last slot is
    written, so the pool's fragmentation is exact at every moment while ``Block.n_used`` of the
    block being filled is only brought up to date when it fills (exact counts: ``n_keys()``).

    Owns: the inner cache and this cache's K and V block lists. Not thread-safe.

    Args:
        inner: The underlying KVCache that performs the actual compression.
        pool: Shared BlockPoolAllocator to draw block accounting from.
        owner: Opaque id of this cache's request/sequence. Two PooledKVCache instances must use
            different owners: release() frees every block of the owner.
        format: Compression-format tag recorded on each block (informational; passed to
            ``pool.allocate(format=...)``).

    Raises:
        ValueError: If ``inner`` is not a VeloxQuant KVCache.
    """

    def __init__(
        self, inner: KVCache, pool: BlockPoolAllocator, owner: int = -1, format: str = "fp16"
    ) -> None:
        if not isinstance(inner, KVCache):
            raise ValueError(f"inner must be a VeloxQuant KVCache, got {type(inner).__name__}")
        super().__init__(inner.head_dim)
        self.inner = inner
        self.pool = pool
        self.owner = owner
        self.format = format
        self._blocks: dict[str, list[Block]] = {"k": [], "v": []}
        self._n_tokens: dict[str, int] = {"k": 0, "v": 0}

    def _account(self, stream: str, n_new: int) -> None:
        """Check out blocks for ``n_new`` more tokens of ``stream``; all or nothing."""
        block_size = self.pool.config.block_size
        blocks = self._blocks[stream]
        have = self._n_tokens[stream]
        room = len(blocks) * block_size - have
        if n_new > room:
            new = self.pool.allocate(stream, n_new - room, self.owner, format=self.format)
            # allocate() already filled the new blocks for the tokens beyond `room`; the last one
            # may still be partial (fragmented) until it fills.
            if room and blocks:
                self.pool.mark_used(blocks[-1], block_size)
            blocks.extend(new)
        elif blocks:
            filled = (have + n_new) - (len(blocks) - 1) * block_size
            if filled == block_size:
                self.pool.mark_used(blocks[-1], block_size)
        self._n_tokens[stream] = have + n_new

    def append_key(self, k: Any) -> None:
        """Check out a K block from the pool if needed, then append to the inner cache.

        Args:
            k: Key vector(s), shape (d,) or (n, d), fp16.

        Raises:
            BlockPoolExhaustedError: If the pool has no block for it; nothing is appended then.
        """
        rows = self._rows(k, "k")
        self._account("k", rows.shape[0])
        self.inner.append_key(rows)

    def append_value(self, v: Any) -> None:
        """Check out a V block from the pool if needed, then append to the inner cache.

        Args:
            v: Value vector(s), shape (d,) or (n, d), fp16.
        """
        rows = self._rows(v, "v")
        self._account("v", rows.shape[0])
        self.inner.append_value(rows)

    def attend(self, q: Any) -> mx.array:
        """Delegate attention computation to the inner cache: fp16 (d,)."""
        return self.inner.attend(q)

    def keys(self) -> mx.array:
        return self.inner.keys()

    def values(self) -> mx.array:
        return self.inner.values()

    def memory_bytes(self) -> int:
        """Return memory usage of the inner (compressed) cache."""
        return self.inner.memory_bytes()

    def n_keys(self) -> int:
        return self.inner.n_keys()

    def n_values(self) -> int:
        return self.inner.n_values()

    def release(self) -> None:
        """Return every block this cache holds to the pool (``pool.free_all(owner)``). Idempotent.

        Call this once the request finishes (or is evicted) so its blocks become available for
        reuse by later requests. The inner cache keeps its contents; see reset().
        """
        self.pool.free_all(self.owner)
        self._blocks = {"k": [], "v": []}
        self._n_tokens = {"k": 0, "v": 0}

    def n_blocks_held(self) -> int:
        """Total K + V blocks currently checked out to this cache."""
        return len(self._blocks["k"]) + len(self._blocks["v"])

    def reset(self) -> None:
        """Return all held blocks to the pool and clear the inner cache (length back to 0)."""
        self.release()
        self.inner.reset()
