"""How the running rows' KV is laid out and attended, decided once at load: which models the
batch holds at all, the layout, the fused routes (the paged layout's block tables, the
quantized layout's kernel) and the pool blocks a residual window holds. Each refuses what
cannot work with one line (``ValueError``)."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.model.formats import Formats
from veloxquant_mlx.engine.model.sizing import KVGeometry
from veloxquant_mlx.kv import attention, quantized_attention
from veloxquant_mlx.kv.paged import fused_unreached
from veloxquant_mlx.kv.quantized_check import window_bytes


def check_supported(model: Any) -> None:
    """Raise ValueError for a model whose layers the batch cannot hold (SSM / hybrid state)."""
    kinds = {type(c) for c in make_prompt_cache(model)}
    other = kinds - {KVCache, RotatingKVCache}
    if other:
        names = ", ".join(sorted(k.__name__ for k in other))
        raise ValueError(
            f"this model's layers use {names}; the batched engine serves attention models "
            "(full or sliding-window KV caches) only"
        )


def kv_layout(requested: str) -> str:
    """The batch KV layout: "auto" is the measured best for the device (BENCHMARKS.md,
    "Paged blocks read whole"): the contiguous working set on both. Paged is even with it in
    process on a CPU but 0.82-0.95x over HTTP at 8 clients there, and 0.6-0.8x at 32-128
    clients on an H200 (MLX's gather copies every row's KV every step)."""
    if requested != "auto":
        return requested
    return "dense"


def fused_attention(
    requested: str, layout: str, model: Any, geometry: KVGeometry, block_size: int
) -> bool:
    """Whether the paged layout attends through its block tables (``--paged-attention
    fused``), after checking that every layer's attention reaches it.

    Raises:
        ValueError: An unknown mode, fused without the paged layout, or a model whose
            attention does not go through mlx_lm's ``scaled_dot_product_attention`` for every
            layer (or uses sliding windows or sinks): it would attend to the new token alone.
    """
    if requested not in ("gather", "fused"):
        raise ValueError(f"paged attention must be 'gather' or 'fused', got {requested!r}")
    if requested == "gather":
        return False
    if layout != "paged":
        raise ValueError("--paged-attention fused needs --kv-layout paged")
    attention.install(model)
    missing = fused_unreached(
        model, geometry.n_layers_total, geometry.n_kv_heads, geometry.head_dim, block_size
    )
    require_routed(missing, "--paged-attention fused", "--paged-attention gather")
    return True


def quantized_kernel(requested: str, formats: Formats, head_dim: int, per_kv: int) -> bool:
    """Whether quantized rows attend in one kernel a layer (``fused``,
    ``kv.quantized_attention``) rather than mlx_lm's quantized attention (``mlx``); ``auto``:
    fused where the kernel runs (MLX's CUDA backend, a geometry it holds: ``per_kv`` query heads
    a KV head), where MLX 0.32.4's own route computed wrong outputs (DESIGN-NOTES.md); mlx
    elsewhere.

    Raises:
        ValueError: An unknown mode, or fused with no quantized format to read.
    """
    if requested not in ("auto", "mlx", "fused"):
        raise ValueError(f"quantized attention must be auto, mlx or fused, got {requested!r}")
    quantized = [c for c in formats.codecs.values() if c.quantized]
    if requested == "auto":
        return bool(quantized) and all(
            quantized_attention.kernel_runs(head_dim, per_kv, c.group_size) for c in quantized
        )
    if requested == "mlx":
        return False
    if not quantized:
        raise ValueError(
            "--quantized-attention fused needs --kv-format int8 or int4 (or --kv-formats with one)"
        )
    return True


def require_routed(missing: list[int], flag: str, instead: str) -> None:
    """Refuse ``flag`` (one line naming ``instead``) where some layers' attention does not
    reach the layout's own (``missing``: ``kv.step.unreached_layers``)."""
    if missing:
        raise ValueError(
            f"{flag}: this model's attention in layers {missing} does not go through mlx_lm's "
            f"scaled_dot_product_attention (or uses sliding windows or sinks); use {instead}"
        )


def window_blocks(cfg: EngineConfig, geometry: KVGeometry, formats: Formats) -> dict[str, int]:
    """Pool blocks of each stream one row's residual window takes, by format (a request's
    ``kv_format``; "" the server's own): its ``--kv-recent-tokens`` tokens of every layer in
    the model's type (``kv.quantized``), in blocks of the pool's bytes, rounded up, for each
    quantized format (a float row needs none). A row holds them while it runs (mixed formats
    in one pool).

    Raises:
        ValueError: A window without a quantized format.
    """
    recent = cfg.kv_recent_tokens
    if not recent:
        return {}
    if not any(c.quantized for c in formats.codecs.values()):
        raise ValueError("--kv-recent-tokens needs --kv-format int8 or int4 (or --kv-formats)")
    block = geometry.bytes_per_block(cfg.block_size, formats.block)
    out = {
        name: -(-window_bytes(geometry.n_layers_total, geometry.n_kv_heads,
                              geometry.head_dim, c, recent) // block)
        for name, c in formats.codecs.items()
        if c.quantized
    }  # fmt: skip
    if formats.own.name in out:
        out[""] = out[formats.own.name]
    return out
