"""VeloxQuant's own per-head KV cache interface (what PooledKVCache wraps)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import mlx.core as mx


class KVCache(ABC):
    """One attention head's key/value history, stored in some (possibly compressed) format.

    Vectors are ``head_dim`` wide. ``append_key``/``append_value`` take one vector ``(d,)`` or a
    run of them ``(n, d)``; ``attend(q)`` returns ``softmax(K q / sqrt(d)) V`` over the stored
    tokens as fp16 ``(d,)``. Keys and values are appended separately, so ``len()`` counts the
    tokens that have both. Owns its arrays; not thread-safe (one request, the model thread).
    """

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim

    def _rows(self, x: mx.array, what: str) -> mx.array:
        x = mx.array(x) if not isinstance(x, mx.array) else x
        if x.ndim == 1:
            x = x[None]
        if x.ndim != 2 or x.shape[1] != self.head_dim:
            raise ValueError(
                f"{what} must be ({self.head_dim},) or (n, {self.head_dim}), got {x.shape}"
            )
        return x.astype(mx.float16)

    @abstractmethod
    def append_key(self, k: mx.array) -> None:
        """Append key vector(s): shape (d,) or (n, d), fp16."""

    @abstractmethod
    def append_value(self, v: mx.array) -> None:
        """Append value vector(s): shape (d,) or (n, d), fp16."""

    def append(self, k: mx.array, v: mx.array) -> None:
        """Append keys and values of the same tokens."""
        self.append_key(k)
        self.append_value(v)

    @abstractmethod
    def keys(self) -> mx.array:
        """All stored keys as fp32 (n_keys, d), decompressed."""

    @abstractmethod
    def values(self) -> mx.array:
        """All stored values as fp32 (n_values, d), decompressed."""

    def attend(self, q: mx.array) -> mx.array:
        """Attention of query ``q`` (d,) over the stored tokens; returns fp16 (d,).

        Raises:
            ValueError: If nothing is stored yet, or ``q`` has the wrong shape.
        """
        n = len(self)
        if n == 0:
            raise ValueError("attend() on an empty cache")
        q = self._rows(q, "q")[0].astype(mx.float32)
        keys, values = self.keys()[:n], self.values()[:n]
        weights = mx.softmax((keys @ q) / math.sqrt(self.head_dim), axis=-1)
        return (weights @ values).astype(mx.float16)

    @abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of the stored representation (packed codes, scales, fp16 parts)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every stored token."""

    @abstractmethod
    def n_keys(self) -> int:
        """Keys stored."""

    @abstractmethod
    def n_values(self) -> int:
        """Values stored."""

    def __len__(self) -> int:
        """Tokens with both a key and a value stored."""
        return min(self.n_keys(), self.n_values())


class RowStore:
    """A growing list of row chunks, concatenated on read and merged as it grows."""

    __slots__ = ("_chunks", "n_rows")

    def __init__(self) -> None:
        self._chunks: list[mx.array] = []
        self.n_rows = 0

    def append(self, rows: mx.array) -> None:
        self._chunks.append(rows)
        self.n_rows += rows.shape[0]
        if len(self._chunks) >= 64:  # keep reads O(chunks) small
            self._chunks = [mx.concatenate(self._chunks, axis=0)]

    def read(self) -> mx.array | None:
        if not self._chunks:
            return None
        if len(self._chunks) > 1:
            self._chunks = [mx.concatenate(self._chunks, axis=0)]
        return self._chunks[0]

    def take_front(self, n: int) -> mx.array:
        rows = self.read()
        assert rows is not None and rows.shape[0] >= n, "take_front past the end"
        self._chunks = [rows[n:]] if rows.shape[0] > n else []
        self.n_rows -= n
        return rows[:n]

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._chunks)

    def clear(self) -> None:
        self._chunks.clear()
        self.n_rows = 0
