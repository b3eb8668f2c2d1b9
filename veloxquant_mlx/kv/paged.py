"""The engine's batch KV memory: where each running row's keys and values live between steps.

Two layouts behind one interface (``kv.layout.KVLayout``), chosen per backend by measurement
(BENCHMARKS.md, "Paged KV"):

- ``PagedKV`` (here): the pool's blocks are the memory. One MLX array holds every block id's K
  or V, a block as ``[kv_heads, block_size, head_dim]``; a row's block table lists its blocks.
  A step gathers each layer's K blocks and V blocks whole, each in one gather that lands in
  attention's layout (the new token goes into the gathered copies), or with ``fused``
  attends through the tables where the blocks lie (``kv.paged_attention``); the step's new
  tokens reach the store in one scatter when the next step begins (in place: nothing else
  references the store by then).
- ``DenseKV`` (``kv.dense``): a contiguous working set per layer, ``auto``'s layout.

Either way rows are right-aligned at position 0, every row attends to its own length only
(``make_mask``) and RoPE takes each row's own offset: nothing is padded to another row's length
in the accounting, which is the pool's (``blocks held == blocks holding tokens``) in both.

A layout is what ``kv.step.StepCache`` writes to and reads from for an mlx_lm model during a
decode step. Engine thread only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx.kv import paged_attention
from veloxquant_mlx.kv.attention import RaggedAttention
from veloxquant_mlx.kv.codec import KVCodec, Stored
from veloxquant_mlx.kv.dense import ROW_CHUNK, DenseKV
from veloxquant_mlx.kv.quantized import QuantizedDenseKV
from veloxquant_mlx.kv.step import StepBatch, unreached_layers


class PagedKV:
    """The pool's blocks as the memory, read through tables a whole block at a time.

    One MLX array, ``[(n_ids + 1) * heads * block_size, head_dim]``, holds every block id's K
    or V (a block id is either, so the store is exactly the pool; the last block is the
    scratch block holes write to). Block ``b`` is ``[heads, block_size, head_dim]`` from row
    ``b * heads * block_size`` on: heads outside, positions inside, as in attention's
    ``[rows, heads, positions, head_dim]``. So a gather of a row's blocks from the store viewed
    as ``[(n_ids + 1) * heads, block_size * head_dim]``, indexed by ``id * heads + head``,
    lands in that layout as it is (a reshape, no transpose, block-sized copies).

    A row's table is ``2 * n_layers`` lists of block ids in position order (K of layer ``l`` at
    ``2l``, V at ``2l + 1``). The tables of the batch's rows are mirrored in one numpy array,
    updated when a row joins, leaves or gets a block; the read indices made from them are kept
    until a table changes or a step needs another block, and the write rows of each row's
    current block until a table changes or a row moves into its next block, so a step of
    unchanged rows adds its positions' offsets and builds no other index (no numpy work: a
    stream's step on a GPU is host-bound).
    """

    kind = "paged"

    def __init__(
        self,
        n_layers: int,
        block_size: int,
        n_ids: int,
        ragged: RaggedAttention | None = None,
        fused: bool = False,
    ) -> None:
        self.n_layers = n_layers
        self.block_size = block_size
        self.n_ids = n_ids
        self.ragged = ragged or RaggedAttention()
        # Attention reads the blocks where they lie (kv.paged_attention), not gathered
        # copies: ``write_read`` hands the new token back and the model's attention calls
        # ``attend`` (``kv.attention.install`` routes it).
        self.fused = fused
        self._kernel = paged_attention.PagedAttention()
        self._kernel_runs: bool | None = None  # decided at the first fused step (the model's)
        self._tabs: mx.array | None = None  # fused: [2L, rows, blocks] block ids, this step's
        self._lens: mx.array | None = None  # fused: [rows] tokens with the new one
        self.store: mx.array | None = None
        self.heads = 0
        self._tables = np.zeros((ROW_CHUNK, 2 * n_layers, 1), dtype=np.int32)
        self._version = 0  # bumped whenever _tables changes
        self._reads_key: tuple[int, int, int] | None = None  # (version, rows, blocks) of _reads
        # per layer, K's and V's: [rows, heads, blocks] rows of the store's block view
        self._reads: list[tuple[mx.array, mx.array]] = []
        self._blocks: mx.array | None = None  # this step's view of the store, one block-head a row
        self._write: mx.array | None = None  # this step's store rows for the new tokens
        self._write_key: tuple[int, tuple[int, ...]] | None = None  # (version, block columns)
        self._write_base: mx.array | None = None  # store rows of those columns' first positions
        self._new: list[mx.array] = []  # and the tokens, by stream: [rows, heads, 1, dim] each
        self._put: mx.array | None = None  # a ragged step's new-token positions, [rows, 1, 1, 1]

    def _block_heads(self, ids: np.ndarray) -> np.ndarray:
        """Rows of the store's block view (one per block and head) of blocks ``ids``:
        ``[*ids, heads]``. (A step's read indices are the same, made on the device.)"""
        return ids[..., None] * self.heads + np.arange(self.heads)

    def _rows_of(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Store rows of position(s) ``pos`` in blocks ``ids``, one per head: ``[*ids, heads]``
        broadcast against ``pos``."""
        return self._block_heads(ids) * self.block_size + pos[..., None] % self.block_size

    def _ensure(self, max_id: int, like: mx.array | None = None) -> None:
        """A store holding block ids up to ``max_id`` (made on the first row, shaped like its K)."""
        if self.store is None:
            assert like is not None
            _, self.heads, _, dim = like.shape
            self.n_ids = max(self.n_ids, max_id + 1)
            rows = (self.n_ids + 1) * self.heads * self.block_size  # + the scratch block
            self.store = mx.zeros((rows, dim), dtype=like.dtype)
        elif max_id >= self.n_ids:  # the pool grew (grow_on_exhaustion): rare, O(pool)
            extra = (max_id + 1 - self.n_ids) * self.heads * self.block_size
            pad = mx.zeros((extra, self.store.shape[1]), dtype=self.store.dtype)
            self.store = mx.concatenate([self.store, pad])
            self._tables[self._tables == self.n_ids] = max_id + 1  # the scratch block moved
            self.n_ids = max_id + 1
            self._version += 1

    def set_table(self, row: int, table: list[list[int]], start: int = 0) -> None:
        """Mirror ``table``'s blocks from index ``start`` on for batch row ``row``."""
        n = len(table[0])
        rows, _, width = self._tables.shape
        if row >= rows or n > width:
            grown = np.zeros(
                (
                    max(rows, -(-(row + 1) // ROW_CHUNK) * ROW_CHUNK),
                    2 * self.n_layers,
                    max(width, n * 2),
                ),
                dtype=np.int32,
            )
            grown[:rows, :, :width] = self._tables
            self._tables = grown
        self._tables[row, :, start:n] = [ids[start:n] for ids in table]
        self._version += 1

    def layout_for(self, fmt: str) -> PagedKV:
        """The layout of every format here: this one."""
        return self

    def put_row(
        self,
        row: int,
        layers: list[tuple[mx.array, mx.array]],
        table: Any,
        start: int = 0,
        fmt: str = "",
    ) -> None:
        """Write a prefilled row's KV into its blocks from position ``start`` on (before it:
        cached pages, already there) and mirror its table."""
        self._flush()  # before the row's table changes: a pending token of a leaver lands first
        self.set_table(row, table)
        self.put_span(layers, table, start, layers[0][0].shape[2])

    def put_span(
        self, layers: list[tuple[mx.array, mx.array]], table: Any, start: int, end: int
    ) -> None:
        """Write positions ``start`` to ``end`` of a prompt's KV (``layers``, from position 0)
        into the blocks of its ``table`` (per layer and stream): a joining row's, or the
        pages a prompt cut short in its prefill leaves cached."""
        self._flush()  # a pending token of a row that left must not land over this one
        ids_all = np.asarray(table, dtype=np.int64)  # [2L, blocks]
        self._ensure(int(ids_all.max()), layers[0][0])
        if start >= end:
            return
        pos = np.arange(start, end)
        ids = ids_all[:, pos // self.block_size]  # [2L, n]
        where = self._rows_of(ids, pos).transpose(0, 2, 1)  # [2L, heads, n]
        vals = mx.stack([t[0, :, start:end] for kv in layers for t in kv])  # [2L, heads, n, dim]
        assert self.store is not None
        dim = self.store.shape[1]
        self.store[mx.array(where.reshape(-1))] = vals.reshape(-1, dim).astype(self.store.dtype)

    def set_hole(self, row: int) -> None:
        """Row ``row`` left: point it at the scratch block (past the pool's ids), so the hole's
        writes never land in a block another request now holds."""
        self._tables[row] = self.n_ids
        self._version += 1

    def step_batch(self, positions: list[int]) -> StepBatch:
        return StepBatch.planned(positions, self.ragged)

    def begin_step(self, batch: StepBatch, max_id: int) -> None:
        """This step's write rows (and read indices, where the tables changed); the previous
        step's tokens are written into the store first, in one scatter."""
        self._flush()
        self._ensure(max_id)
        assert self.store is not None
        positions, bs = batch.positions_list, self.block_size
        rows = len(positions)
        n_blocks = -(-batch.read_width // bs)
        tab = self._tables[:rows]
        # The store rows of each row's current block (one per stream and head), kept until a
        # table changes or a row moves into its next block: a step then adds its offsets only.
        cols = tuple(p // bs for p in positions)
        if (self._version, cols) != self._write_key:
            ids = tab[np.arange(rows), :, np.asarray(cols)].T  # [2L, rows]
            self._write_base = mx.array(self._block_heads(ids) * bs)  # [2L, rows, heads]
            self._write_key = (self._version, cols)
        assert self._write_base is not None
        if batch.uniform:
            self._write = self._write_base + positions[0] % bs
        else:
            offsets = mx.array([p % bs for p in positions], dtype=mx.int32)
            self._write = self._write_base + offsets[:, None]
        key = (self._version, rows, n_blocks)
        if key != self._reads_key:
            if tab.shape[2] < n_blocks:  # a chunked read past every table: the scratch block
                pad = ((0, 0), (0, 0), (0, n_blocks - tab.shape[2]))
                tab = np.pad(tab, pad, constant_values=self.n_ids)
            tab = tab[:, :, :n_blocks]
            if self.fused:  # the tables as they are, by stream: [2L, rows, blocks]
                self._tabs = mx.array(np.ascontiguousarray(tab.transpose(1, 0, 2)))
            else:
                by_layer = tab.reshape(rows, self.n_layers, 2, 1, n_blocks)
                ids_t = mx.array(np.ascontiguousarray(by_layer.transpose(1, 2, 0, 3, 4)))
                heads = mx.arange(self.heads, dtype=mx.int32)[:, None]
                reads = ids_t * self.heads + heads  # [L, 2, rows, heads, blocks]
                self._reads = [(reads[i, 0], reads[i, 1]) for i in range(self.n_layers)]
            self._reads_key = key
        if self.fused:
            self._lens = batch.positions + 1
        elif not batch.uniform:  # where each row's new K and V go in its gathered blocks
            put = np.asarray(positions, dtype=np.int32).reshape(rows, 1, 1, 1)
            self._put = mx.array(put)
        self._blocks = self.store.reshape(-1, self.block_size * self.store.shape[1])
        self._new = []

    def _flush(self) -> None:
        """Write the last step's new tokens (every layer's K and V) into the store: one scatter
        before anything reads or writes the store again, so it lands in place."""
        self._blocks = None  # the store's only reference must be its own, or the write copies it
        if self._new:
            assert self.store is not None and self._write is not None
            dim = self.store.shape[1]
            vals = mx.concatenate(self._new)  # [2L * rows, heads, 1, dim]
            self.store[self._write] = vals.reshape(*self._write.shape, dim)
            self._new = []

    def write_read(
        self, layer: int, keys: mx.array, values: mx.array, batch: StepBatch
    ) -> tuple[mx.array, mx.array]:
        """The layer's K and V through the tables, with the new token put in the gathered copies
        (it reaches the store at the next ``_flush``): the store is only read during a step.

        One gather of whole blocks each for K and V, each landing in attention's layout
        (``[rows, heads, read, dim]``). Each is its own array, as the dense layout's K and V
        are: MLX's CUDA decode attention gave wrong outputs from about 370 positions on (and
        at times an illegal memory access) when K and V were two slices of one gathered array
        (DESIGN-NOTES, "Paged K and V in their own arrays")."""
        assert self._blocks is not None
        rows, heads, _, dim = keys.shape
        if keys.dtype != self._blocks.dtype:
            keys, values = keys.astype(self._blocks.dtype), values.astype(self._blocks.dtype)
        if self.fused:  # attention reads the blocks and this token where they are (``attend``)
            self._new += [keys, values]
            return keys, values
        k_rows, v_rows = self._reads[layer]
        k = self._blocks[k_rows].reshape(rows, heads, -1, dim)
        v = self._blocks[v_rows].reshape(rows, heads, -1, dim)
        if batch.uniform:  # one position for all: slice updates
            p0 = batch.width - 1
            k[:, :, p0 : p0 + 1] = keys
            v[:, :, p0 : p0 + 1] = values
        else:
            assert self._put is not None
            k = mx.put_along_axis(k, self._put, keys, axis=2)
            v = mx.put_along_axis(v, self._put, values, axis=2)
        self._new += [keys, values]
        w = batch.read_width
        return k[:, :, :w], v[:, :, :w]

    def attend(
        self, layer: int, queries: mx.array, keys: mx.array, values: mx.array, scale: float
    ) -> mx.array:
        """Fused: layer ``layer``'s attention for this step's queries through the block tables,
        with the new token ``keys``/``values`` (``write_read``'s) in its place."""
        assert self.store is not None and self._tabs is not None and self._lens is not None
        if queries.dtype != self.store.dtype:
            queries = queries.astype(self.store.dtype)
        args = (queries, keys, values, self.store, self._tabs, layer, self._lens, scale)
        if self._kernel_runs is None:  # the head dim and group are the model's: once
            group = queries.shape[1] // keys.shape[1]
            self._kernel_runs = paged_attention.kernel_runs(self.store.shape[1], group)
        if self._kernel_runs:
            return self._kernel(*args, self.block_size)
        return paged_attention.reference(*args, self.block_size)

    keeps_pages = True  # a cached page's KV stays in its blocks: nothing to copy
    # A step's first write goes into the store the previous step reads. MLX holds a launched
    # step's inputs until it has run, and writes in place only into an array nothing else
    # holds, so launched ahead that write copies the whole pool (DESIGN-NOTES, "Deferred paged
    # write"): a step is launched once the previous one is done (its graph is built meanwhile).
    launch_after_previous = True

    def row_span(self, row: int, start: int, end: int) -> list[tuple[mx.array, mx.array]]:
        """Never needed: a row's pages are cached in their blocks (``keeps_pages``)."""
        raise NotImplementedError("the paged layout caches pages in place")

    def read_pages(self, pages: list[Any]) -> list[tuple[mx.array, mx.array]]:
        """The cached pages' KV through their block ids, per layer: ``[1, H, pages * bs, D]``."""
        self._flush()  # a page registered at a row's end may hold the last step's tokens
        assert self.store is not None
        bs, dim = self.block_size, self.store.shape[1]
        ids = np.array([p.ids for p in pages], dtype=np.int64).T  # [2L, pages]
        index = self._block_heads(ids).transpose(0, 2, 1)  # [2L, H, pages]
        got = self.store.reshape(-1, bs * dim)[mx.array(index)]
        got = got.reshape(len(ids), self.heads, -1, dim)  # [2L, H, pages * bs, D]
        # Read now: an unevaluated read of the store at the next step's write makes that write
        # copy the whole store (the pages' KV is its caller's to keep for as long as it likes).
        # A launch alone is not enough: MLX also copies when the write comes before a launched
        # read has run (DESIGN-NOTES, "Deferred paged write").
        mx.eval(got)
        return [(got[2 * layer][None], got[2 * layer + 1][None]) for layer in range(self.n_layers)]

    def page_parts(self, pages: list[Any]) -> list[tuple[Stored, Stored]]:
        """The cached pages' KV as stored (``kv.codec``: one part per stream here)."""
        return [((k,), (v,)) for k, v in self.read_pages(pages)]

    def encode_span(self, x: mx.array) -> mx.array:
        """Never needed: a cached page's KV stays in its blocks (``keeps_pages``)."""
        return x

    def clear(self) -> None:
        """Keep the store: it is the pool's memory, sized once."""

    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes


def make_kv(
    kind: str,
    n_layers: int,
    block_size: int,
    n_ids: int,
    ragged: RaggedAttention | None = None,
    fused: bool = False,
    codec: KVCodec | None = None,
    recent: int = 0,
    kernel: bool = False,
) -> DenseKV | PagedKV:
    """The layout ``kind`` ("dense" or "paged"; ``fused``: paged, attending through the tables),
    its KV stored as ``codec`` says (None or a float codec: the model's type as it comes; a
    quantized codec: the dense layout only, ``recent`` newest tokens of a row kept in the
    model's type too, attending in one kernel a layer with ``kernel``)."""
    if fused and kind != "paged":
        raise ValueError("fused paged attention needs the paged KV layout")
    if codec is not None and codec.quantized:
        if kind != "dense":
            raise ValueError(f"--kv-format {codec.name} needs --kv-layout dense (or auto)")
        return QuantizedDenseKV(n_layers, codec, block_size, ragged, recent, kernel)
    if kind == "dense":
        return DenseKV(n_layers, block_size, ragged)
    if kind == "paged":
        return PagedKV(n_layers, block_size, n_ids, ragged, fused)
    raise ValueError(f"kv layout must be 'dense' or 'paged', got {kind!r}")


def fused_unreached(
    model: Any, n_layers: int, heads: int, head_dim: int, block_size: int
) -> list[int]:
    """The layers whose attention would not reach ``PagedKV.attend`` in a fused step of
    ``model`` (``kv.step.unreached_layers`` over a one-row step)."""
    kv = PagedKV(n_layers, block_size, 2 * n_layers, fused=True)
    zeros = mx.zeros((1, heads, 1, head_dim))
    kv.put_row(0, [(zeros, zeros)] * n_layers, [[i] for i in range(2 * n_layers)])
    batch = StepBatch([1])
    kv.begin_step(batch, 2 * n_layers - 1)
    return unreached_layers(model, kv, batch, n_layers)
