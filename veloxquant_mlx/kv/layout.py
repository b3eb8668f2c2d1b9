"""What a batch KV layout does for the engine's runner: the interface ``DenseKV`` and
``PagedKV`` both implement (checked by the type checker where the runner takes one)."""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from veloxquant_mlx.kv.attention import RaggedAttention
from veloxquant_mlx.kv.step import StepBatch


class KVLayout(Protocol):
    """The running rows' KV between decode steps. Engine thread only.

    A row joins with ``put_row``, gets blocks with ``set_table`` and leaves with ``set_hole``;
    each step is ``step_batch`` -> ``begin_step`` -> ``write_read`` per layer (through
    ``kv.step.StepCache``). ``keeps_pages``: a cached page's KV stays in the pool's blocks (no
    copy to cache it); where it does not, ``row_span`` reads a leaving row's KV to copy.
    ``fused``: attention reads the layout itself (``PagedKV.attend``). ``read_pages`` gives
    cached pages in the model's type; ``page_parts`` as stored (``kv.codec``: one part per
    stream, three when quantized), and ``encode_span`` is what a page keeps of a prefill's KV.
    ``launch_after_previous``: a step is launched once the previous one has let go of its
    inputs (BENCHMARKS.md, "The paged store launched after the previous step").
    ``put_row``'s ``fmt`` is the row's KV format and ``layout_for(fmt)`` the layout that holds it
    (``kv.mixed``, ``--kv-formats``; a layout of one format ignores the one and is the other).
    """

    kind: str
    fused: bool
    keeps_pages: bool
    launch_after_previous: bool
    ragged: RaggedAttention

    def put_row(
        self,
        row: int,
        layers: list[tuple[mx.array, mx.array]],
        table: Any,
        start: int = 0,
        fmt: str = "",
    ) -> None: ...

    def layout_for(self, fmt: str) -> Any: ...

    def set_hole(self, row: int) -> None: ...

    def set_table(self, row: int, table: list[list[int]], start: int = 0) -> None: ...

    def step_batch(self, positions: list[int]) -> StepBatch: ...

    def begin_step(self, batch: StepBatch, max_id: int) -> None: ...

    def write_read(
        self, layer: int, keys: mx.array, values: mx.array, batch: StepBatch
    ) -> tuple[mx.array, mx.array]: ...

    def read_pages(self, pages: list[Any]) -> list[tuple[mx.array, mx.array]]: ...

    def page_parts(self, pages: list[Any]) -> list[tuple[Any, Any]]: ...

    def encode_span(self, x: mx.array) -> Any: ...

    def row_span(self, row: int, start: int, end: int) -> list[tuple[mx.array, mx.array]]: ...

    def clear(self) -> None: ...

    def nbytes(self) -> int: ...
