"""Tiny random-weight mlx_lm models built in memory: nothing downloads."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

ARCHS = ("llama", "qwen2", "qwen3", "llama_sliding")


def tiny_model(arch: str = "llama", *, seed: int = 0, layers: int = 2, vocab: int = 128) -> Any:
    """A 2-layer, 64-wide model of ``arch`` with seeded random weights."""
    mx.random.seed(seed)
    common: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
    }
    if arch in ("llama", "llama_sliding"):
        from mlx_lm.models import llama as module

        extra: dict[str, Any] = {}
        if arch == "llama_sliding":
            extra = {
                "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
                "sliding_window": 8,
            }
        args = module.ModelArgs(model_type="llama", **common, **extra)
    elif arch == "qwen2":
        from mlx_lm.models import qwen2 as module

        args = module.ModelArgs(model_type="qwen2", **common)
    elif arch == "qwen3":
        from mlx_lm.models import qwen3 as module

        args = module.ModelArgs(
            model_type="qwen3",
            head_dim=16,
            max_position_embeddings=512,
            rope_theta=10000.0,
            **common,
        )
    else:
        raise ValueError(f"unknown arch {arch!r}")
    model = module.Model(args)
    mx.eval(model.parameters())
    return model
