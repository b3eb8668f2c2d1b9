"""Rows of several KV formats in one batch (``--kv-formats``: a request's ``kv_format``).

Each format's rows live in a store of their own (``DenseKV`` for the model's float type,
``QuantizedDenseKV`` for int8 / int4), numbered apart from the batch's rows. A decode step is
still one forward over every row (the weights are read once a step, whatever the mix): each
layer gathers a store's rows of the new K and V, writes them there, and attends those rows'
queries over that store (the float store as the dense layout's steps attend, a quantized one
through mlx_lm's quantized attention); the outputs go back in the batch's row order. With the
rows of one format only, a step is that format's own (no gather). Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv.attention import RaggedAttention, matmul_attention
from veloxquant_mlx.kv.chunk_attention import grouped_attention
from veloxquant_mlx.kv.codec import KVCodec
from veloxquant_mlx.kv.dense import DenseKV
from veloxquant_mlx.kv.quantized import QuantizedDenseKV
from veloxquant_mlx.kv.step import READ_CHUNK, StepBatch


@dataclass(slots=True)
class _Part:
    """One store's side of a step."""

    store: DenseKV
    batch: StepBatch  # its rows' step (local rows; a local hole at position 0)
    gather: mx.array | None  # the batch row each local row takes its K, V, query from; None: same
    live: mx.array | None  # the local rows running in the batch, in order; None: every one
    fetched: tuple[Any, Any] = (None, None)  # the layer's K and V as the store reads them


class MixedKV:
    """Stores by format; a batch row is a row of the store of its request's format.

    Args:
        stores: A layout per format (canonical names, ``kv.codec``), the server's own first.
        ragged: How the batch's steps attend (each store plans its own part with it).
    """

    kind = "dense"
    fused = True  # attention reads each store through ``attend``
    keeps_pages = False
    launch_after_previous = False

    def __init__(self, stores: dict[str, DenseKV], ragged: RaggedAttention) -> None:
        self.stores = stores
        self.default = next(iter(stores))
        self.ragged = ragged
        first = stores[self.default]
        self.n_layers = first.n_layers
        self.block_size = first.block_size
        self._where: dict[int, tuple[str, int]] = {}  # batch row -> (format, local row)
        self._parts: list[_Part] = []
        # the batch's rows in the parts' outputs one after the other (then one zero row, for
        # rows of no store): a step's outputs back in the batch's order with one take
        self._order: mx.array | None = None

    def layout_for(self, fmt: str) -> Any:
        """The layout that holds format ``fmt`` ("": the server's own)."""
        return self.stores[fmt or self.default]

    def put_row(
        self,
        row: int,
        layers: list[tuple[mx.array, mx.array]],
        table: Any,
        start: int = 0,
        fmt: str = "",
    ) -> None:
        fmt = fmt or self.default
        self.set_hole(row)
        used = {local for f, local in self._where.values() if f == fmt}
        local = next(i for i in range(len(used) + 1) if i not in used)
        self._where[row] = (fmt, local)
        self.stores[fmt].put_row(local, layers, table, start)

    def set_hole(self, row: int) -> None:
        gone = self._where.pop(row, None)
        if gone is not None:
            self.stores[gone[0]].set_hole(gone[1])

    def set_table(self, row: int, table: list[list[int]], start: int = 0) -> None:
        """Tables are the pool's accounting only here (the stores hold the KV)."""

    def step_batch(self, positions: list[int]) -> StepBatch:
        return StepBatch.planned(positions, self.ragged)

    def begin_step(self, batch: StepBatch, max_id: int) -> None:
        n_rows = len(batch.positions_list)
        by_format: dict[str, dict[int, int]] = {}
        for row, (fmt, local) in self._where.items():
            if row < n_rows:
                by_format.setdefault(fmt, {})[local] = row
        parts = []
        order: dict[int, int] = {}  # batch row -> its place in the parts' outputs
        for fmt, rows in by_format.items():
            n = max(rows) + 1
            gather = [rows.get(j, 0) for j in range(n)]
            store = self.stores[fmt]
            positions = [batch.positions_list[r] if j in rows else 0 for j, r in enumerate(gather)]
            # planned as the whole batch is (the same attention route for every row: a part
            # of a batch that attends by matmul reads in READ_CHUNKs as well, so its shapes
            # repeat; planned alone, 16 rows of 32 would take MLX's masked attention, which on
            # CUDA builds a graph for every new width)
            sub = StepBatch(positions, batch.matmul, READ_CHUNK if batch.matmul else 1, batch.exp2)
            store.begin_step(sub, max_id)
            same = len(by_format) == 1 and gather == list(range(n_rows))
            live = sorted(rows)
            for j in live:
                order[rows[j]] = len(order)
            every = len(live) == n
            parts.append(_Part(store, sub, None if same else mx.array(gather),
                               None if every else mx.array(live)))  # fmt: skip
        self._parts = parts
        self._order = mx.array([order.get(r, len(order)) for r in range(n_rows)])
        held = {fmt for fmt, _ in self._where.values()}
        for fmt, store in self.stores.items():
            if fmt not in held and store.rows:  # no row of it left: its memory goes back
                store.clear()

    def write_read(
        self, layer: int, keys: mx.array, values: mx.array, batch: StepBatch
    ) -> tuple[mx.array, mx.array]:
        for part in self._parts:
            k, v = keys, values
            if part.gather is not None:
                k, v = keys[part.gather], values[part.gather]
            part.fetched = part.store.write_read(layer, k, v, part.batch)
        return keys, values  # the new token only: ``attend`` reads the stores

    def attend(
        self, layer: int, queries: mx.array, keys: Any, values: Any, scale: float
    ) -> mx.array:
        """Each store's rows attend over it; the outputs in the batch's row order (rows of no
        store, holes, get zeros: nothing reads them)."""
        outs = []
        for part in self._parts:
            q = queries if part.gather is None else queries[part.gather]
            o = _attend(part, layer, q, scale).astype(queries.dtype)
            if part.gather is None:
                return o
            outs.append(o if part.live is None else o[part.live])
        outs.append(mx.zeros((1, *queries.shape[1:]), dtype=queries.dtype))
        assert self._order is not None
        return mx.concatenate(outs)[self._order]

    def read_pages(self, pages: list[Any]) -> list[tuple[mx.array, mx.array]]:
        """Cached pages (all of one format: a request hits its own format's) in the model's
        type."""
        return self.layout_for(pages[0].fmt).read_pages(pages) if pages else []

    def page_parts(self, pages: list[Any]) -> list[tuple[Any, Any]]:
        return self.layout_for(pages[0].fmt).page_parts(pages) if pages else []

    def encode_span(self, x: mx.array) -> Any:
        """The server's own format's (a request of another encodes through ``layout_for``)."""
        return self.stores[self.default].encode_span(x)

    def row_span(self, row: int, start: int, end: int) -> list[tuple[Any, Any]]:
        fmt, local = self._where[row]
        return self.stores[fmt].row_span(local, start, end)

    def clear(self) -> None:
        for store in self.stores.values():
            store.clear()
        self._where.clear()
        self._parts = []
        self._order = None

    def nbytes(self) -> int:
        return sum(store.nbytes() for store in self.stores.values())


