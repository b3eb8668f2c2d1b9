"""Third-party clients against real servers (`make compat`, its own virtualenv and extra)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map

from tests.e2e.conftest import (
    TOOL_TEMPLATE,
    Server,
    server,  # noqa: F401  (a fixture)
    start_server,
    stop_server,
    tool_server,  # noqa: F401  (a fixture)
)


@pytest.fixture(scope="module")
def long_server(tmp_path_factory, default_model_dir) -> Iterator[Server]:
    """The embedded model (served as ``agent-tiny``, any model name accepted) with the tool
    template and a context that holds an agent CLI's prompt (its 2,048-token vocabulary makes
    Codex's ~24k tokens); a stream starts with keep-alives after 2 s, so the agents read
    through them while their cold prompt prefills."""
    model = tmp_path_factory.mktemp("agent-model") / "agent-tiny"
    shutil.copytree(default_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 65536
    (model / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = TOOL_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(
        tmp_path_factory.mktemp("agent"), "--model", str(model), "--model-aliases", "*",
        "--default-max-tokens", "8", "--kv-cache-mb", "1024", "--stream-keepalive", "2",
    )  # fmt: skip
    yield srv
    srv.wait_pool_free()
    assert stop_server(srv) == 0, srv.log()


def npm_installed(package_dir: Path, binary: str) -> Path:
    """The ``node_modules/.bin/binary`` of ``package_dir``, installed there the first time:
    from its lock file (``npm ci``), or without one where the package pins its platform
    binaries as optional dependencies (OpenCode's), which npm's lock file records only for
    the platform that wrote it."""
    path = package_dir / "node_modules" / ".bin" / binary
    if not path.exists():
        locked = (package_dir / "package-lock.json").exists()
        command = ["ci"] if locked else ["install", "--no-package-lock"]
        subprocess.run(
            ["npm", *command, "--no-audit", "--no-fund", "--silent"],
            cwd=package_dir, check=True, timeout=600,
        )  # fmt: skip
    return path


def access_lines(srv: Server, route: str) -> list[dict[str, int | str]]:
    """``srv``'s access-log lines for ``POST route``, in order: each line's ``prompt`` and
    ``cached`` token counts, and the line itself."""
    out: list[dict[str, int | str]] = []
    for line in srv.log().splitlines():
        if f"POST {route} " not in line:
            continue
        fields = {k: int(re.search(f" {k}=(\\d+)", line).group(1))  # type: ignore[union-attr]
                  for k in ("prompt", "cached")}  # fmt: skip
        out.append({**fields, "line": line})
    return out
