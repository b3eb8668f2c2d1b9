"""An engine on the embedded default model; every test must leave its pool all free."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from tests.conftest import assert_engine_all_free, assert_pool_all_free
from veloxquant_mlx.engine.hosts.thread import Engine, EngineConfig


def refused_at_start(
    config: EngineConfig, match: str, error: type[BaseException] = Exception
) -> BaseException:
    """An engine of ``config`` fails to load with ``error`` saying ``match``; it is shut down
    either way. Returns the error."""
    engine = Engine(config).start()
    try:
        with pytest.raises(error, match=match) as info:
            engine.wait_ready(120)
    finally:
        engine.shutdown(5)
    return info.value


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


@pytest.fixture
def make_engine(default_model_dir) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(**overrides) -> Engine:
        step_hook = overrides.pop("step_hook", None)
        config = EngineConfig(model_cache_dir=str(default_model_dir.parent), **overrides)
        engine = Engine(config, step_hook=step_hook).start()
        engine.wait_ready(120)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        if engine.alive:
            wait_idle(engine)
            assert_engine_all_free(engine)
        engine.shutdown(5)
        assert not engine.alive
        assert_pool_all_free(engine.pool)


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(kv_cache_mb=32)
