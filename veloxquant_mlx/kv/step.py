"""What an mlx_lm model sees of the engine's batch KV during one decode step.

``StepBatch`` holds the step's per-row facts (positions, mask, how it attends and reads);
``StepCache`` is the cache protocol for one layer (``offset``, ``update_and_fetch``,
``make_mask``) over a layout of ``kv.paged``, which holds the KV. Engine thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

if TYPE_CHECKING:
    from veloxquant_mlx.kv.attention import RaggedAttention

# A masked dense step under matmul attention reads this many positions at a time: the products'
# shapes then change every 128 steps, not every step (MLX's CUDA matmul plans per shape; the
# extra positions are masked). A divisor of dense.SLOT_CHUNK, so a read stays inside the dense
# capacity.
READ_CHUNK = 128


class StepBatch:
    """One decode step's per-row facts, shared by every layer's ``StepCache``.

    Args:
        positions: Where each row's new token goes (= its tokens already in KV), [rows].
        matmul: A masked step attends through ``kv.attention.matmul_attention``.
        width_chunk: A masked step reads its keys in multiples of this many positions.
        exp2: Every layer attends through ``kv.chunk_attention.grouped_attention`` with its softmax
            as powers of two (the CPU's).

    ``width`` is the positions every row's keys span after the write (max position + 1);
    ``read_width`` what a step reads and masks: ``width``, rounded up to ``width_chunk`` when
    rows sit at different positions (every layer has a mask then).
    """

    def __init__(
        self,
        positions: list[int],
        matmul: bool = False,
        width_chunk: int = 1,
        exp2: bool = False,
    ) -> None:
        self.positions_list = positions
        self.rows = len(positions)
        self.matmul = matmul
        self.exp2 = exp2
        self.positions = mx.array(positions, dtype=mx.int32)
        self.width = max(positions) + 1
        # Every row at the same position (one stream, or rows that joined together): each row
        # sees all ``width`` positions, so no mask is needed, and the new tokens go in with one
        # slice update. Both are what stock ``KVCache`` gives one stream; a mask also moves
        # MLX's CUDA attention off its vector kernel.
        self.uniform = min(positions) == self.width - 1
        chunk = 1 if self.uniform else width_chunk
        self.read_width = -(-self.width // chunk) * chunk
        self.whole = False  # the layout reads whole rows (``read_whole``): always masked
        self._masks: dict[int | None, mx.array] = {}
        self._index: dict[tuple[int, int], tuple[mx.array, mx.array, mx.array]] = {}  # heads, ring
        self._cols: mx.array | None = None  # arange(read_width) where given (``traced``)

    @classmethod
    def traced(cls, positions: mx.array, cols: mx.array, ragged: RaggedAttention) -> StepBatch:
        """A step inside a compiled forward (``kv.compiled_step``): everything it decides is
        told by its inputs' shapes (rows: ``positions``'; the positions it reads and masks:
        ``cols``, ``arange(read_width)``), never by their values, since a compiled function
        is traced once per shape. Every row is masked and written at its own position."""
        # matmul at every row count where the policy takes it at all: a compiled step is
        # always masked, and MLX's masked attention broadcasts K and V over the query heads
        batch = cls([0] * positions.shape[0], ragged.mode == "matmul", 1, ragged.exp2)
        batch.positions_list = []  # not known while tracing: the shapes say what is needed
        batch.positions = positions
        batch.width = batch.read_width = cols.shape[0]
        batch.uniform = False
        batch._cols = cols
        return batch

    @classmethod
    def planned(cls, positions: list[int], ragged: RaggedAttention) -> StepBatch:
        """A step over rows at ``positions`` as ``ragged`` says: a matmul step reads in
        ``READ_CHUNK``s (both layouts plan their steps here)."""
        matmul = ragged.uses_matmul(len(positions))
        return cls(positions, matmul, READ_CHUNK if matmul else 1, ragged.exp2)

    def mask(self, window: int | None, return_array: bool = False) -> mx.array | None:
        """[rows, 1, 1, read_width] bool: each row sees its own tokens (the last ``window``); None
        where that is every position of every row (unless ``return_array``)."""
        if (
            not return_array
            and self.uniform
            and not self.whole
            and (window is None or self.width <= window)
        ):
            return None
        m = self._masks.get(window)
        if m is None:
            cols = (mx.arange(self.read_width) if self._cols is None else self._cols)[None, :]
            pos = self.positions[:, None]
            m = cols <= pos
            if window is not None:
                m = m & (cols > pos - window)
            m = m[:, None, None, :]
            self._masks[window] = m
        return m

    def read_whole(self, capacity: int) -> None:
        """The layout reads every row's ``capacity`` positions (the quantized layout: MLX's
        CUDA ``quantized_matmul`` takes only contiguous operands, and a row's first ``width``
        positions of a longer buffer are not); positions past a row's own are masked. Before
        any layer asks for its mask."""
        self.read_width = capacity
        self.whole = True
        self._masks.clear()

    def scatter_index(self, heads: int, ring: int = 0) -> tuple[mx.array, mx.array, mx.array]:
        """Row, head and position indices for writing one token per row at its position, each
        ``[rows, heads, 1]`` (made once a step, not once a layer: a layer's scatter then
        broadcasts none of them), so the update is the layer's new token as it comes, ``[rows,
        heads, 1, D]``, with no slice of it; with ``ring``, the position's slot in a ring of
        that many."""
        index = self._index.get((heads, ring))
        if index is None:
            shape = (self.rows, heads, 1)
            if ring:  # the rows' and heads' indices are the plain write's
                r, h, _ = self.scatter_index(heads)
                at = mx.broadcast_to((self.positions % ring)[:, None, None], shape)
            else:
                r = mx.broadcast_to(mx.arange(self.rows)[:, None, None], shape)
                h = mx.broadcast_to(mx.arange(heads)[None, :, None], shape)
                at = mx.broadcast_to(self.positions[:, None, None], shape)
            index = self._index[(heads, ring)] = (r, h, at)
        return index


def unreached_layers(model: Any, kv: Any, batch: StepBatch, n_layers: int) -> list[int]:
    """The layers whose attention would not reach ``kv.attend`` in a step of ``model`` over
    ``kv`` (a fused layout with a row put in, ``begin_step`` done; after
    ``kv.attention.install``): the step's graph, built and never evaluated. All of them where
    the step cannot be built (sliding windows, sinks, odd shapes)."""
    caches = [StepCache(kv, layer, batch) for layer in range(n_layers)]
    try:
        model(mx.array([[0]]), cache=caches)
    except (ValueError, TypeError, IndexError):
        return list(range(n_layers))
    return [c.layer for c in caches if not c.attended]


def unreached_in_one_row(
    model: Any, kv: Any, n_layers: int, heads: int, head_dim: int, dtype: mx.Dtype
) -> list[int]:
    """``unreached_layers`` over a one-row step of a dense-kind layout ``kv`` (one two-token
    row put in, in ``dtype``); ``kv`` is left empty."""
    zeros = mx.zeros((1, heads, 2, head_dim), dtype=dtype)
    kv.put_row(0, [(zeros, zeros)] * n_layers, None)
    batch = kv.step_batch([2])
    kv.begin_step(batch, 0)
    try:
        return unreached_layers(model, kv, batch, n_layers)
    finally:
        kv.clear()


class StepCache:
    """The mlx_lm cache protocol for one layer in one decode step (one new token per row)."""

    def __init__(self, kv: Any, layer: int, batch: StepBatch) -> None:
        self.kv = kv
        self.layer = layer
        self.batch = batch
        # What this step fetched. A pipeline stage (mlx_lm.models.pipeline) chains its send to
        # the last layer's cache (``cache[-1].keys = mx.depends(cache[-1].keys, h)``); a step
        # evaluates its logits, which hold the send already, so the chained value is kept and
        # not used.
        self.keys: mx.array | None = None
        # Fused paged attention (kv.paged_attention): ``update_and_fetch`` hands back the
        # new token and the routed attention (kv.attention) reads the blocks, and says so.
        self.fused: bool = kv.fused
        self.attended = False
        codec = getattr(kv, "codec", None)
        if codec is not None:  # quantized KV: mlx_lm's attention reads it through these
            self.bits, self.group_size = codec.bits, codec.group_size

    @property
    def vq_route(self) -> str | None:
        """How the routed attention takes this step (``kv.attention``): "exp2" (grouped, the
        softmax as powers of two) or None (as the step's policy says). Prefill caches carry
        the same attribute (``Runner``)."""
        return "exp2" if self.batch.exp2 and not self.fused else None

    @property
    def offset(self) -> mx.array | int:
        """RoPE: each row at its own position (one int where they are all at one, as stock)."""
        batch = self.batch
        return batch.width - 1 if batch.uniform else batch.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] != 1:
            raise ValueError("a decode step takes one token per row")
        fetched: tuple[mx.array, mx.array] = self.kv.write_read(
            self.layer, keys, values, self.batch
        )
        self.keys = fetched[0]
        return fetched

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | None:
        if self.fused:  # attention takes each row's length from the layout, not a mask
            if window_size is not None:
                raise ValueError("fused paged attention has no sliding windows")
            return None
        return self.batch.mask(window_size, return_array)
