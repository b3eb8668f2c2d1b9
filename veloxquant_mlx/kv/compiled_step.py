"""A decode step's model forward as one compiled MLX function (``--compiled-step``).

A step over the dense layout builds the same graph every time but for its shapes: the model's
layers over one new token per row, each layer writing its row's K and V at the row's position
and attending over the working set. Built op by op it costs the host a Python call and a graph
node per operation (hundreds a layer on a CPU, where MLX's fast kernels are made of plain ops;
~48 a layer on a GPU), which is most of a small model's step and a large share of a big one's
at many rows (BENCHMARKS.md, "One decode step taken apart"). ``mx.compile`` traces the forward
once per set of input shapes and then replays it, with its element-wise chains fused.

What the trace sees is told by shapes only (``StepBatch.traced``): the rows (the tokens'
length), the positions read and masked (``arange(read_width)``, in chunks of ``read_chunk``
positions: the shapes change every chunk's steps, not every step; ``step.READ_CHUNK``, 128, on
a GPU, whose matmuls plan per shape, 32 on a CPU, where each position read costs its share of
the attention), the working set's rows and capacity (the K and
V arrays, inputs and outputs of the function, so a write is MLX's scatter into a buffer the
caller no longer holds). Every row is masked and written at its own position, one stream too
(which an eager step takes as a slice update without a mask).

The dense layout only (not the quantized, mixed or paged ones), and not in a group (ranks
would have to trace alike). A model whose forward cannot be traced this way (a cache protocol
it uses differently, a value read back on the host) is stepped eagerly from its first failure
on, with one log line. Engine thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv.dense import SLOT_CHUNK, DenseKV
from veloxquant_mlx.kv.step import READ_CHUNK, StepBatch, StepCache

log = logging.getLogger("veloxquant.engine")


class CompiledStep:
    """The model's decode forward over a ``DenseKV``, compiled (``mx.compile``).

    Owns the compiled function (MLX keeps one trace per set of input shapes) and the
    ``arange`` of each read width met. Writes the step's new K and V arrays into the layout it
    is called with (the layout's arrays are otherwise untouched). Engine thread only.
    """

    def __init__(self, model: Any, n_layers: int, read_chunk: int = READ_CHUNK) -> None:
        if read_chunk < 1 or SLOT_CHUNK % read_chunk:
            raise ValueError(f"the read chunk must divide {SLOT_CHUNK}, got {read_chunk}")
        self.model = model
        self.n_layers = n_layers
        self.read_chunk = read_chunk
        self.failed: str | None = None  # why it stepped eagerly from then on
        self.traces = 0  # shapes traced (MLX keeps each trace for its shapes)
        self._fn = mx.compile(self._forward)
        self._cols: dict[int, mx.array] = {}
        self._kv: DenseKV | None = None  # the layout being traced (set around a call)

    @staticmethod
    def serves(kv: Any) -> bool:
        """Whether steps over the layout ``kv`` can be compiled (the plain dense one)."""
        return type(kv) is DenseKV

    def takes(self, kv: Any) -> bool:
        """Whether a step over ``kv`` goes through the compiled forward."""
        return self.failed is None and self.serves(kv) and bool(kv.k)

    def __call__(self, kv: DenseKV, inputs: mx.array, batch: StepBatch) -> mx.array | None:
        """The last position's logits ``[rows, vocab]`` of a step of ``inputs`` (one token per
        row) over ``kv`` (``begin_step`` done for ``batch``), built and not evaluated; ``kv``'s
        K and V become the step's. None where the forward cannot be compiled (logged once;
        then ``takes`` is False and the caller steps eagerly)."""
        width = -(-batch.width // self.read_chunk) * self.read_chunk
        assert width <= kv.capacity, "a compiled step reads past the working set"
        cols = self._cols.get(width)
        if cols is None:
            cols = self._cols[width] = mx.arange(width)
        n = self.n_layers
        self._kv = kv
        traces = self.traces
        t0 = time.perf_counter()
        try:
            out = self._fn(inputs, batch.positions, cols, *kv.k, *kv.v)
        except Exception as exc:  # the model's forward does something a trace cannot follow
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("decode steps run eagerly: the model's forward does not compile (%s)",
                        self.failed)  # fmt: skip
            return None
        finally:
            self._kv = None
        if self.traces > traces:  # a shape met for the first time
            ms = (time.perf_counter() - t0) * 1e3
            log.debug("decode step compiled for %d rows reading %d of %d positions in %.1f ms",
                      inputs.shape[0], width, kv.capacity, ms)  # fmt: skip
        kv.k, kv.v = list(out[1 : 1 + n]), list(out[1 + n :])
        logits: mx.array = out[0]
        return logits

    def _forward(self, inputs: mx.array, positions: mx.array, cols: mx.array, *kv: mx.array):
        n = self.n_layers
        assert self._kv is not None, "traced outside a call"
        self.traces += 1
        view = self._kv.traced_view(list(kv[:n]), list(kv[n:]))
        batch = StepBatch.traced(positions, cols, view.ragged)
        caches = [StepCache(view, layer, batch) for layer in range(n)]
        logits = self.model(inputs[:, None], cache=caches)[:, -1, :]
        return (logits, *view.k, *view.v)


def decode_logits(
    model: Any,
    kv: Any,
    inputs: mx.array,
    batch: StepBatch,
    n_layers: int,
    compiled: CompiledStep | None = None,
) -> mx.array:
    """The last position's logits ``[rows, vocab]`` of one decode step of ``inputs`` over the
    layout ``kv`` (``begin_step`` done for ``batch``), built and not evaluated: through
    ``compiled`` where it takes the layout, else built op by op over ``StepCache``s."""
    if compiled is not None and compiled.takes(kv):
        logits = compiled(kv, inputs, batch)
        if logits is not None:
            return logits
    caches = [StepCache(kv, layer, batch) for layer in range(n_layers)]
    out: mx.array = model(inputs[:, None], cache=caches)[:, -1, :]
    return out
