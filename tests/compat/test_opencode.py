"""The OpenCode CLI (``opencode run``, from ``tests/compat/opencode``) against the server's chat
completions, as an ``@ai-sdk/openai-compatible`` provider in its ``opencode.json``: run when
``node`` and ``npm`` are present (installed there once, from the lock file). OpenCode sends its
own ~19k-token prompt (its build agent's instructions and a dozen tools), a separate title
request, streaming with ``stream_options.include_usage``, and the whole session every turn.
The random-weight model never ends its answer, so each turn stops at the server's
``--default-max-tokens`` (``reason: length``); what is checked is that the answer arrived, that
the ``--continue``d turn is read from the prefix cache, and that OpenCode itself reads the
cached tokens from the usage the server sent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.compat.conftest import access_lines, npm_installed
from tests.e2e.conftest import Server

OPENCODE_DIR = Path(__file__).resolve().parent / "opencode"
pytestmark = pytest.mark.skipif(
    not (shutil.which("node") and shutil.which("npm")), reason="no node/npm"
)


def write_config(server: Server, project: Path) -> None:
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "veloxquant",
        "options": {"baseURL": f"{server.base_url}/v1", "apiKey": "x"},
        "models": {"agent-tiny": {"name": "agent-tiny", "limit": {"context": 65536, "output": 8}}},
    }
    config = {"provider": {"vq": provider}, "model": "vq/agent-tiny", "autoupdate": False,
              "share": "disabled"}  # fmt: skip
    (project / "opencode.json").write_text(json.dumps(config))


def opencode(project: Path, home: Path, *args: str) -> list[dict]:
    run = subprocess.run(
        [
            str(OPENCODE_DIR / "node_modules" / ".bin" / "opencode"),
            "run",
            "--pure",
            "--format",
            "json",
            *args,
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
        env={
            **os.environ,
            "PWD": str(project),
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
        },
    )  # fmt: skip  (OpenCode takes its project from $PWD, not from its working directory)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and events, run.stdout[-2000:] + run.stderr[-2000:]
    return events


def test_opencode_turns_over_chat_completions(long_server, tmp_path):
    npm_installed(OPENCODE_DIR, "opencode")
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    write_config(long_server, project)
    seen = 0
    for turn, args in enumerate((["say hi"], ["--continue", "again"])):
        events = opencode(project, home, *args)
        texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
        finishes = [e["part"] for e in events if e.get("type") == "step_finish"]
        errors = [e for e in events if e.get("type") == "error"]
        assert texts and texts[-1] and not errors, events  # the answer arrived
        assert finishes and finishes[-1]["reason"] == "length", finishes
        served = access_lines(long_server, "/v1/chat/completions")[seen:]
        seen += len(served)
        assert served and all(" 200 " in r["line"] for r in served), served
        main = max(served, key=lambda r: r["prompt"])  # the turn, not the title request
        assert int(main["prompt"]) > 10_000, main  # OpenCode's own prompt and tools
        if turn:  # the continued turn is the first one's prompt and answer, cached
            assert int(main["cached"]) >= int(main["prompt"]) - 64, main["line"]
            # and OpenCode read them from the usage the server sent
            assert finishes[-1]["tokens"]["cache"]["read"] == main["cached"], finishes[-1]
