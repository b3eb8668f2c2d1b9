"""The Vercel AI SDK (Node) with tools and ``Output.object`` against the embedded model, from
``tests/compat/node/ai_sdk.mjs``: run when ``node`` and ``npm`` are present (its packages are
installed there once, from the lock file). The random-weight model sampled at temperature 1 may
call the tool at every step, so the script tries a few seeds; one must end in the object."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import MODEL

NODE_DIR = Path(__file__).resolve().parent / "node"


@pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")), reason="no node/npm")
def test_ai_sdk_tools_with_an_output_object(server):
    if not (NODE_DIR / "node_modules" / "ai").exists():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--silent"],
            cwd=NODE_DIR, check=True, timeout=600,
        )  # fmt: skip
    run = subprocess.run(
        ["node", "ai_sdk.mjs", server.base_url, MODEL],
        cwd=NODE_DIR, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert '"output"' in run.stdout
