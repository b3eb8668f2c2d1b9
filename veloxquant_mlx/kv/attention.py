"""Decode attention over ragged rows, in plain MLX ops, for the engine's ``StepCache`` steps.

Rows of one decode step sit at different positions, so each attends to its own length: a mask.
On MLX's CUDA backend an array mask moves ``mx.fast.scaled_dot_product_attention`` off its
vector kernel onto its unfused fallback, which broadcasts K and V over each KV head's query
heads (one 1-row product per query head). ``matmul_attention`` takes a KV head's query heads as
the rows of one product instead (``[rows, kv_heads, q_per_kv, D] @ K^T``): K and V are read
once per KV head, where they lie (a strided view of the working set, no copy). MLX's CUDA
matmul plans per shape, so a dense step that attends this way reads its keys in chunks of
``step.READ_CHUNK`` positions (masked past each row's own): the shapes change every 128 steps,
not every step. Measured on an H200, 8B shape, one whole decode step with the keys growing
as in serving (BENCHMARKS.md, "Ragged rows"): even with the mask path at 8 rows, 1.17x at 32,
1.66x at 128. On a CPU both are the same ops, so ``auto`` keeps MLX's own there, and on a GPU
takes matmul from ``AUTO_MATMUL_MIN_ROWS`` rows.

``install`` also routes the paged layout's fused steps (``StepCache.fused``) to
``PagedKV.attend`` (``kv.paged_attention``), which attends through the block tables.

``install`` routes a model's attention calls to it: it wraps the ``scaled_dot_product_attention``
that the model's modules import from ``mlx_lm.models.base``, and the wrapper takes only calls
whose cache is a ``StepCache`` of a step that asked for it (``StepBatch.matmul``), with an
array mask and no sinks; every other call (prefill, stock caches, any other caller of mlx_lm
in the process) goes to the original unchanged. Models that call ``mx.fast`` directly keep the
mask path.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv.step import StepCache

MODES = ("auto", "sdpa", "matmul")
# ``auto`` on a GPU: ragged steps of this many rows or more (BENCHMARKS.md: at 8 rows the two
# are even within a step and MLX's was ahead end to end; from 32 rows matmul is ahead)
AUTO_MATMUL_MIN_ROWS = 32
_NAME = "scaled_dot_product_attention"


@dataclass(frozen=True, slots=True)
class RaggedAttention:
    """How a decode step whose rows sit at different positions attends: by ``mode`` ("sdpa",
    MLX's masked attention, or "matmul", ``matmul_attention``), matmul from ``min_rows`` rows."""

    mode: str = "sdpa"
    min_rows: int = 1

    def uses_matmul(self, rows: int) -> bool:
        return self.mode == "matmul" and rows >= self.min_rows

    @property
    def label(self) -> str:
        """ "sdpa", "matmul", or "matmul>=N" (what ``/metrics`` labels build_info with)."""
        if self.mode != "matmul" or self.min_rows <= 1:
            return self.mode
        return f"matmul>={self.min_rows}"


def choose(requested: str, gpu: bool | None = None) -> RaggedAttention:
    """The policy for ``requested`` ("auto", "sdpa" or "matmul"): ``auto`` is the measured
    best for the device (``gpu``; default: MLX's default device): matmul from
    ``AUTO_MATMUL_MIN_ROWS`` rows on a GPU, MLX's own on a CPU, where both are the same ops."""
    if requested not in MODES:
        raise ValueError(f"ragged attention must be one of {', '.join(MODES)}, got {requested!r}")
    if requested != "auto":
        return RaggedAttention(requested)
    on_gpu = mx.default_device() == mx.gpu if gpu is None else gpu
    if on_gpu:
        return RaggedAttention("matmul", AUTO_MATMUL_MIN_ROWS)
    return RaggedAttention("sdpa")


def matmul_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array
) -> mx.array:
    """Attention of one new token per row: ``queries [B, H, 1, D]`` over ``keys``/``values``
    ``[B, H_kv, L, D]`` with a bool (True = attend) or additive ``mask`` that broadcasts to
    ``[B, 1, 1, L]`` (or ``[B, H_kv, H / H_kv, L]``). The same ops as MLX's fallback, in its
    order (query scaled first, softmax in float32), without the broadcast over query heads.

    Cost: two products of ``B * H * L * D`` each, five kernels; K and V are read in place
    (any strides MLX's matmul takes). Lazy: builds the graph only, like any MLX op.

    Raises:
        ValueError: More than one query per row (prefill keeps MLX's attention).
    """
    b, n_heads, n_q, d = queries.shape
    n_kv = keys.shape[1]
    if n_q != 1:
        raise ValueError("matmul_attention takes one query per row")
    q = (queries * mx.array(scale, queries.dtype)).reshape(b, n_kv, n_heads // n_kv, d)
    scores = q @ keys.swapaxes(-1, -2)  # [B, H_kv, H / H_kv, L]
    if mask.dtype == mx.bool_:
        scores = mx.where(mask, scores, mx.array(-float("inf"), scores.dtype))
    else:
        scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values).reshape(b, n_heads, 1, values.shape[-1])


def install(model: Any) -> int:
    """Route ``model``'s ragged decode attention through ``matmul_attention`` where its step
    asks for it (``cache.batch.matmul``): each of the model's modules that imported mlx_lm's
    ``scaled_dot_product_attention`` gets the routing wrapper in its place. Idempotent; safe for
    every other caller of the wrapped function. Returns how many modules were wrapped now.

    Call it once at load, before any step runs (it rebinds module globals: not safe against
    a model running in another thread at that moment). O(modules of the model)."""
    from mlx_lm.models import base

    names = {type(m).__module__ for _, m in model.named_modules()}
    wrapped = 0
    for name in sorted(names):
        module = sys.modules.get(name)
        original = getattr(module, _NAME, None)
        # only mlx_lm's own (a model file may define another of that name, other arguments)
        if original is not base.scaled_dot_product_attention:
            continue
        setattr(module, _NAME, _routed(original))
        wrapped += 1
    return wrapped


def _routed(original: Any) -> Any:
    def scaled_dot_product_attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        if isinstance(cache, StepCache) and cache.fused:
            # the fetched K and V are the new token only: attention must read the blocks
            if sinks is not None or queries.shape[2] != 1:
                raise ValueError("fused paged attention takes one query per row and no sinks")
            cache.attended = True
            out: mx.array = cache.kv.attend(cache.layer, queries, keys, values, scale)
            return out
        if (
            isinstance(cache, StepCache)
            and cache.batch.matmul
            and not hasattr(cache, "bits")  # quantized KV: mlx_lm's quantized attention
            and isinstance(mask, mx.array)
            and sinks is None
            and queries.shape[2] == 1
        ):
            return matmul_attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache, scale, mask, sinks)

    scaled_dot_product_attention._vq_ragged = True  # type: ignore[attr-defined]
    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention
