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

``kv.chunk_attention.grouped_attention`` is attention in plain products for any number of
queries (a KV head's query heads as the rows of one product), for two costs MLX's own has:

- On a CPU, MLX's ``exp`` (0.32) takes about 12 ns an element, 55x a multiply, and
  ``mx.power(2, x)`` about 2.5x less, to within an ulp. A prefill chunk of the engine's own (200
  tokens over 2,000 cached, tiny model) spends three quarters of its forward in the softmax's
  ``exp``. With ``exp2`` the softmax is taken as powers of two (the query scaled by
  ``log2(e)``) and normalised after the product with V (a pass over ``[queries, keys]`` fewer);
  ``--attention-softmax exp2`` takes it for the engine's prefill chunks and decode steps
  (1.2-1.5x that forward at 1,000-2,000 cached tokens; BENCHMARKS.md). ``host`` (``auto`` on
  a CPU) also takes a prefill chunk's softmax to numpy once its scores are made (numpy's
  ``exp2`` is ~20x MLX's ``power`` here; the chunk's layer waits for its scores, a CPU's
  forward runs in order anyway); decode steps keep ``exp2`` (a step's scores are few, and its
  forward may be compiled).
- On CUDA, MLX hands a prefill chunk's causal attention to cuDNN, which builds a graph for
  every new shape: 53-70 ms the first time a (chunk, keys) shape is met, 0.3 ms after, on an
  H200. An agent's every turn is a new shape (its new tokens over its whole context), so each
  turn paid it, and so did every stream decoding beside it. ``--prefill-attention auto`` takes
  ``bucketed_attention`` there: cuDNN's flash attention over queries and keys padded to
  buckets, whose graphs the warm-up builds (``kv.chunk_attention``); ``--prefill-attention
  matmul`` takes ``grouped_attention`` (MLX's softmax, one pass), no per-shape build but
  scores materialised (4x cuDNN's time for a 512-token chunk over 16,000 keys on an H100;
  BENCHMARKS.md, "A cached turn's prefill chunk by attention route").

``install`` also routes the paged layout's fused steps (``StepCache.fused``) to
``PagedKV.attend`` (``kv.paged_attention``), which attends through the block tables.

``install`` routes a model's attention calls to them: it wraps the
``scaled_dot_product_attention`` that the model's modules import from ``mlx_lm.models.base``,
and the wrapper takes only calls whose cache is the engine's own: a ``StepCache`` of a step
that asked for matmul (``StepBatch.matmul``, an array mask), or a cache that carries a
``vq_route`` ("exp2", "exp" or "buckets": the engine's prefill caches, and a ``StepCache``
under the exp2 softmax), with no sinks and not quantized; every other call (stock caches, any
other caller of mlx_lm in the process) goes to the original unchanged. Models that call
``mx.fast`` directly keep MLX's attention.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv.chunk_attention import bucketed_attention, grouped_attention
from veloxquant_mlx.kv.step import StepCache

MODES = ("auto", "sdpa", "matmul")
SOFTMAXES = ("auto", "exp", "exp2", "host")
PREFILLS = ("auto", "sdpa", "matmul", "buckets")
# On CUDA a prefill's width (its tokens) is padded to a multiple of this: cuBLAS plans every
# product per shape, 4-5 ms the first time a width is met on an H200 (0.16 ms after), and an
# agent's every turn had a new width; padded, a server meets at most chunk / 64 widths
CUDA_PREFILL_BUCKET = 64
# ``auto`` on a GPU: ragged steps of this many rows or more (BENCHMARKS.md: at 8 rows the two
# are even within a step and MLX's was ahead end to end; from 32 rows matmul is ahead)
AUTO_MATMUL_MIN_ROWS = 32
_NAME = "scaled_dot_product_attention"


@dataclass(frozen=True, slots=True)
class RaggedAttention:
    """How a decode step whose rows sit at different positions attends: by ``mode`` ("sdpa",
    MLX's masked attention, or "matmul", ``matmul_attention``), matmul from ``min_rows`` rows;
    with ``exp2``, every attention of the engine's own caches (prefill chunks too) is
    ``grouped_attention`` with the softmax as powers of two; with ``prefill_matmul``, the
    engine's prefill chunks are ``grouped_attention`` (cuDNN's per-shape graphs avoided)."""

    mode: str = "sdpa"
    min_rows: int = 1
    exp2: bool = False
    host: bool = False  # prefill chunks' softmax by numpy (exp2 on the host)
    prefill_matmul: bool = False
    prefill_bucket: int = 0  # prefill widths padded to a multiple of this (0: not padded)
    prefill_buckets: bool = False  # prefill chunks by MLX's attention over bucketed keys

    @property
    def prefill_route(self) -> str | None:
        """How the engine's prefill caches attend (``vq_route``): "host" (exp2, the powers
        by numpy), "exp2", "buckets" (``bucketed_attention``), "exp" (grouped, MLX's softmax)
        or None (MLX's attention)."""
        if self.prefill_buckets:  # CUDA or asked for: before the CPU's exp2
            return "buckets"
        if self.host:
            return "host"
        if self.exp2:
            return "exp2"
        return "exp" if self.prefill_matmul else None

    def uses_matmul(self, rows: int) -> bool:
        return self.mode == "matmul" and rows >= self.min_rows

    @property
    def label(self) -> str:
        """ "sdpa", "matmul", or "matmul>=N" (what ``/metrics`` labels build_info with)."""
        if self.mode != "matmul" or self.min_rows <= 1:
            return self.mode
        return f"matmul>={self.min_rows}"


def cuda_available() -> bool:
    """Whether this MLX has its CUDA backend and a device for it (a build without the
    ``mx.cuda`` module has not)."""
    return bool(getattr(getattr(mx, "cuda", None), "is_available", bool)())


def choose(
    requested: str,
    gpu: bool | None = None,
    softmax: str = "auto",
    prefill: str = "auto",
    cuda: bool | None = None,
    bucket: int | None = None,
) -> RaggedAttention:
    """The policy for ``requested`` ("auto", "sdpa" or "matmul"), ``softmax`` ("auto", "exp"
    or "exp2") and ``prefill`` ("auto", "sdpa" or "matmul"): ``auto`` is the measured best for
    the device (``gpu``, ``cuda``; default: MLX's default device and backend): ragged steps by
    matmul from ``AUTO_MATMUL_MIN_ROWS`` rows on a GPU, MLX's own on a CPU, where both are the
    same ops; the exp2 softmax on a CPU only (a GPU's ``exp`` is fast); prefill by bucketed
    shapes on CUDA only (cuDNN's per-shape graphs, built by the warm-up; Metal's attention has
    none), and there prefill widths padded to multiples of ``CUDA_PREFILL_BUCKET`` (``bucket``:
    that multiple, 0 none)."""
    for value, allowed, what in (
        (requested, MODES, "ragged attention"),
        (softmax, SOFTMAXES, "attention softmax"),
        (prefill, PREFILLS, "prefill attention"),
    ):
        if value not in allowed:
            raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
    on_gpu = mx.default_device() == mx.gpu if gpu is None else gpu
    if cuda is None:
        cuda = on_gpu and cuda_available()
    host = softmax == "host" or (softmax == "auto" and not on_gpu)
    exp2 = host or softmax == "exp2"
    prefill_matmul = prefill == "matmul"
    buckets = prefill == "buckets" or (prefill == "auto" and cuda)
    if bucket is None:
        bucket = CUDA_PREFILL_BUCKET if cuda else 0
    if bucket < 0:
        raise ValueError(f"the prefill bucket must be 0 or more, got {bucket}")
    if requested != "auto":
        return RaggedAttention(requested, 1, exp2, host, prefill_matmul, bucket, buckets)
    if on_gpu:
        return RaggedAttention(
            "matmul", AUTO_MATMUL_MIN_ROWS, exp2, host, prefill_matmul, bucket, buckets
        )
    return RaggedAttention("sdpa", 1, exp2, host, prefill_matmul, bucket, buckets)


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
    """Route ``model``'s attention over the engine's own caches (``matmul_attention`` where a
    step asks for it, ``grouped_attention`` where a cache carries a ``vq_route``, the fused
    paged read): each of the model's modules that imported mlx_lm's
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
        route = getattr(cache, "vq_route", None)  # the engine's own caches: kv.step, runner
        if (
            route is not None
            and not hasattr(cache, "bits")  # quantized KV: mlx_lm's quantized attention
            and sinks is None
        ):
            if route == "buckets":
                return bucketed_attention(queries, keys, values, scale, mask)
            exp2 = route in ("exp2", "host")
            return grouped_attention(queries, keys, values, scale, mask, exp2, route == "host")
        return original(queries, keys, values, cache, scale, mask, sinks)

    scaled_dot_product_attention._vq_ragged = True  # type: ignore[attr-defined]
    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention
