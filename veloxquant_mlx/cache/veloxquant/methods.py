"""The fp16 reference cache and group-wise affine int8/int4 caches."""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache.veloxquant.base import KVCache, RowStore


class FP16KVCache(KVCache):
    """Exact reference: keys and values kept as fp16 rows."""

    def __init__(self, head_dim: int) -> None:
        super().__init__(head_dim)
        self._k = RowStore()
        self._v = RowStore()

    def append_key(self, k: mx.array) -> None:
        self._k.append(self._rows(k, "k"))

    def append_value(self, v: mx.array) -> None:
        self._v.append(self._rows(v, "v"))

    def keys(self) -> mx.array:
        rows = self._k.read()
        return mx.zeros((0, self.head_dim)) if rows is None else rows.astype(mx.float32)

    def values(self) -> mx.array:
        rows = self._v.read()
        return mx.zeros((0, self.head_dim)) if rows is None else rows.astype(mx.float32)

    def memory_bytes(self) -> int:
        return self._k.nbytes() + self._v.nbytes()

    def n_keys(self) -> int:
        return self._k.n_rows

    def n_values(self) -> int:
        return self._v.n_rows

    def reset(self) -> None:
        self._k.clear()
        self._v.clear()


class _Quantized:
    """Rows quantized with mx.quantize: bit-packed uint32 codes plus fp16 scales and biases."""

    __slots__ = ("biases", "bits", "codes", "group_size", "scales")

    def __init__(self, rows: mx.array, group_size: int, bits: int) -> None:
        self.codes, self.scales, self.biases = mx.quantize(rows, group_size=group_size, bits=bits)
        self.group_size, self.bits = group_size, bits

    def dequantize(self) -> mx.array:
        return mx.dequantize(
            self.codes, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        ).astype(mx.float32)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.biases.nbytes


class AffineKVCache(KVCache):
    """Per-token group-wise affine quantization: each run of ``group_size`` channels of a token
    shares an fp16 scale and bias; codes are ``bits`` wide, bit-packed into uint32 words.
    """

    def __init__(self, head_dim: int, bits: int, group_size: int = 32) -> None:
        super().__init__(head_dim)
        self.bits, self.group_size = bits, group_size
        self._k: list[_Quantized] = []
        self._v: list[_Quantized] = []
        self._n_k = self._n_v = 0

    def append_key(self, k: mx.array) -> None:
        rows = self._rows(k, "k")
        self._k.append(_Quantized(rows, self.group_size, self.bits))
        self._n_k += rows.shape[0]
        self._k = _compact(self._k, self.group_size, self.bits)

    def append_value(self, v: mx.array) -> None:
        rows = self._rows(v, "v")
        self._v.append(_Quantized(rows, self.group_size, self.bits))
        self._n_v += rows.shape[0]
        self._v = _compact(self._v, self.group_size, self.bits)

    def keys(self) -> mx.array:
        return _read(self._k, self.head_dim)

    def values(self) -> mx.array:
        return _read(self._v, self.head_dim)

    def memory_bytes(self) -> int:
        return sum(q.nbytes for q in self._k) + sum(q.nbytes for q in self._v)

    def n_keys(self) -> int:
        return self._n_k

    def n_values(self) -> int:
        return self._n_v

    def reset(self) -> None:
        self._k, self._v = [], []
        self._n_k = self._n_v = 0


def _compact(chunks: list[_Quantized], group_size: int, bits: int) -> list[_Quantized]:
    """Merge many small quantized chunks into one (codes are per token, so merging is exact)."""
    if len(chunks) < 64:
        return chunks
    merged = _Quantized.__new__(_Quantized)
    merged.codes = mx.concatenate([c.codes for c in chunks], axis=0)
    merged.scales = mx.concatenate([c.scales for c in chunks], axis=0)
    merged.biases = mx.concatenate([c.biases for c in chunks], axis=0)
    merged.group_size, merged.bits = group_size, bits
    return [merged]


def _read(chunks: list[_Quantized], head_dim: int) -> mx.array:
    if not chunks:
        return mx.zeros((0, head_dim))
    return mx.concatenate([c.dequantize() for c in chunks], axis=0)
