import dataclasses

import pytest

from veloxquant_mlx.pool import PoolConfig


def test_defaults_are_the_seeds():
    cfg = PoolConfig()
    assert (cfg.block_size, cfg.n_blocks, cfg.separate_kv) == (16, 1024, True)
    assert (cfg.grow_on_exhaustion, cfg.max_blocks) == (False, None)
    assert [f.name for f in dataclasses.fields(cfg)] == [
        "block_size",
        "n_blocks",
        "separate_kv",
        "grow_on_exhaustion",
        "max_blocks",
    ]


def test_positional_construction_follows_the_seeds_order():
    cfg = PoolConfig(8, 32, False, True, 64)
    assert cfg == PoolConfig(
        block_size=8, n_blocks=32, separate_kv=False, grow_on_exhaustion=True, max_blocks=64
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": -1},
        {"block_size": 2.5},
        {"block_size": True},
        {"n_blocks": -1},
        {"n_blocks": "8"},
        {"max_blocks": -1},
        {"grow_on_exhaustion": True, "n_blocks": 10, "max_blocks": 5},
    ],
)
def test_bad_settings_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        PoolConfig(**kwargs)


def test_max_blocks_below_n_blocks_is_ignored_without_growth():
    assert PoolConfig(n_blocks=10, max_blocks=5).max_blocks == 5


def test_empty_pool_is_allowed():
    assert PoolConfig(n_blocks=0).n_blocks == 0
