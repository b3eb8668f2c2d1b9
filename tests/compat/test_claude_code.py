"""Anthropic's Claude Code CLI (``claude -p``, from ``tests/compat/claude``) against the
server's Messages API: run when ``node`` and ``npm`` are present (installed there once, from
the lock file). Claude Code sends what no SDK test does: its own system prompt and tool
definitions (two of its tools here, to keep the cold prefill short on a CPU), a ``system``
message after the first user message, ``thinking``, ``cache_control`` and ``metadata`` fields,
and the whole conversation every request. The random-weight model never ends its answer, so
answers are held to 16 tokens (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``), which Claude Code reports
as the only error; what is checked is that every request is served, that the session's later
requests are read from the prefix cache, and that the first request's slow prefill is read
through the stream's keep-alives. The model is named on both invocations: left to its default,
Claude Code's first run names a 1M-context variant in its system prompt and its ``--continue``
run does not, so the two prompts part after ~800 tokens (its choice, not the cache's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.compat.conftest import access_lines, npm_installed
from tests.e2e.conftest import Server

CLAUDE_DIR = Path(__file__).resolve().parent / "claude"
pytestmark = pytest.mark.skipif(
    not (shutil.which("node") and shutil.which("npm")), reason="no node/npm"
)
CUT = "exceeded the 16 output token maximum"


def claude(server: Server, home: Path, *args: str) -> dict:
    run = subprocess.run(
        [str(CLAUDE_DIR / "node_modules" / ".bin" / "claude"), "-p", *args,
         "--model", "claude-opus-4-8", "--tools", "Bash,Read", "--output-format", "json"],
        cwd=home, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
        env={**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": server.base_url,
             "ANTHROPIC_API_KEY": "x", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
             "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16", "DISABLE_AUTOUPDATER": "1"},
    )  # fmt: skip
    assert run.stdout.strip().startswith("{"), run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def requests(server: Server) -> list[dict[str, int | str]]:
    return access_lines(server, "/v1/messages")


def test_claude_code_turns_over_the_messages_api(long_server, tmp_path):
    npm_installed(CLAUDE_DIR, "claude")
    first = claude(long_server, tmp_path, "say hi")
    turn_one = requests(long_server)
    second = claude(long_server, tmp_path, "--continue", "again")
    turn_two = requests(long_server)[len(turn_one) :]
    for result in (first, second):  # answered; cut where the client's limit cut it, no more
        assert result["type"] == "result" and result["num_turns"] >= 1, result
        assert not result["is_error"] or CUT in result["result"], result
    assert turn_one and turn_two
    for r in turn_one + turn_two:  # every request served (a 400 was how a late system died)
        assert " 200 " in str(r["line"]), r["line"]
    assert int(turn_one[0]["prompt"]) > 5_000  # Claude Code's own prompt and tools
    for r in turn_one[1:] + turn_two:  # the session's later requests: its prefix cached
        assert int(r["cached"]) >= 0.9 * int(r["prompt"]), r["line"]
