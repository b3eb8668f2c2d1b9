"""The error table in docs/api.md against the codes the server answers with."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from veloxquant_mlx.server.errors import ERROR_CODES

ROOT = Path(__file__).resolve().parents[2]


def documented() -> dict[str, set[int]]:
    """{code: statuses} from the table's rows (``| 404 | `a`, `b` | when |``)."""
    table: dict[str, set[int]] = {}
    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"\d{3}( / \d{3})*", cells[0]):
            continue
        statuses = {int(s) for s in cells[0].split(" / ")}
        for code in re.findall(r"`([a-z_]+)`", cells[1]):
            table.setdefault(code, set()).update(statuses)
    return table


def used_in_source() -> set[str]:
    """The codes the server's source passes where an error is made: ``code="..."``, and the
    third argument of the raw senders (``error_body``, ``send_error``, ``_reject``)."""
    codes: set[str] = set()
    for path in (ROOT / "veloxquant_mlx" / "server").glob("*.py"):
        text = path.read_text()
        codes.update(re.findall(r'\bcode="([a-z_]+)"', text))
        codes.update(re.findall(r'message, code = [^\n]*, "([a-z_]+)"\n', text))
        for call in re.finditer(r"\b(?:error_body|send_error|_reject)\(", text):
            codes.update(re.findall(r'"([a-z]+(?:_[a-z]+)+)"', arguments(text, call.end())))
    return codes


def arguments(text: str, start: int) -> str:
    """The text of a call's arguments from ``start`` (after its parenthesis) to the one that
    closes it; parentheses inside string literals do not count."""
    depth, quote, i = 1, "", start
    while depth and i < len(text):
        ch = text[i]
        if quote:
            quote = "" if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        i += 1
    return text[start:i]


def test_the_documented_table_is_the_code_registry():
    table = documented()
    assert set(table) == set(ERROR_CODES), set(table) ^ set(ERROR_CODES)
    for code, statuses in ERROR_CODES.items():
        assert set(statuses) == table[code], code


def test_every_code_the_source_answers_with_is_registered():
    used = used_in_source()
    assert {"invalid_value", "not_found", "too_many_connections", "invalid_api_key"} <= used
    assert used <= set(ERROR_CODES), used - set(ERROR_CODES)


@pytest.mark.anyio
async def test_ollama_paths_and_embeddings_say_what_to_use_instead(client):
    for method, path, words in (
        ("POST", "/api/chat", "Ollama's API is not served"),
        ("GET", "/api/tags", "Ollama's API is not served"),
        ("POST", "/v1/embeddings", "embeddings are not served"),
        ("GET", "/v1/nothing", "no such endpoint"),
    ):
        r = await client.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 404, (path, r.text)
        assert words in r.json()["error"]["message"] and r.json()["error"]["code"] == "not_found"
