"""Loading the model the engine serves (on the engine thread: MLX streams are thread-local)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx

from veloxquant_mlx.engine.default_model import NAME as DEFAULT_NAME
from veloxquant_mlx.engine.default_model import ensure_default_model

log = logging.getLogger("veloxquant.engine")


def load(model: str | None, cache_dir: str | None, dtype: str) -> tuple[Any, Any, str]:
    """(model, tokenizer, name) for a local path, or the embedded default model if None.

    ``dtype``: "auto" runs floating weights in float32 on a CPU (MLX's CPU fp16/bf16 matmuls do
    not use BLAS and are 10-50x slower) and keeps them as stored on a GPU; "model" keeps them as
    stored; "float32", "float16", "bfloat16" cast. Quantized weights stay quantized.

    Raises:
        FileNotFoundError: If ``model`` is not an existing directory (nothing is downloaded).
    """
    import mlx_lm

    if model is None:
        path = ensure_default_model(Path(cache_dir) if cache_dir else None)
        name = DEFAULT_NAME
    else:
        path = Path(model).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"model {model!r} is not a local directory (this server never downloads)"
            )
        name = path.name
    loaded = mlx_lm.load(str(path))
    net, tokenizer = loaded[0], loaded[1]
    target = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(dtype)
    if dtype == "auto" and mx.default_device() == mx.cpu:
        target = mx.float32
    if target is not None:
        net.set_dtype(target)
    log.info("loaded %s from %s (dtype %s)", name, path, dtype)
    return net, tokenizer, name
