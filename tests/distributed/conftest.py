"""Models for the group tests: the default tiny Llama (tensor parallel) and a 3-layer Qwen2
(pipeline parallel, split unevenly: 2 layers on rank 0, 1 on rank 1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from veloxquant_mlx.engine.model.default_model import write_model


@pytest.fixture(scope="session")
def model_cache(default_model_dir) -> str:
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    return str(default_model_dir.parent)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2") / "tiny-qwen2"
    path.mkdir()
    write_model(
        path,
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3},
        seed=7,
    )
    return path
