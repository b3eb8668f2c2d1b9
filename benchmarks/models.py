"""Random-weight models for benchmarks, built in memory (nothing downloads)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from veloxquant_mlx.engine.model.default_model import CONFIG as DEFAULT_CONFIG

# ~58M parameters: the "larger random model" of the benchmarks.
MEDIUM_CONFIG = {
    **DEFAULT_CONFIG,
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 8192,
}
# ~105M parameters: also the model ``scripts/make_random_model.py`` writes (``make compare``).
LARGE_CONFIG = {
    **DEFAULT_CONFIG,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 2048,
}
CONFIGS = {"tiny": DEFAULT_CONFIG, "medium": MEDIUM_CONFIG, "100m": LARGE_CONFIG}


def build(name: str, seed: int = 0, dtype: Any = None) -> Any:
    """The model ``name`` ("tiny": the embedded default's shape, "medium": ~57M).

    float32 by default, like the embedded model: MLX's CPU backend runs fp16 matmuls without
    BLAS, 10-50x slower.
    """
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIGS[name]))
    model.set_dtype(mx.float32 if dtype is None else dtype)
    mx.eval(model.parameters())
    return model


def n_params(model: Any) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))
