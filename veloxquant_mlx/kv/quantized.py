"""The dense layout with its KV quantized (``--kv-format int8|int4``).

The working set is ``DenseKV``'s, each layer's K and V held as ``(codes, scales, biases)``
(``kv.codec``): a joining row's prefill KV is quantized once into its row, each decode step
quantizes the new token into its position, and attention reads the codes through
``mx.quantized_matmul`` (mlx_lm's quantized attention, which a ``StepCache`` with ``bits``
selects). Cached pages keep the quantized span (a compressed page is cached and shared
compressed); a prefill that starts from cached pages reads them dequantized, and the disk tier
writes them as stored. Engine thread only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv.attention import RaggedAttention
from veloxquant_mlx.kv.codec import KVCodec, Stored, join_spans, slice_span
from veloxquant_mlx.kv.dense import ROW_CHUNK, SLOT_CHUNK, DenseKV
from veloxquant_mlx.kv.step import StepBatch


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
    ) -> None:
        if not codec.quantized:
            raise ValueError("QuantizedDenseKV takes a quantized codec")
        super().__init__(n_layers, block_size, ragged)
        self.codec = codec
        self.qk: list[Stored] = []
        self.qv: list[Stored] = []
        self._geometry: tuple[int, int, int] | None = None  # kv heads, K width, V width

    def _grow_to(self, rows: int, positions: int) -> None:
        assert self._geometry is not None
        new_rows = max(self.rows, -(-rows // ROW_CHUNK) * ROW_CHUNK)
        new_cap = max(self.capacity, -(-positions // SLOT_CHUNK) * SLOT_CHUNK)
        if new_rows == self.rows and new_cap == self.capacity:
            return
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
                        f[: self.rows, :, : self.capacity] = o
                grown.append(fresh)
            setattr(self, name, grown)
        self.rows, self.capacity = new_rows, new_cap

    def put_row(
        self, row: int, layers: list[tuple[mx.array, mx.array]], table: Any, start: int = 0
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

    def begin_step(self, batch: StepBatch, max_id: int) -> None:
        if self.qk:
            self._grow_to(len(batch.positions_list), batch.width + 1)

    def write_read(  # type: ignore[override]
        self, layer: int, keys: mx.array, values: mx.array, batch: StepBatch
    ) -> tuple[Stored, Stored]:
        rows = keys.shape[0]
        w = batch.read_width
        out = []
        for dst, src in ((self.qk[layer], keys), (self.qv[layer], values)):
            new = self.codec.encode(src)
            if batch.uniform:
                p0 = batch.width - 1
                for d, s in zip(dst, new, strict=True):
                    d[:rows, :, p0 : p0 + 1] = s
            else:
                r, h = batch.scatter_index(keys.shape[1])
                p = batch.positions[:, None]
                for d, s in zip(dst, new, strict=True):
                    d[r, h, p] = s[:, :, 0, :]
            out.append(tuple(d[:rows, :, :w] for d in dst))
        return out[0], out[1]

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
        self.qk, self.qv = [], []
        self.rows = self.capacity = 0

    def nbytes(self) -> int:
        return sum(p.nbytes for stored in (*self.qk, *self.qv) for p in stored)
