"""Where the server keeps what it makes on first use (the embedded model, the gemv forwarder)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME`` (or ``~/.cache``)/veloxquant-mlx."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "veloxquant-mlx"
