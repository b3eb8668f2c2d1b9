"""Make a ~100M-parameter random-weight Llama (with the shipped tokenizer) for benchmarks.

    python scripts/make_random_model.py DIR

A model directory ``mlx_lm.load`` and ``veloxquant-serve --model DIR`` accept; float32 weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

from veloxquant_mlx.engine.default_model import write_model

CONFIG_100M = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 2048,
}


def main() -> None:
    target = Path(sys.argv[1])
    if (target / "model.safetensors").exists():
        print(f"{target}: already there")
        return
    target.mkdir(parents=True, exist_ok=True)
    write_model(target, CONFIG_100M, seed=100)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
