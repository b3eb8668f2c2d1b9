"""Shared fixtures. Every pool made through ``make_pool`` is checked all free after its test."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from veloxquant_mlx.blas import ensure_blas
from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig

# The third-party client suite needs its own virtualenv (`make compat`, the "compat" extra).
collect_ignore = [] if os.environ.get("VQ_COMPAT") else ["compat"]


def pytest_configure(config: pytest.Config) -> None:
    """Re-execute pytest once with an optimized BLAS and the gemv forwarder preloaded.

    VQ_BLAS=off: the bundled BLAS; VQ_BLAS_GEMV=1: the gemv forwarder too (opt-in, as in the
    server).

    Output capture is stopped first, so the re-executed run writes to the real terminal.
    """
    if os.environ.get("VQ_BLAS_ACTIVE") or os.environ.get("VQ_BLAS") == "off":
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()
    gemv = os.environ.get("VQ_BLAS_GEMV", "false").lower() in ("1", "true", "yes", "on")
    ensure_blas(os.environ.get("VQ_BLAS", "auto"), gemv=gemv)
    if capture is not None:  # not re-executed: nothing better found; carry on as we are
        capture.start_global_capturing()


def assert_pool_all_free(pool: BlockPoolAllocator) -> None:
    pool.check_invariants()
    stats = pool.stats
    assert stats.blocks_in_use() == 0, f"{stats.blocks_in_use()} blocks still in use"
    assert pool.owner_block_counts() == {}, f"owners left: {pool.owner_block_counts()}"


def assert_engine_all_free(engine) -> None:
    """An idle engine holds nothing for a request; once its prefix cache drops the pages no
    request holds, the pool is all free (a page a finished request still referenced would
    stay: a leak). On a stopped engine, the pool alone."""
    if engine.alive:
        stats = engine.stats()
        assert stats.blocks_in_use == 0, f"{stats.blocks_in_use} blocks still held: {stats}"
        engine.reset_prefix_cache()
    if engine.pool is not None:
        assert_pool_all_free(engine.pool)
        return
    # the engine runs in its own process: its pool is seen through the view it sends
    pool = engine.view().pool
    assert pool is not None, "no pool view from the engine process"
    assert pool.stats.blocks_in_use() == 0, f"{pool.stats.blocks_in_use()} blocks still in use"
    assert pool.owners == {}, f"owners left: {pool.owners}"


@pytest.fixture
def make_pool() -> Iterator[Callable[..., BlockPoolAllocator]]:
    """A factory of pools that are checked all free (no block, no owner) at teardown."""
    pools: list[BlockPoolAllocator] = []

    def make(**config) -> BlockPoolAllocator:
        pool = BlockPoolAllocator(PoolConfig(**config))
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        assert_pool_all_free(pool)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The embedded default model, made once per session in a temporary cache directory."""
    from veloxquant_mlx.engine.model.default_model import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    import mlx_lm

    return mlx_lm.load(str(default_model_dir))
