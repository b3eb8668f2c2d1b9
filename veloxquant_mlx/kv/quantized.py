"""The dense layout with its KV quantized (``--kv-format int8|int4``).

The working set is ``DenseKV``'s, each layer's K and V held as ``(codes, scales, biases)``
(``kv.codec``): a joining row's prefill KV is quantized once into its row, each decode step
quantizes the new token into its position, and attention reads the codes through
``mx.quantized_matmul`` (mlx_lm's quantized attention, which a ``StepCache`` with ``bits``
selects). Cached pages keep the quantized span (a compressed page is cached and shared
compressed); a prefill that starts from cached pages reads them dequantized, and the disk tier
writes them as stored.

A step reads whole rows: each row's ``capacity`` positions, masked past its own (``read_whole``).
MLX's CUDA ``quantized_matmul`` (0.32) has kernels only for contiguous operands, and the first
``width`` positions of a longer buffer are not contiguous: it refused them ("No implementation
for problem shape") where whole rows run. The capacity follows the batch's width in
``READ_CHUNK`` steps, up and down, so a step reads fewer than ``2 * READ_CHUNK`` positions a row
past its width (a regrowth copies the working set once per ``READ_CHUNK`` tokens).

With ``recent`` (``--kv-recent-tokens N``) each row also keeps its newest N tokens in the
model's float type (KIVI's residual window), in a ring per row (position ``p`` in slot
``p % N``): attention (``attend``, routed as the fused paged layout's is) reads positions
before the window from the codes and the window from the ring, in one softmax. Engine thread
only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv import quantized_attention
from veloxquant_mlx.kv.attention import RaggedAttention
from veloxquant_mlx.kv.codec import KVCodec, Stored, join_spans, slice_span
from veloxquant_mlx.kv.dense import DenseKV, rows_to_allocate
from veloxquant_mlx.kv.step import READ_CHUNK, StepBatch

# The capacity shrinks when the batch's width needs this many positions fewer (hysteresis: a
# shrink copies the working set).
SHRINK_SLACK = 4 * READ_CHUNK


class QuantizedDenseKV(DenseKV):
    """``DenseKV`` over quantized K and V: per layer a tuple of three arrays per stream,
    ``[rows, kv_heads, capacity, D * bits / 32]`` codes and ``[rows, kv_heads, capacity,
    D / group_size]`` scales and biases."""

    def __init__(
        self,
        n_layers: int,
        codec: KVCodec,
        block_size: int = 16,
        ragged: RaggedAttention | None = None,
        recent: int = 0,
        kernel: bool = False,
    ) -> None:
        if not codec.quantized:
            raise ValueError("QuantizedDenseKV takes a quantized codec")
        super().__init__(n_layers, block_size, ragged)
        self.codec = codec
        self.qk: list[Stored] = []
        self.qv: list[Stored] = []
        self._geometry: tuple[int, int, int] | None = None  # kv heads, K width, V width
        self.recent = recent
        # Attention reads the codes (and the ring) through ``attend``: with a window, or with
        # ``kernel`` (``--quantized-attention fused``: kv.quantized_attention)
        self.fused = recent > 0 or kernel
        self._kernel = quantized_attention.QuantizedAttention() if kernel else None
        self._kernel_runs: bool | None = None  # decided at the first fused step (the model's)
        self._lens: mx.array | None = None  # each row's positions with the new token, a step
        self.rk: list[mx.array] = []  # per layer [rows, kv_heads, recent, D]: the ring
        self.rv: list[mx.array] = []
        self._batch: StepBatch | None = None

    @property
    def kernel(self) -> quantized_attention.QuantizedAttention | None:
        """The kernels ``fused`` attends through (None without ``kernel``)."""
        return self._kernel

    def _grow_to(self, rows: int, positions: int, shrink: bool = False) -> None:
        """Room for ``rows`` rows of ``positions`` positions; with ``shrink``, a capacity
        ``SHRINK_SLACK`` past that comes down to it."""
        assert self._geometry is not None
        new_rows = rows_to_allocate(self.rows, rows)
        need = -(-positions // READ_CHUNK) * READ_CHUNK
        new_cap = max(self.capacity, need)
        if shrink and self.capacity - need >= SHRINK_SLACK:
            new_cap = need
        if new_rows == self.rows and new_cap == self.capacity:
            return
        keep = min(self.capacity, new_cap)
        heads, k_dim, v_dim = self._geometry
        for name, dim in (("qk", k_dim), ("qv", v_dim)):
            template = self.codec.encode(mx.zeros((1, heads, 1, dim), dtype=self.codec.dtype))
            old: list[Stored] = getattr(self, name)
            grown: list[Stored] = []
            for layer in range(self.n_layers):
                fresh = tuple(
                    mx.zeros((new_rows, heads, new_cap, t.shape[-1]), dtype=t.dtype)
                    for t in template
                )
                if old:
                    for f, o in zip(fresh, old[layer], strict=True):
                        f[: self.rows, :, :keep] = o[:, :, :keep]
                grown.append(fresh)
            setattr(self, name, grown)
        if self.recent:
            for name, dim in (("rk", k_dim), ("rv", v_dim)):
                old_ring: list[mx.array] = getattr(self, name)
                rings = []
                for layer in range(self.n_layers):
                    ring = mx.zeros((new_rows, heads, self.recent, dim), dtype=self.codec.dtype)
                    if old_ring:
                        ring[: self.rows] = old_ring[layer]
                    rings.append(ring)
                setattr(self, name, rings)
        self.rows, self.capacity = new_rows, new_cap

    def put_row(
        self,
        row: int,
        layers: list[tuple[mx.array, mx.array]],
        table: Any,
        start: int = 0,
        fmt: str = "",
    ) -> None:
        """Quantize a prefilled row's KV (each layer's ``[1, H, T, D]``) into row ``row``."""
        k0, v0 = layers[0]
        self._geometry = (k0.shape[1], k0.shape[3], v0.shape[3])
        n = k0.shape[2]
        self._grow_to(row + 1, n + 1)
        for layer, (k, v) in enumerate(layers):
            for dst, src in ((self.qk[layer], k), (self.qv[layer], v)):
                for d, s in zip(dst, self.codec.encode(src), strict=True):
                    d[row : row + 1, :, :n] = s
            if self.recent:  # the newest tokens into their ring slots (two runs at most)
                start = max(0, n - self.recent)
                for ring, src in ((self.rk[layer], k), (self.rv[layer], v)):
                    p = start
                    while p < n:
                        slot = p % self.recent
                        m = min(n - p, self.recent - slot)
                        ring[row : row + 1, :, slot : slot + m] = src[:, :, p : p + m]
                        p += m

    def begin_step(self, batch: StepBatch, max_id: int) -> None:
        self._batch = batch
        if self.qk:
            self._grow_to(len(batch.positions_list), batch.width + 1, shrink=True)
            batch.read_whole(self.capacity)
        if self._kernel is not None:
            self._lens = batch.positions + 1

    def write_read(  # type: ignore[override]
        self, layer: int, keys: mx.array, values: mx.array, batch: StepBatch
    ) -> tuple[Any, Any]:
        rows = keys.shape[0]
        out = []
        for dst, src in ((self.qk[layer], keys), (self.qv[layer], values)):
            if batch.uniform:
                p0 = batch.width - 1
                for d, s in zip(dst, self.codec.encode(src), strict=True):
                    d[:rows, :, p0 : p0 + 1] = s
            else:
                r, h, p = batch.scatter_index(keys.shape[1])
                for d, s in zip(dst, self.codec.encode(src), strict=True):
                    d[r, h, p] = s
            if not self.fused:  # (a fused step reads the working set itself: ``attend``)
                out.append(tuple(d[:rows] for d in dst))  # whole rows: contiguous
        if self.recent:
            for ring, src in ((self.rk[layer], keys), (self.rv[layer], values)):
                if batch.uniform:
                    slot = (batch.width - 1) % self.recent
                    ring[:rows, :, slot : slot + 1] = src
                else:
                    r, h, at = batch.scatter_index(keys.shape[1], self.recent)
                    ring[r, h, at] = src
        if self.fused:
            return keys, values  # the new token only: ``attend`` reads the rest
        return out[0], out[1]

    def attend(
        self, layer: int, queries: mx.array, keys: Any, values: Any, scale: float
    ) -> mx.array:
        """A fused step's attention, ``queries`` [rows, heads, 1, D], the new token in place
        already (``write_read``): without a window, each row's own positions from the codes
        (``kv.quantized_attention``); with one, each row's positions before its last
        ``recent`` from the codes, the window from the ring, one softmax over both."""
        batch = self._batch
        assert batch is not None
        if not self.recent:
            return self._attend_codes(layer, queries, scale)
        if self._kernel_here(queries):
            assert self._kernel is not None and self._lens is not None
            return self._kernel(
                queries.astype(self.codec.dtype),
                self.qk[layer],
                self.qv[layer],
                self._lens,
                scale,
                self.codec.bits or 8,
                self.codec.group_size,
                ring=(self.rk[layer], self.rv[layer]),
                width=batch.width,
            )
        rows, n_heads, _, dim = queries.shape
        n_kv = self.rk[layer].shape[1]
        group, bits = self.codec.group_size, self.codec.bits
        w = self.capacity  # whole rows (contiguous), masked past each row's length
        lengths = (batch.positions + 1)[:, None]  # [rows, 1]
        kw, ks, kb = (mx.expand_dims(p[:rows], 2) for p in self.qk[layer])
        vw, vs, vb = (mx.expand_dims(p[:rows], 2) for p in self.qv[layer])
        ring_k = mx.expand_dims(self.rk[layer][:rows], 2)  # [rows, kv, 1, recent, D]
        ring_v = mx.expand_dims(self.rv[layer][:rows], 2)
        q = (queries * mx.array(scale, queries.dtype)).reshape(rows, n_kv, n_heads // n_kv, 1, dim)
        old = mx.quantized_matmul(q, kw, ks, kb, transpose=True, group_size=group, bits=bits)
        new = q @ ring_k.swapaxes(-1, -2)
        floor = mx.array(mx.finfo(old.dtype).min, old.dtype)
        old_mask = mx.arange(w)[None, :] < lengths - self.recent  # before the window
        new_mask = mx.arange(self.recent)[None, :] < lengths  # filled ring slots
        old = mx.where(old_mask[:, None, None, None, :], old, floor)
        new = mx.where(new_mask[:, None, None, None, :], new.astype(old.dtype), floor)
        weights = mx.softmax(mx.concatenate([old, new], axis=-1), axis=-1, precise=True)
        out = mx.quantized_matmul(
            weights[..., :w], vw, vs, vb, transpose=False, group_size=group, bits=bits
        ) + (weights[..., w:].astype(ring_v.dtype) @ ring_v)
        return out.reshape(rows, n_heads, 1, -1).astype(queries.dtype)

    def window_reference(self, layer: int, queries: mx.array, scale: float) -> mx.array:
        """``attend``'s window route in float32 over the dequantized codes (``mx.dequantize``,
        no quantized product): the start check's yardstick for it."""
        batch = self._batch
        assert batch is not None
        rows = queries.shape[0]
        bits, group = self.codec.bits or 8, self.codec.group_size
        kw, ks, kb = (p[:rows] for p in self.qk[layer])
        vw, vs, vb = (p[:rows] for p in self.qv[layer])
        keys = mx.concatenate(
            [mx.dequantize(kw, ks, kb, group_size=group, bits=bits), self.rk[layer][:rows]], 2
        )
        values = mx.concatenate(
            [mx.dequantize(vw, vs, vb, group_size=group, bits=bits), self.rv[layer][:rows]], 2
        )
        lengths = (batch.positions + 1)[:, None]
        seen = mx.concatenate(
            [
                mx.arange(self.capacity)[None, :] < lengths - self.recent,
                mx.arange(self.recent)[None, :] < lengths,
            ],
            axis=1,
        )
        return quantized_attention.float_attention(queries, keys, values, seen, scale)

    def _kernel_here(self, queries: mx.array) -> bool:
        """Whether this layout's kernel runs here (``--quantized-attention fused`` on CUDA, a
        geometry it holds); decided at the first fused step (the model's geometry)."""
        if self._kernel is None:
            return False
        if self._kernel_runs is None:
            per_kv = queries.shape[1] // self.qk[0][0].shape[1]
            self._kernel_runs = quantized_attention.kernel_runs(
                queries.shape[3], per_kv, self.codec.group_size
            )
        return self._kernel_runs

    def _attend_codes(self, layer: int, queries: mx.array, scale: float) -> mx.array:
        assert self._kernel is not None and self._lens is not None
        bits, group = self.codec.bits or 8, self.codec.group_size
        if queries.dtype != self.codec.dtype:
            queries = queries.astype(self.codec.dtype)
        args = (queries, self.qk[layer], self.qv[layer], self._lens, scale, bits, group)
        if self._kernel_here(queries):
            assert self._batch is not None
            return self._kernel(*args, width=self._batch.width)
        return quantized_attention.reference(*args)

    def encode_span(self, x: mx.array) -> Stored:
        """What a cached page keeps of a prefill's KV ``x`` (a view): its quantized form."""
        return self.codec.encode(x)

    def page_parts(self, pages: list[Any]) -> list[tuple[Stored, Stored]]:
        """The cached pages' KV as stored, concatenated per layer (what the disk tier writes)."""
        runs = self._runs(pages)
        bs = self.block_size
        out = []
        for layer in range(self.n_layers):
            pair = [
                join_spans(
                    [slice_span(span[layer][s], j * bs, (j + n) * bs) for span, j, n in runs]
                )
                for s in (0, 1)
            ]
            out.append((pair[0], pair[1]))
        return out

    def read_pages(self, pages: list[Any]) -> list[tuple[mx.array, mx.array]]:
        """The cached pages' KV dequantized, per layer ``[1, H, pages * bs, D]`` (a prefill
        starting from them attends in full precision)."""
        decode = self.codec.decode
        return [(decode(k), decode(v)) for k, v in self.page_parts(pages)]

    def row_span(self, row: int, start: int, end: int) -> list[tuple[Any, Any]]:
        """Row ``row``'s stored KV at positions ``start:end`` per layer (views)."""
        return [
            (
                tuple(p[row : row + 1, :, start:end] for p in k),
                tuple(p[row : row + 1, :, start:end] for p in v),
            )
            for k, v in zip(self.qk, self.qv, strict=True)
        ]

    def clear(self) -> None:
        self.qk, self.qv, self.rk, self.rv = [], [], [], []
        self.rows = self.capacity = 0

    def nbytes(self) -> int:
        rings = sum(a.nbytes for a in (*self.rk, *self.rv))
        return rings + sum(p.nbytes for stored in (*self.qk, *self.qv) for p in stored)
