"""The dense batch KV layout: a contiguous working set per layer (``auto``'s, on every backend).

``[rows, kv_heads, capacity, head_dim]`` per layer and stream, row ``i`` = batch row ``i``. A row
joins by copying its prefill into a free row and leaves a hole the next arrival fills: no KV
moves on join or leave beyond the joiner's own. Attention reads it in place, where the paged
layout's gather copies every row's KV every step (``kv.paged``; BENCHMARKS.md, "Paged KV":
paged 0.6-0.8x at 32-128 rows on an H200, 0.82-0.95x over HTTP at 8 clients on a 2-core CPU).
The accounting is the pool's either way (``blocks held == blocks holding tokens``).

A layout is what ``kv.step.StepCache`` writes to and reads from for an mlx_lm model during a
decode step. Engine thread only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv.attention import RaggedAttention
from veloxquant_mlx.kv.codec import Stored
from veloxquant_mlx.kv.step import StepBatch

ROW_CHUNK = 8  # DenseKV grows its rows in chunks of this many (PagedKV its table mirror)
SLOT_CHUNK = 256  # and its capacity in chunks of this many positions (a multiple of READ_CHUNK)


def rows_to_allocate(allocated: int, rows: int) -> int:
    """The rows a working set of ``allocated`` rows grows to for ``rows``: powers of two up to
    ``ROW_CHUNK``, then chunks of it. Every row is as long as the longest, so rows allocated
    and unused cost a whole context each: with eight rows always, one agent session of 6,000
    tokens held 229 MiB where one row holds 61 (the embedded model; for an 8B model at 32k
    tokens, 32 GiB against 4), and a few sessions at most twice what they use."""
    if rows <= allocated:
        return allocated
    if rows <= ROW_CHUNK:
        return 1 << (rows - 1).bit_length()
    return -(-rows // ROW_CHUNK) * ROW_CHUNK


class DenseKV:
    """Contiguous per-layer working set; row ``i`` holds batch row ``i``'s tokens from 0."""

    kind = "dense"
    fused = False  # attention always reads the working set as returned (kv.step)

    def __init__(
        self, n_layers: int, block_size: int = 16, ragged: RaggedAttention | None = None
    ) -> None:
        self.n_layers = n_layers
        self.block_size = block_size
        self.ragged = ragged or RaggedAttention()
        self.k: list[mx.array] = []
        self.v: list[mx.array] = []
        self.rows = 0  # allocated rows
        self.capacity = 0  # allocated positions per row

    def _grow(self, rows: int, positions: int, like: tuple[mx.array, mx.array]) -> None:
        new_rows = rows_to_allocate(self.rows, rows)
        new_cap = max(self.capacity, -(-positions // SLOT_CHUNK) * SLOT_CHUNK)
        if new_rows == self.rows and new_cap == self.capacity:
            return
        _, heads, _, k_dim = like[0].shape
        v_dim = like[1].shape[3]
        for name, dim, dtype in (("k", k_dim, like[0].dtype), ("v", v_dim, like[1].dtype)):
            arrays = getattr(self, name)
            grown = []
            for layer in range(self.n_layers):
                fresh = mx.zeros((new_rows, heads, new_cap, dim), dtype=dtype)
                if arrays:
                    fresh[: self.rows, :, : self.capacity] = arrays[layer]
                grown.append(fresh)
            setattr(self, name, grown)
        self.rows, self.capacity = new_rows, new_cap

    def put_row(
        self,
        row: int,
        layers: list[tuple[mx.array, mx.array]],
        table: Any,
        start: int = 0,
        fmt: str = "",
    ) -> None:
        """Copy a prefilled row's KV (each layer's ``[1, H, T, D]`` K and V) into row ``row``
        (all of it: the row is its only copy here, ``start`` is for the paged layout)."""
        n = layers[0][0].shape[2]
        self._grow(row + 1, n + 1, layers[0])
        for layer, (k, v) in enumerate(layers):
            self.k[layer][row : row + 1, :, :n] = k
            self.v[layer][row : row + 1, :, :n] = v

    def layout_for(self, fmt: str) -> DenseKV:
        """The layout of every format here: this one (``kv.mixed`` holds several)."""
        return self

    def traced_view(self, k: list[mx.array], v: list[mx.array]) -> DenseKV:
        """This layout over the arrays ``k`` and ``v`` (a compiled step's inputs, written to
        and returned by it: ``kv.compiled_step``); this one is untouched."""
        view = DenseKV(self.n_layers, self.block_size, self.ragged)
        view.k, view.v = list(k), list(v)
        view.rows, view.capacity = self.rows, self.capacity
        return view

    def set_hole(self, row: int) -> None:
        """Row ``row`` left: its slot is written at position 0 and never read until reused."""

    def set_table(self, row: int, table: list[list[int]], start: int = 0) -> None:
        """Tables are the pool's accounting only here: the rows hold the KV."""

    def step_batch(self, positions: list[int]) -> StepBatch:
        return StepBatch.planned(positions, self.ragged)

    def begin_step(self, batch: StepBatch, max_id: int) -> None:
        if self.k:
            self._grow(len(batch.positions_list), batch.width + 1, (self.k[0], self.v[0]))

    def write_read(
        self, layer: int, keys: mx.array, values: mx.array, batch: StepBatch
    ) -> tuple[mx.array, mx.array]:
        rows = keys.shape[0]
        k, v = self.k[layer], self.v[layer]
        if batch.uniform:  # one position for all: a slice update, as stock KVCache does
            p0 = batch.width - 1
            k[:rows, :, p0 : p0 + 1] = keys
            v[:rows, :, p0 : p0 + 1] = values
        else:
            r, h, p = batch.scatter_index(keys.shape[1])
            k[r, h, p] = keys
            v[r, h, p] = values
        self.k[layer], self.v[layer] = k, v
        w = batch.read_width  # <= capacity: begin_step grew it to width + 1 in SLOT_CHUNKs
        return k[:rows, :, :w], v[:rows, :, :w]

    keeps_pages = False  # cached pages keep their own copy of the KV (prefill's, row_span's)
    # Launched ahead, a step's writes may copy a layer's rows when the previous step still
    # reads them; measured cheaper than waiting (BENCHMARKS.md, "The paged store launched
    # after the previous step").
    launch_after_previous = False

    @staticmethod
    def _runs(pages: list[Any]) -> list[tuple[Any, int, int]]:
        """``pages`` as runs (span, first page, pages) of consecutive pages of one span."""
        runs: list[tuple[Any, int, int]] = []
        for page in pages:
            span, j = page.kv
            last = runs[-1] if runs else None
            if last is not None and last[0] is span and last[1] + last[2] == j:
                runs[-1] = (span, last[1], last[2] + 1)
            else:
                runs.append((span, j, 1))
        return runs

    def encode_span(self, x: mx.array) -> Any:
        """What a cached page keeps of a prefill's KV ``x`` (a view; the caller copies)."""
        return x

    def page_parts(self, pages: list[Any]) -> list[tuple[Stored, Stored]]:
        """The cached pages' KV as stored (``kv.codec``: one part per stream here)."""
        return [((k,), (v,)) for k, v in self.read_pages(pages)]

    def read_pages(self, pages: list[Any]) -> list[tuple[mx.array, mx.array]]:
        """The cached pages' KV, concatenated per layer: ``[1, H, pages * bs, D]`` each. A
        page's payload is ``(span, j)``: page ``j`` of a span copied at registration (one
        array per layer and stream); runs of consecutive pages of one span are one slice."""
        runs = self._runs(pages)
        out = []
        for layer in range(self.n_layers):
            pair = []
            for s in (0, 1):
                parts = []
                for span, j, n in runs:
                    bs = self.block_size
                    parts.append(span[layer][s][:, :, j * bs : (j + n) * bs])
                pair.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
            out.append((pair[0], pair[1]))
        return out

    def row_span(self, row: int, start: int, end: int) -> list[tuple[mx.array, mx.array]]:
        """Row ``row``'s KV at positions ``start:end`` per layer (views; the caller copies)."""
        return [
            (k[row : row + 1, :, start:end], v[row : row + 1, :, start:end])
            for k, v in zip(self.k, self.v, strict=True)
        ]

    def clear(self) -> None:
        """Drop the working set (the batch is empty): its memory goes back to MLX."""
        self.k, self.v = [], []
        self.rows = self.capacity = 0

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.k, *self.v))
