"""The embedded default model: a tiny random-weight Llama made deterministically on first use.

Nothing is downloaded: the tokenizer and chat template ship in ``engine/model/assets`` (built by
``scripts/build_tokenizer.py``), and the weights come from MLX's seeded generator. The result is
an ordinary mlx_lm model directory, loaded with ``mlx_lm.load`` like any other.
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
from pathlib import Path

from veloxquant_mlx.config.paths import default_cache_dir

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Bump when the architecture or the recipe changes: a new directory is made beside the old one.
VERSION = "v3"
SEED = 20261129
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 688,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "vocab_size": 2048,
    # room for what agent frameworks send (a tools prompt, a Claude Code request's system)
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # float32: on a CPU, MLX's fp16 matmuls skip BLAS and run 10-50x slower (BENCHMARKS.md)
    "torch_dtype": "float32",
}
NAME = "veloxquant-tiny-llama"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The default model's directory, made on first call (atomically: a crash leaves no half).

    Args:
        cache_dir: Parent directory; ``default_cache_dir()`` when None.

    Returns:
        A directory ``mlx_lm.load`` accepts: config.json, model.safetensors, tokenizer files.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"{NAME}-{VERSION}"
    if (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=root))
    try:
        _write_model(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():  # lost a race only if it exists
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_model(directory: Path, config: dict | None = None, seed: int = SEED) -> None:
    """Write a random-weight model (``CONFIG`` updated with ``config``: a Llama unless its
    ``model_type`` names another mlx_lm architecture) into ``directory``."""
    _write_model(directory, {**CONFIG, **(config or {})}, seed)


def _write_model(directory: Path, config: dict = CONFIG, seed: int = SEED) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    args = module.ModelArgs.from_dict(config)
    model = module.Model(args)
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = {name: value.astype(mx.float32) for name, value in flat}
    mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / name, directory / name)
