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

On a CPU the cost is elsewhere: MLX's CPU ``exp`` (0.32) takes about 12 ns an element, 55x a
multiply, and ``mx.power(2, x)`` about 2.5x less, to within an ulp. A prefill chunk of the
engine's own (200 tokens over 2,000 cached, tiny model) spends three quarters of its forward in
the softmax's ``exp``. ``exp2_attention`` is the same attention with the softmax taken as powers
of two (the query scaled by ``log2(e)``) and normalised after the product with V (a pass over
``[queries, keys]`` fewer); ``--attention-softmax auto`` takes it on a CPU, for the engine's
prefill chunks and decode steps (1.56x that forward, 1.1x a decode step at 2,000 positions;
BENCHMARKS.md).

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
SOFTMAXES = ("auto", "exp", "exp2")
LOG2E = 1.4426950408889634
# ``auto`` on a GPU: ragged steps of this many rows or more (BENCHMARKS.md: at 8 rows the two
# are even within a step and MLX's was ahead end to end; from 32 rows matmul is ahead)
AUTO_MATMUL_MIN_ROWS = 32
_NAME = "scaled_dot_product_attention"


@dataclass(frozen=True, slots=True)
class RaggedAttention:
    """How a decode step whose rows sit at different positions attends: by ``mode`` ("sdpa",
    MLX's masked attention, or "matmul", ``matmul_attention``), matmul from ``min_rows`` rows;
    with ``exp2``, every attention of the engine's own caches (prefill chunks too) is
    ``exp2_attention``."""

    mode: str = "sdpa"
    min_rows: int = 1
    exp2: bool = False

    def uses_matmul(self, rows: int) -> bool:
        return self.mode == "matmul" and rows >= self.min_rows

    @property
    def label(self) -> str:
        """ "sdpa", "matmul", or "matmul>=N" (what ``/metrics`` labels build_info with)."""
        if self.mode != "matmul" or self.min_rows <= 1:
            return self.mode
        return f"matmul>={self.min_rows}"


def choose(requested: str, gpu: bool | None = None, softmax: str = "auto") -> RaggedAttention:
    """The policy for ``requested`` ("auto", "sdpa" or "matmul") and ``softmax`` ("auto",
    "exp" or "exp2"): ``auto`` is the measured best for the device (``gpu``; default: MLX's
    default device): matmul from ``AUTO_MATMUL_MIN_ROWS`` rows on a GPU, MLX's own on a CPU,
    where both are the same ops; the exp2 softmax on a CPU only (a GPU's ``exp`` is fast)."""
    if requested not in MODES:
        raise ValueError(f"ragged attention must be one of {', '.join(MODES)}, got {requested!r}")
    if softmax not in SOFTMAXES:
        raise ValueError(
            f"attention softmax must be one of {', '.join(SOFTMAXES)}, got {softmax!r}"
        )
    on_gpu = mx.default_device() == mx.gpu if gpu is None else gpu
    exp2 = softmax == "exp2" or (softmax == "auto" and not on_gpu)
    if requested != "auto":
        return RaggedAttention(requested, exp2=exp2)
    if on_gpu:
        return RaggedAttention("matmul", AUTO_MATMUL_MIN_ROWS, exp2)
    return RaggedAttention("sdpa", exp2=exp2)


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


def exp2_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """Attention of ``queries [B, H, N, D]`` over ``keys``/``values`` ``[B, H_kv, L, D]``
    (the last ``N`` of the ``L`` positions are the queries' own), with the softmax taken as
    powers of two. ``mask``: None, "causal", or a bool (True = attend) or additive array that
    broadcasts to ``[B, 1 or H, N, L]``. A KV head's query heads are the rows of one product
    (K and V read in place, no broadcast over heads); the softmax is in float32, as MLX's
    ``precise`` one; the weights are normalised after the product with V. A query that sees no
    position gets 0 (MLX's gives V's mean there; such queries are padding).

    Cost: two products of ``B * H * N * L * D`` each and five passes over ``[B, H, N, L]``.
    Lazy: builds the graph only, like any MLX op."""
    b, n_heads, n_q, d = queries.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    rep = n_heads // n_kv
    q = (queries * mx.array(scale * LOG2E, queries.dtype)).reshape(b, n_kv, rep * n_q, d)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(b, n_kv, rep, n_q, length)
    if scores.dtype != mx.float32:
        scores = scores.astype(mx.float32)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        if n_q > 1:
            mask = (mx.arange(n_q) + (length - n_q))[:, None] >= mx.arange(length)[None]
        else:
            mask = None
    if mask is not None:
        m = mask
        while m.ndim < 4:
            m = m[None]
        m = m[:, :, None] if m.shape[1] == 1 else m.reshape(m.shape[0], n_kv, rep, *m.shape[2:])
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.array(-float("inf"), scores.dtype))
        else:
            scores = scores + (m * LOG2E).astype(scores.dtype)
    # A row of padding that sees nothing (several prompts in one left-padded forward): its max
    # is -inf; clamped, its weights are all 0 and its output 0, not NaN (which would reach V's
    # padding). -inf, not the lowest finite value, masks: MLX's CPU power is 5x slower there.
    top = mx.maximum(scores.max(axis=-1, keepdims=True), mx.finfo(mx.float32).min)
    weights = mx.power(mx.array(2.0, mx.float32), scores - top)
    total = weights.sum(axis=-1, keepdims=True).reshape(b, n_kv, rep * n_q, 1)
    total = mx.maximum(total, 1.0)  # >= 1 wherever a position is seen (the top one's 2^0)
    weights = weights.reshape(b, n_kv, rep * n_q, length).astype(values.dtype)
    out = ((weights @ values) / total).astype(values.dtype)
    return out.reshape(b, n_heads, n_q, values.shape[-1])


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
        if (
            getattr(cache, "vq_exp2", False)
            and not hasattr(cache, "bits")  # quantized KV: mlx_lm's quantized attention
            and sinks is None
        ):
            return exp2_attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache, scale, mask, sinks)

    scaled_dot_product_attention._vq_ragged = True  # type: ignore[attr-defined]
    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention
