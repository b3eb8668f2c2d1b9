"""Loading the model the engine serves (on the engine thread: MLX streams are thread-local)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.loop import last_logits
from veloxquant_mlx.engine.loop.blocks import BlockMath
from veloxquant_mlx.engine.loop.disk_tier import DiskTier, save_pages
from veloxquant_mlx.engine.loop.group import PIPELINE, Group, init_group
from veloxquant_mlx.engine.loop.page_file import fingerprint
from veloxquant_mlx.engine.loop.runner import Runner
from veloxquant_mlx.engine.loop.scheduler import Scheduler
from veloxquant_mlx.engine.model import fused_linear
from veloxquant_mlx.engine.model.choices import (
    answers_up_to,
    compiled_read_chunk,
    compiled_step,
    mlx_cache_limit,
    prefill_budget,
    prefill_join,
    prefill_parts,
    prefill_stall_ratio,
    prefill_stream,
    sampling_cut,
)
from veloxquant_mlx.engine.model.default_model import NAME as DEFAULT_NAME
from veloxquant_mlx.engine.model.default_model import ensure_default_model
from veloxquant_mlx.engine.model.formats import kv_formats
from veloxquant_mlx.engine.model.kv_routes import (
    check_supported,
    fused_attention,
    kv_layout,
    quantized_kernel,
    require_routed,
    window_blocks,
)
from veloxquant_mlx.engine.model.sizing import KVGeometry, pool_config, probe_geometry
from veloxquant_mlx.engine.model.tokenizer import load_tokenizer, template_config, unbounded
from veloxquant_mlx.kv import attention
from veloxquant_mlx.kv.codec import KVCodec
from veloxquant_mlx.kv.mixed import make_mixed
from veloxquant_mlx.kv.paged import make_kv
from veloxquant_mlx.kv.quantized_check import check_kernels
from veloxquant_mlx.kv.step import unreached_in_one_row
from veloxquant_mlx.pool import BlockPoolAllocator

log = logging.getLogger("veloxquant.engine")


def model_path(model: str | None, cache_dir: str | None) -> tuple[Path, str]:
    """(directory, name) of a local model, or of the embedded default model if None (made on
    first use).

    Raises:
        FileNotFoundError: If ``model`` is not an existing directory (nothing is downloaded).
    """
    if model is None:
        return ensure_default_model(Path(cache_dir) if cache_dir else None), DEFAULT_NAME
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is not a local directory (this server never downloads)"
        )
    return path, path.name


def load(
    model: str | None,
    cache_dir: str | None,
    dtype: str,
    group: Group | None = None,
    chat_template: str | None = None,
) -> tuple[Any, Any, str, Path]:
    """(model, tokenizer, name, directory) for a local path, or the embedded default model if
    None; with a ``group``, this rank's shard of it (``load_shard``).

    ``dtype``: "auto" runs floating weights in float32 on a CPU (MLX's CPU fp16/bf16 matmuls do
    not use BLAS and are 10-50x slower) and keeps them as stored on a GPU; "model" keeps them as
    stored; "float32", "float16", "bfloat16" cast. Quantized weights stay quantized.

    Raises:
        FileNotFoundError: If ``model`` is not an existing directory (nothing is downloaded).
    """
    import mlx_lm

    path, name = model_path(model, cache_dir)
    if group is None:
        loaded = mlx_lm.load(str(path), tokenizer_config=template_config(chat_template))
        net, tokenizer = loaded[0], unbounded(loaded[1])
    else:
        net, tokenizer = load_shard(path, group, chat_template)
    target = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(dtype)
    if dtype == "auto" and mx.default_device() == mx.cpu:
        target = mx.float32
    if target is not None:
        net.set_dtype(target)
    log.info("loaded %s from %s (dtype %s)", name, path, dtype)
    return net, tokenizer, name, path


def load_shard(path: Path, group: Group, chat_template: str | None = None) -> tuple[Any, Any]:
    """This rank's shard of the model at ``path``, as ``mlx_lm.utils.sharded_load`` makes it
    (tensor parallel: ``model.shard``; pipeline: ``model.model.pipeline``), from a local
    directory: weights load lazily, so a pipeline stage reads only its own layers.

    Raises:
        ValueError: If the model does not support the group's kind of parallelism.
    """
    from mlx_lm.utils import load_model

    net, _ = load_model(path, lazy=True, strict=False)
    if group.mode == PIPELINE:
        if not hasattr(getattr(net, "model", None), "pipeline"):
            raise ValueError(
                f"{path.name} ({type(net).__module__}) does not support pipeline parallelism; "
                "run without --pipeline (tensor parallel)"
            )
        net.model.pipeline(group.group)
    else:
        if not hasattr(net, "shard"):
            raise ValueError(
                f"{path.name} ({type(net).__module__}) does not support tensor parallelism"
                + ("; try --pipeline" if hasattr(getattr(net, "model", None), "pipeline") else "")
            )
        net.shard(group.group)
    mx.eval(net.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group.group))  # every rank loaded
    return net, load_tokenizer(path, chat_template)


@dataclass(frozen=True, slots=True)
class Runtime:
    """Everything the engine thread builds at start (all made on that thread)."""

    model: Any
    tokenizer: Any
    name: str
    geometry: KVGeometry
    pool: BlockPoolAllocator
    scheduler: Scheduler
    runner: Runner
    kv_bytes_per_block: int
    blas: str
    device: str
    vocab_size: int
    path: Path
    group: Group | None = None
    disk: DiskTier | None = None
    kv_formats: tuple[str, ...] = ()  # what a request may ask for, the server's own first


def disk_tier(
    cfg: EngineConfig,
    scheduler: Scheduler,
    runner: Runner,
    geometry: KVGeometry,
    path: Path,
    in_group: bool,
    codec: KVCodec,
) -> DiskTier | None:
    """The prefix cache's disk tier ``--prefix-cache-dir`` asks for, hooked into the
    scheduler (loads at admission) and the cache (writes on eviction)."""
    if cfg.prefix_cache_dir is None:
        return None
    cache = scheduler.cache
    if cache is None:
        raise ValueError("--prefix-cache-dir needs prefix caching (drop --no-prefix-caching)")
    if in_group:
        raise ValueError("--prefix-cache-dir is not supported across ranks")
    parts: tuple[object, ...] = (
        "kv-pages-v1",
        geometry.dtype,
        geometry.n_layers_total,
        geometry.n_kv_heads,
        geometry.head_dim,
        cfg.block_size,
    )
    if codec.quantized:  # a page of another format never matches
        parts += (codec.name, codec.group_size)
    fp = fingerprint(path, parts)
    probe = codec.encode(mx.zeros((1, 1, 1, geometry.head_dim), dtype=codec.dtype))
    tier = DiskTier(
        Path(cfg.prefix_cache_dir),
        int(cfg.prefix_cache_disk_gb * 2**30),
        fp,
        geometry.n_layers_total,
        tuple(part.dtype for part in probe),
    )
    cache.root = tier.root_digest
    scheduler.tables.disk = tier
    cache.on_evict = lambda pages: save_pages(tier, runner.kv, pages)
    return tier


def build_runtime(cfg: EngineConfig) -> Runtime:
    """Load the model, size the pool from its KV geometry, make the scheduler and runner."""
    from veloxquant_mlx.blas import blas_in_use

    cache_limit = mlx_cache_limit(cfg)
    if cache_limit is not None:  # before the model's weights make the first buffers
        mx.set_cache_limit(cache_limit)
        log.info("MLX keeps at most %d MiB of freed buffers for reuse", cache_limit >> 20)
    group = init_group(cfg.pipeline, cfg.group_timeout) if cfg.distributed else None
    if group is not None and cfg.grow_on_exhaustion:
        raise ValueError("--grow-on-exhaustion is not supported across ranks")
    model, tokenizer, name, path = load(
        cfg.model, cfg.model_cache_dir, cfg.dtype, group, cfg.chat_template
    )
    check_supported(model)
    geometry = probe_geometry(model)
    if group is None and cfg.fused_projections == "on":  # (a shard's linears are not plain)
        fused_linear.install(model)
    formats = kv_formats(cfg, geometry)
    codec = formats.own
    n_heads = getattr(getattr(model, "args", None), "num_attention_heads", geometry.n_kv_heads)
    kernel = quantized_kernel(
        cfg.quantized_attention, formats, geometry.head_dim, int(n_heads) // geometry.n_kv_heads
    )
    for each in formats.codecs.values():
        if each.quantized:  # MLX compiles these kernels on first use (minutes for int4 on CUDA)
            log.info("checking %s quantized attention on %s", each.name, mx.default_device())
        check_kernels(
            each,
            int(n_heads),
            geometry.n_kv_heads,
            geometry.head_dim,
            cfg.kv_recent_tokens,
            kernel,
        )
    windows = window_blocks(cfg, geometry, formats)
    sizing = pool_config(
        geometry,
        block_size=cfg.block_size,
        kv_cache_mb=cfg.kv_cache_mb,
        n_blocks=cfg.n_blocks,
        separate_kv=cfg.separate_kv,
        grow_on_exhaustion=cfg.grow_on_exhaustion,
        max_blocks=cfg.max_blocks,
        codec=formats.block,
    )
    if group is not None:  # the same capacity in tokens on every rank: the smallest
        per_token_block = 2 * geometry.n_layers_total
        token_blocks = group.min_int(sizing.n_blocks // per_token_block)
        sizing = dataclasses.replace(sizing, n_blocks=token_blocks * per_token_block)
    pool = BlockPoolAllocator(sizing)
    per_block = geometry.bytes_per_block(cfg.block_size, formats.block)
    n_blocks = pool.stats.n_blocks
    spans = formats.spans(geometry, cfg.block_size)
    blocks = BlockMath(pool, geometry.n_layers_total, windows, spans)
    if not blocks.could_ever_fit(cfg.min_request_tokens):
        per_request = 2 * (
            blocks.n_layers * blocks.blocks_for(cfg.min_request_tokens) + blocks.window()
        )
        raise ValueError(
            f"the KV pool ({n_blocks} blocks, {n_blocks * per_block / 2**20:.1f} MiB) cannot "
            f"hold even one request of {cfg.min_request_tokens} tokens (a one-token prompt "
            f"and the default max_tokens), which needs {per_request * per_block / 2**20:.1f} "
            "MiB: raise --kv-cache-mb or --n-blocks, or lower --default-max-tokens"
        )
    layout = kv_layout(cfg.kv_layout)
    ragged = attention.choose(
        cfg.ragged_attention,
        softmax=cfg.attention_softmax,
        prefill=cfg.prefill_attention,
        bucket=cfg.prefill_bucket,
    )
    fused = fused_attention(cfg.paged_attention, layout, model, geometry, cfg.block_size)
    # routed attention (fused_attention installed it already for a fused layout)
    if ragged.mode == "matmul" or ragged.prefill_route is not None:
        attention.install(model)
    kv: Any = make_kv(
        layout,
        geometry.n_layers_total,
        cfg.block_size,
        n_blocks,
        ragged,
        fused,
        codec,
        cfg.kv_recent_tokens,
        kernel,
    )
    # a one-row step of the routed layout: the layers whose attention would not reach it
    probe = (geometry.n_layers_total, geometry.n_kv_heads, geometry.head_dim, codec.dtype)
    if formats.mixed:  # each format's rows in a store of its own (kv.mixed)
        kv = make_mixed(
            formats.codecs,
            geometry.n_layers_total,
            cfg.block_size,
            ragged,
            cfg.kv_recent_tokens,
            kernel,
        )
        attention.install(model)
        missing = unreached_in_one_row(model, kv, *probe)
        require_routed(missing, "--kv-formats", "one KV format (drop --kv-formats)")
    if (cfg.kv_recent_tokens or kernel) and not formats.mixed:  # routed (kv.quantized.attend)
        attention.install(model)
        missing = unreached_in_one_row(model, kv, *probe)
        if cfg.kv_recent_tokens:
            require_routed(missing, "--kv-recent-tokens", "--kv-recent-tokens 0")
        require_routed(missing, "--quantized-attention fused", "--quantized-attention mlx")
    vocab_size = int(model(mx.array([[0]])).shape[-1])  # the logits' width, added tokens too
    if group is None:  # (in a group every rank would have to decide alike: not there)
        last_logits.install(model)  # a prompt's forward projects only the position it samples
    own_stream = prefill_stream(cfg, kv.keeps_pages, grouped=group is not None)
    parts = prefill_parts(cfg, grouped=group is not None)
    joins = prefill_join(cfg)
    runner = Runner(
        model,
        kv,
        vocab_size,
        cfg.block_size,
        own_stream,
        joins,
        sampling_cut(cfg),
        split_chunks=parts != 1,
        compiled_step=compiled_step(cfg, grouped=group is not None),
        compiled_read_chunk=compiled_read_chunk(),
    )
    scheduler = Scheduler(
        pool,
        geometry.n_layers_total,
        cfg.max_running,
        cfg.max_queue,
        cfg.prefix_caching,
        prefill_step=cfg.prefill_step,
        prefill_budget=prefill_budget(cfg),
        idle_prefill_budget=cfg.idle_prefill_budget,
        stall_ratio=prefill_stall_ratio(cfg, grouped=group is not None),
        prefill_parts=parts,
        answers_up_to=answers_up_to(cfg.prefix_cache_answers, kv.keeps_pages),
        kv_format=codec.name,
        windows=windows,
        window_format=geometry.dtype,
        spans=spans,
    )
    scheduler.tables.row_pages = runner.pages.row_pages
    scheduler.tables.prefill_pages = runner.pages.prefill_pages
    disk = disk_tier(cfg, scheduler, runner, geometry, path, group is not None, codec)
    mx.eval(mx.zeros(1))
    blas = blas_in_use()
    log.info(
        "engine ready: %s, pool %d blocks x %d slots (%d bytes each, %.1f MiB), KV %s in "
        "layout %s, ragged attention %s, softmax %s, prefill attention %s%s, prefix caching "
        "%s, BLAS %s",
        name,
        n_blocks,
        cfg.block_size,
        per_block,
        n_blocks * per_block / 2**20,
        codec.name
        + (f" (group {codec.group_size})" if codec.quantized else "")
        + (f", also {', '.join(formats.names[1:])} on request" if formats.mixed else "")
        + (
            f", newest {cfg.kv_recent_tokens} tokens in full precision"
            if cfg.kv_recent_tokens
            else ""
        ),
        layout
        + (" (fused attention)" if fused or kernel else "")
        + (", decode steps compiled" if runner.compiled and runner.compiled.serves(kv) else ""),
        ragged.label,
        "exp2" if ragged.exp2 else "exp",
        {None: "sdpa", "buckets": "buckets"}.get(ragged.prefill_route, "matmul"),
        (
            (" on a stream of its own" + (", rows joining when it is done" if joins else ""))
            if own_stream
            else ""
        )
        + (
            ""
            if not runner.prefills.split
            else f", a chunk in {parts} parts beside decoding"
            if parts
            else ", a chunk in parts beside decoding (as many as keep a step within 2x)"
        ),
        "on" if cfg.prefix_caching else "off",
        blas,
    )
    device = str(mx.default_device())
    return Runtime(
        model,
        tokenizer,
        name,
        geometry,
        pool,
        scheduler,
        runner,
        per_block,
        blas,
        device,
        vocab_size,
        path,
        group,
        disk,
        formats.names,
    )
