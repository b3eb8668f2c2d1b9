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


def test_the_flags_parse_and_are_bounded():
    s = load_settings(["--cuda-graph-ops", "100", "--cuda-graph-cache", "2000"])
    assert (s.cuda_graph_ops, s.cuda_graph_cache) == (100, 2000)
    with pytest.raises(SettingsError):
        load_settings(["--cuda-graph-ops", "300"])  # MLX takes fewer than 255


def test_every_setting_is_documented_as_a_flag():
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    missing = [n for n in Settings.model_fields if f"`--{n.replace('_', '-')}" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}"
