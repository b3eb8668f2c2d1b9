"""``--mlx-cache-limit-mb``: how much freed memory MLX keeps for reuse, set by the engine at
load (on CUDA a bound by default: MLX's own let a long-running server run out of device
memory); the snapshot carries MLX's memory figures for ``/metrics``."""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.model.choices import CUDA_CACHE_LIMIT_MB, mlx_cache_limit
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams
from veloxquant_mlx.kv import attention


def test_the_limit_is_the_setting_else_a_bound_on_cuda_only():
    assert mlx_cache_limit(EngineConfig(mlx_cache_limit_mb=64)) == 64 * 2**20
    assert mlx_cache_limit(EngineConfig(mlx_cache_limit_mb=0)) == 0
    on_cuda = mx.default_device() != mx.cpu and attention.cuda_available()
    expected = CUDA_CACHE_LIMIT_MB * 2**20 if on_cuda else None
    assert mlx_cache_limit(EngineConfig()) == expected


def test_the_engine_sets_the_limit_and_reports_mlx_memory(make_engine):
    previous = mx.set_cache_limit(2**40)  # what the engine's load sets is read back below
    try:
        engine = make_engine(kv_cache_mb=32, mlx_cache_limit_mb=48)
        assert mx.set_cache_limit(2**40) == 48 * 2**20
        tokens, _ = engine.submit(
            GenerationRequest((5, 6, 7, 8), 4, SamplingParams(temperature=0.0))
        ).collect(60)
        assert len(tokens) == 4
        memory = dict(engine.stats().mlx_memory)
        assert memory["active"] > 0 and memory["peak"] >= memory["active"]
        assert memory["cache"] >= 0
    finally:
        mx.set_cache_limit(previous)
