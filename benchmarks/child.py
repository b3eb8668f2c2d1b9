"""Run a benchmark's measuring half in a child process with a given library preload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from veloxquant_mlx import blas


def run_child(module: str, args: list[str], preload: str | None) -> Any:
    """``python -m module *args`` with ``preload`` (or nothing) as LD_PRELOAD; its last stdout
    line, parsed as JSON. The preload is marked active so the child does not choose again."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.ACTIVE_ENV)}
    if preload:
        env["LD_PRELOAD"] = preload
        env[blas.ACTIVE_ENV] = preload
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])
