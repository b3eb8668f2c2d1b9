"""The FastAPI application: wiring only (lifespan, middleware, error mapping, routers)."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI

from veloxquant_mlx import __version__
from veloxquant_mlx.config import Settings
from veloxquant_mlx.config.launch import launched_rank
from veloxquant_mlx.engine.client import EngineClient, start_engine
from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.server import (
    errors,
    routes_chat,
    routes_messages,
    routes_openai,
    routes_ops,
    routes_responses,
    routes_scale,
)
from veloxquant_mlx.server.access_log import AccessLog
from veloxquant_mlx.server.answers import AnswerTokens
from veloxquant_mlx.server.deps import AppState
from veloxquant_mlx.server.metrics import Metrics
from veloxquant_mlx.server.middleware import AuthGate, BodyGuard, CORSExceptAdmin, RequestId
from veloxquant_mlx.server.registration import Registration
from veloxquant_mlx.server.response_store import ResponseStore

log = logging.getLogger("veloxquant.server")


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        model=settings.model,
        model_cache_dir=settings.model_cache_dir,
        dtype=settings.dtype,
        block_size=settings.block_size,
        kv_cache_mb=settings.kv_cache_mb,
        n_blocks=settings.n_blocks,
        separate_kv=settings.separate_kv,
        grow_on_exhaustion=settings.grow_on_exhaustion,
        max_blocks=settings.max_blocks,
        max_running=settings.max_running,
        max_queue=settings.max_queue,
        prefill_step=settings.prefill_step,
        prefill_budget=settings.prefill_budget,
        idle_prefill_budget=settings.idle_prefill_budget,
        prefill_stall_ratio=settings.prefill_stall_ratio,
        warm_up=settings.warm_up,
        warm_up_context=settings.warm_up_context,
        kv_layout=settings.kv_layout,
        kv_format=settings.kv_format,
        kv_formats=settings.kv_format_list,
        kv_group_size=settings.kv_group_size,
        kv_recent_tokens=settings.kv_recent_tokens,
        ragged_attention=settings.ragged_attention,
        attention_softmax=settings.attention_softmax,
        prefill_attention=settings.prefill_attention,
        sampling_cut=settings.sampling_cut,
        prefill_bucket=settings.prefill_bucket,
        prefill_stream=settings.prefill_stream,
        mlx_cache_limit_mb=settings.mlx_cache_limit_mb,
        prefill_join=settings.prefill_join,
        prefill_parts=settings.prefill_parts,
        fused_projections=settings.fused_projections,
        compiled_step=settings.compiled_step,
        paged_attention=settings.paged_attention,
        quantized_attention=settings.quantized_attention,
        prefix_caching=settings.prefix_caching,
        prefix_cache_answers=settings.prefix_cache_answers,
        prefix_cache_dir=settings.prefix_cache_dir,
        prefix_cache_disk_gb=settings.prefix_cache_disk_gb,
        prefix_cache_preload_gb=settings.prefix_cache_preload_gb,
        stream_interval=settings.stream_interval_ms / 1000,
        # at least a one-token prompt and one block of completion (or the default max_tokens)
        min_request_tokens=1 + (settings.default_max_tokens or settings.block_size),
        distributed=launched_rank() is not None,
        pipeline=settings.pipeline,
        group_timeout=settings.group_timeout,
        chat_template=settings.chat_template,
    )


def start_engine_for(settings: Settings) -> EngineClient:
    """The engine ``settings`` ask for, loading (in its own process unless
    ``--no-engine-process``)."""
    return start_engine(
        engine_config(settings),
        own_process=settings.engine_process,
        log_format=settings.log_format,
        log_level=settings.log_level,
        switch_interval=(
            None
            if settings.gil_switch_interval_ms is None
            else settings.gil_switch_interval_ms / 1000
        ),
    )


def create_app(
    settings: Settings,
    engine: EngineClient | None = None,
    on_engine_failure: Callable[[], None] | None = None,
) -> FastAPI:
    """The app for ``settings``. The lifespan starts the engine (or adopts ``engine``, already
    started, for tests) and shuts it down with ``settings.drain_timeout``.

    ``on_engine_failure`` is called (on the event loop) once if the engine thread dies while
    serving: the CLI makes the process exit non-zero, for its supervisor to restart it.
    """
    settings, generated = settings.with_admin_key()
    if generated:
        log.warning("no admin key set; generated one for this process: %s", settings.admin_key)

    async def watch(eng: EngineClient) -> None:
        while eng.alive or eng.draining:
            if not eng.alive:
                return  # drained and stopped on purpose
            await asyncio.sleep(0.25)
        host = "process" if settings.engine_process else "thread"
        log.critical("the engine %s has died; in-flight requests were failed; exiting", host)
        if on_engine_failure is not None:
            on_engine_failure()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = engine is None
        eng = start_engine_for(settings) if own else engine
        assert eng is not None
        await asyncio.to_thread(eng.wait_ready)
        name = settings.served_model_name or eng.model_name
        metrics = Metrics(eng, name, settings.metrics_compat)
        app.state.vq = AppState(
            settings,
            eng,
            metrics,
            name,
            answers=AnswerTokens(settings.resent_answers, metrics.resent_answers.inc),
            responses=ResponseStore(settings.responses_store),
        )
        disk_dir = eng.info.disk_dir if eng.info is not None else None
        vocab = eng.vocab_size
        if disk_dir is not None:
            n = await asyncio.to_thread(app.state.vq.answers.load, disk_dir, vocab)
            log.info("remembered answers: %d read from the prefix cache's directory", n)
        joining = None
        if settings.register_with:
            worker = settings.advertise_url or f"http://{settings.host}:{settings.port}"
            app.state.vq.registration = Registration(
                settings.register_with, worker, settings.api_key
            )
            joining = asyncio.create_task(app.state.vq.registration.register())
        pool = (await asyncio.to_thread(eng.view)).pool
        if pool is not None:
            log.info(
                "serving %s on the block pool (%d blocks of %d slots, streams %s)",
                name, pool.stats.n_blocks, pool.block_size, "/".join(pool.total),
            )  # fmt: skip
        # A streamed response's first task group imports anyio's asyncio backend: here, not
        # beside a fresh server's first request (there, contending with the engine's first
        # steps, it delayed that request's first token ~100 ms on a 2-core machine).
        async with anyio.create_task_group():
            pass
        # Every object made so far (the model, the tokenizer, the app) out of the cyclic
        # collector's way while the app serves (back at its end, for a process that makes
        # more apps): its first full collection, over all of them, made a fresh server's
        # second request 1.7-2x slower than the rest on this CPU (benchmarks.first_request).
        gc.collect()
        gc.freeze()
        watcher = asyncio.create_task(watch(eng))
        try:
            yield
        finally:
            watcher.cancel()
            app.state.vq.draining = True
            if joining is not None:
                joining.cancel()
                await asyncio.to_thread(app.state.vq.registration.deregister)
            if own:
                await asyncio.to_thread(eng.shutdown, settings.drain_timeout)
            if disk_dir is not None:
                n = await asyncio.to_thread(app.state.vq.answers.save, disk_dir, vocab)
                log.info("remembered answers: %d written to the prefix cache's directory", n)
            gc.unfreeze()

    app = FastAPI(
        title="veloxquant-mlx serve",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # the schema would list /admin to anyone, key or not
    )
    errors.install(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_chat.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_messages.router)
    app.include_router(routes_ops.router)
    app.include_router(routes_scale.router)
    app.include_router(routes_ops.admin)
    # Outermost last: request ids, CORS (so a 401 carries its headers), keys, the body.
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
    assert settings.admin_key is not None
    app.add_middleware(AuthGate, api_key=settings.api_key, admin_key=settings.admin_key)
    if settings.cors_origins:
        app.add_middleware(CORSExceptAdmin, origins=settings.cors_origins)
    app.add_middleware(RequestId)
    if settings.access_log:  # outermost: it sees the request id and every status
        app.add_middleware(AccessLog)
    return app
