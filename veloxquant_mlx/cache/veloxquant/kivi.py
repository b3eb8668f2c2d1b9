"""KIVI: 2-bit keys per channel, 2-bit values per token, fp16 window of recent tokens."""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache.veloxquant.base import KVCache, RowStore
from veloxquant_mlx.cache.veloxquant.methods import _Quantized


class KIVIKVCache(KVCache):
    """KIVI (Liu et al., 2024) asymmetric 2-bit KV cache.

    Keys are quantized per channel: each channel's values over ``group_size`` consecutive tokens
    share one fp16 scale and bias (keys have outlier channels, so grouping along tokens keeps
    them apart). Values are quantized per token, ``group_size`` channels to a group. The most
    recent ``residual_length`` tokens (at least) stay fp16; once ``residual_length + group_size``
    tokens are unquantized, the oldest ``group_size`` are quantized together. Codes are
    bit-packed (16 two-bit codes per uint32), so at long lengths ``memory_bytes`` is about
    3/16 of fp16 (2 bits plus a 16-bit scale and bias per 32 elements).
    """

    def __init__(
        self, head_dim: int, bits: int = 2, group_size: int = 32, residual_length: int = 128
    ) -> None:
        super().__init__(head_dim)
        self.bits, self.group_size, self.residual_length = bits, group_size, residual_length
        self._k_quant: list[_Quantized] = []  # each holds (head_dim, group_size): channels x tokens
        self._v_quant: list[_Quantized] = []  # each holds (group_size, head_dim): tokens x channels
        self._k_res = RowStore()
        self._v_res = RowStore()
        self._n_k_quant = self._n_v_quant = 0

    def append_key(self, k: mx.array) -> None:
        self._k_res.append(self._rows(k, "k"))
        while self._k_res.n_rows >= self.residual_length + self.group_size:
            block = self._k_res.take_front(self.group_size)
            self._k_quant.append(_Quantized(block.T, self.group_size, self.bits))
            self._n_k_quant += self.group_size

    def append_value(self, v: mx.array) -> None:
        self._v_res.append(self._rows(v, "v"))
        while self._v_res.n_rows >= self.residual_length + self.group_size:
            block = self._v_res.take_front(self.group_size)
            self._v_quant.append(_Quantized(block, self.group_size, self.bits))
            self._n_v_quant += self.group_size

    def keys(self) -> mx.array:
        parts = [q.dequantize().T for q in self._k_quant]
        res = self._k_res.read()
        if res is not None:
            parts.append(res.astype(mx.float32))
        return mx.concatenate(parts, axis=0) if parts else mx.zeros((0, self.head_dim))

    def values(self) -> mx.array:
        parts = [q.dequantize() for q in self._v_quant]
        res = self._v_res.read()
        if res is not None:
            parts.append(res.astype(mx.float32))
        return mx.concatenate(parts, axis=0) if parts else mx.zeros((0, self.head_dim))

    def memory_bytes(self) -> int:
        quant = sum(q.nbytes for q in self._k_quant) + sum(q.nbytes for q in self._v_quant)
        return quant + self._k_res.nbytes() + self._v_res.nbytes()

    def n_keys(self) -> int:
        return self._n_k_quant + self._k_res.n_rows

    def n_values(self) -> int:
        return self._n_v_quant + self._v_res.n_rows

    def reset(self) -> None:
        self._k_quant, self._v_quant = [], []
        self._k_res.clear()
        self._v_res.clear()
        self._n_k_quant = self._n_v_quant = 0
