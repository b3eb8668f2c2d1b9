"""Settings: MLX's environment settings (``--cuda-graph-ops``, ``--cuda-graph-cache``) are set
before the engine loads, never over the operator's own environment; every setting is a flag
docs/configuration.md documents."""

from __future__ import annotations

from pathlib import Path

import pytest

from veloxquant_mlx.config import mlx_env
from veloxquant_mlx.config.settings import Settings, SettingsError, load_settings


def test_set_values_go_to_mlx_variables_and_the_environment_wins():
    env = {"MLX_CUDA_GRAPH_CACHE_SIZE": "50"}
    applied = mlx_env.apply({"cuda_graph_ops": 100, "cuda_graph_cache": 2000}, env)
    assert applied == {"MLX_MAX_OPS_PER_BUFFER": "100"}
    assert env == {"MLX_MAX_OPS_PER_BUFFER": "100", "MLX_CUDA_GRAPH_CACHE_SIZE": "50"}
    assert mlx_env.apply({"cuda_graph_ops": None, "cuda_graph_cache": None}, {}) == {}
    assert mlx_env.apply({"cuda_sdpa_cache": 1024}, {}) == {"MLX_CUDA_SDPA_CACHE_SIZE": "1024"}
    assert load_settings([]).cuda_sdpa_cache == 1024  # cuDNN's graphs of bucketed prefills


def test_mlx_cuda_caches_lifetime_fuse_is_off_unless_asked_for():
    """MLX's CUDA caches throw on every new shape once a process has missed more than twice
    their capacity: a long-running server would start failing requests. Off by default, on
    with the flag, and an operator's own environment wins either way."""
    defaults = load_settings([])
    values = {name: getattr(defaults, name) for name in mlx_env.VARIABLES}
    env: dict[str, str] = {}
    assert mlx_env.apply(values, env)["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"
    on = load_settings(["--cuda-thrashing-check"])
    assert mlx_env.apply({"cuda_thrashing_check": on.cuda_thrashing_check}, {}) == {
        "MLX_ENABLE_CACHE_THRASHING_CHECK": "1"
    }
    kept = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    assert mlx_env.apply(values, kept).get("MLX_ENABLE_CACHE_THRASHING_CHECK") is None
    assert kept["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "1"


def test_the_flags_parse_and_are_bounded():
    s = load_settings(["--cuda-graph-ops", "100", "--cuda-graph-cache", "2000"])
    assert (s.cuda_graph_ops, s.cuda_graph_cache) == (100, 2000)
    with pytest.raises(SettingsError):
        load_settings(["--cuda-graph-ops", "300"])  # MLX takes fewer than 255


def test_every_setting_is_documented_as_a_flag():
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    missing = [n for n in Settings.model_fields if f"`--{n.replace('_', '-')}" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}"
