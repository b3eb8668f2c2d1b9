"""A model's tokenizer alone, as ``mlx_lm.load`` makes it: what a host needs on its side (the
routes template and tokenize there) without the weights, the KV path or the engine loop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def load_tokenizer(path: Path, chat_template: str | None = None) -> Any:
    """The model's tokenizer alone, as ``mlx_lm.load`` makes it (no weights, no MLX arrays):
    what the server process needs when the engine runs in a process of its own.
    ``chat_template``: a Jinja template to use instead of the model's."""
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    config = load_config(path)
    return unbounded(
        mlx_lm_load_tokenizer(
            path,
            tokenizer_config_extra=template_config(chat_template),
            eos_token_ids=config.get("eos_token_id", None),
        )
    )


def template_config(chat_template: str | None) -> dict[str, Any]:
    """The tokenizer options that put ``chat_template`` in place of the model's (mlx_lm then
    infers the tool-call format from it, as from a model's own)."""
    return {} if chat_template is None else {"chat_template": chat_template}


def unbounded(tokenizer: Any) -> Any:
    """``tokenizer`` with no length of its own. The engine checks the context itself and
    answers 400 (checks.py). Otherwise transformers logs "... will result in indexing errors"
    for a long prompt. The server refuses that prompt, so the warning would only mislead."""
    hf: Any = getattr(tokenizer, "_tokenizer", None)
    if hasattr(hf, "model_max_length"):
        hf.model_max_length = sys.maxsize
    return tokenizer
