"""OpenAI's Codex CLI (``codex exec``, from ``tests/compat/codex``) against the server's
Responses API: run when ``node`` and ``npm`` are present (installed there once, from the lock
file). Codex sends what no SDK test does: its ~24k-token prompt, function, custom and namespace
tools, ``web_search`` (left out here), ``store: false`` and the whole history every turn. The
random-weight model never ends its answer, so each turn stops at the server's
``--default-max-tokens`` and Codex reports it incomplete (as it would OpenAI's); what is
checked is that the answer arrived and that the next turn (``exec resume``) is read from the
prefix cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.compat.conftest import access_lines, npm_installed
from tests.e2e.conftest import Server

CODEX_DIR = Path(__file__).resolve().parent / "codex"
pytestmark = pytest.mark.skipif(
    not (shutil.which("node") and shutil.which("npm")), reason="no node/npm"
)


def codex(server: Server, home: Path, *args: str) -> list[dict]:
    provider = (f'model_providers.vq={{name="vq",base_url="{server.base_url}/v1",'
                'wire_api="responses",env_key="VQ_TEST_KEY"}')  # fmt: skip
    run = subprocess.run(
        [str(CODEX_DIR / "node_modules" / ".bin" / "codex"), "exec", "--json",
         "--skip-git-repo-check", "-c", "model_provider=vq", "-c", provider,
         "-m", "agent-tiny", *args],
        cwd=home, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        env={**os.environ, "CODEX_HOME": str(home), "VQ_TEST_KEY": "x"},
    )  # fmt: skip
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert events, run.stdout[-2000:] + run.stderr[-2000:]
    return events


def test_codex_turns_over_the_responses_api(long_server, tmp_path):
    npm_installed(CODEX_DIR, "codex")
    for turn, args in enumerate((["say hi"], ["resume", "--last", "again"])):
        events = codex(long_server, tmp_path, *args)
        messages = [e["item"]["text"] for e in events
                    if e.get("type") == "item.completed"
                    and e["item"].get("type") == "agent_message"]  # fmt: skip
        failures = [json.dumps(e) for e in events if e.get("type") in ("turn.failed", "error")]
        assert messages and messages[-1], events  # the answer arrived
        # and it ended where the server's --default-max-tokens cut it, nowhere else
        assert all("max_output_tokens" in f for f in failures), failures
        served = access_lines(long_server, "/v1/responses")
        assert len(served) == turn + 1 and " 200 " in str(served[-1]["line"]), served
        prompt, cached = int(served[-1]["prompt"]), int(served[-1]["cached"])
        assert prompt > 10_000  # Codex's own prompt, its tools and the turn
        if turn:  # the resumed turn is the first one's prompt and answer, cached
            assert cached >= prompt - 64, served[-1]["line"]
    assert "tools of types web_search left out" in long_server.log()