def _attend(part: _Part, layer: int, q: mx.array, scale: float) -> mx.array:
    """``q`` over one store's K and V as that format's own steps attend: a quantized store
    through mlx_lm's quantized attention (a fused one, with a residual window or
    ``--quantized-attention fused``, through its own), a float one by the batch's route
    (matmul, grouped with the softmax as powers of two, or MLX's)."""
    k, v = part.fetched
    if isinstance(part.store, QuantizedDenseKV) and part.store.fused:
        return part.store.attend(layer, q, k, v, scale)
    batch = part.batch
    mask = batch.mask(None)
    codec = getattr(part.store, "codec", None)
    if codec is not None:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention

        return quantized_scaled_dot_product_attention(
            q, k, v, scale, mask, group_size=codec.group_size, bits=codec.bits
        )
    if batch.matmul and mask is not None:
        return matmul_attention(q, k, v, scale, mask)
    if batch.exp2:
        return grouped_attention(q, k, v, scale, mask, True)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def make_mixed(
    codecs: dict[str, KVCodec],
    n_layers: int,
    block_size: int,
    ragged: RaggedAttention,
    recent: int = 0,
    kernel: bool = False,
) -> MixedKV:
    """A ``MixedKV`` with a dense store per codec (the server's own first); a quantized one
    keeps each row's newest ``recent`` tokens in full precision (``--kv-recent-tokens``)."""
    stores: dict[str, DenseKV] = {
        name: QuantizedDenseKV(n_layers, c, block_size, ragged, recent, kernel)
        if c.quantized
        else DenseKV(n_layers, block_size, ragged)
        for name, c in codecs.items()
    }
    return MixedKV(stores, ragged)
