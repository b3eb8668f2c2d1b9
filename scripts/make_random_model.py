"""Make a ~100M-parameter random-weight Llama (with the shipped tokenizer) for benchmarks.

    python scripts/make_random_model.py DIR

A model directory ``mlx_lm.load`` and ``veloxquant-serve --model DIR`` accept; float32 weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, for benchmarks/

from benchmarks.models import LARGE_CONFIG
from veloxquant_mlx.engine.model.default_model import write_model


def main() -> None:
    target = Path(sys.argv[1])
    if (target / "model.safetensors").exists():
        print(f"{target}: already there")
        return
    target.mkdir(parents=True, exist_ok=True)
    write_model(target, LARGE_CONFIG, seed=100)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
