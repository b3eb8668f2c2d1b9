"""A few seconds of real load from loadtest/: zero errors and the leak check must pass."""

from __future__ import annotations

import json

import pytest

from loadtest.__main__ import main
from loadtest.runner import check_loopback


def test_smoke_run_has_no_errors_and_no_leak(server, tmp_path):
    out = tmp_path / "result.json"
    rc = main([
        "--url", server.base_url, "--concurrency", "1,4", "--requests", "8",
        "--max-tokens", "8-24", "--prompt-words", "4-32", "--duration", "60",
        "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    results = json.loads(out.read_text())
    assert [r["ok"] for r in results] == [8, 8]
    for r in results:
        assert r["errors_by_status"] == {}
        assert r["output_tokens"] > 0 and r["ttft_s"]["p50"] > 0
        # the probe scrapes every second, so a short level may finish between two scrapes:
        # assert what the after-scrape always sees (the leak check), not the sampled peak
        assert r["server"]["leak_free"] is True and r["server"]["blocks_total"] > 0
    server.wait_pool_free()


def test_chat_and_non_streaming_modes(server, tmp_path):
    rc = main([
        "--url", server.base_url, "--concurrency", "2", "--requests", "4", "--api", "chat",
        "--no-stream", "--max-tokens", "4-8",
    ])  # fmt: skip
    assert rc == 0


def test_multi_turn_conversations_behind_a_shared_prompt_hit_the_prefix_cache(server, tmp_path):
    out = tmp_path / "turns.json"
    rc = main([
        "--url", server.base_url, "--concurrency", "2", "--requests", "8", "--turns", "4",
        "--shared-prefix-words", "120", "--max-tokens", "8-16", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    [r] = json.loads(out.read_text())
    assert r["ok"] == 8 and r["errors_by_status"] == {}
    # every turn after a conversation's first resends the system prompt and history
    assert 0.3 < r["prefix_hit_rate"] < 1 and r["cached_tokens"] % 16 == 0
    assert r["server"]["leak_free"] is True
    server.wait_pool_free()


def test_targets_off_this_machine_are_refused():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1")
    check_loopback("http://[::1]:8000")
    with pytest.raises(SystemExit):
        check_loopback("http://10.0.0.1:8000")
    with pytest.raises(SystemExit):
        check_loopback("http://example.com")


def test_ttft_after_ramp_up_leaves_out_the_first_burst():
    from loadtest.stats import Record, summarize

    # a closed loop of 2: the first two requests start together and wait 1 s for a first token;
    # later ones 0.1 s
    records = [
        Record(start=0.0, end=2.0, status=200, first_token=1.0, output_tokens=4),
        Record(start=0.0, end=2.0, status=200, first_token=1.0, output_tokens=4),
    ]
    records += [Record(start=2.0 + i, end=3.0 + i, status=200, first_token=2.1 + i,
                       output_tokens=4) for i in range(4)]  # fmt: skip
    s = summarize("x", records, 6.0, slo_ttft=2.0, slo_tpot=1.0, ramp_up=2)
    assert s.ttft_s["p99"] == pytest.approx(1.0)
    assert s.ttft_after_ramp_up_s["p99"] == pytest.approx(0.1)
    assert s.output_tokens_per_s == pytest.approx(24 / 6.0)


def test_plot_writes_a_png_of_throughput_and_ttft_against_concurrency(tmp_path):
    from loadtest.__main__ import plot
    from loadtest.stats import Record, summarize

    summaries = []
    for target in ("a:http://127.0.0.1:1", "b:http://127.0.0.1:2"):
        for c in (1, 8):
            records = [Record(start=0.0, end=1.0, status=200, first_token=0.1, output_tokens=8)]
            summaries.append(summarize(f"{target} c={c}", records, 1.0, 2.0, 1.0))
    plot(summaries, tmp_path / "plots")
    png = (tmp_path / "plots" / "loadtest.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_agent_sessions_grow_hit_the_cache_and_report_every_turn(server, tmp_path):
    """``loadtest.agent``: sessions whose every turn resends the conversation; later turns find
    the system prompt and the earlier turns cached, and the report covers every turn."""
    from loadtest import agent

    out = tmp_path / "agent.json"
    rc = agent.main([
        "--url", server.base_url, "--sessions", "2", "--turns", "3", "--system-words", "200",
        "--turn-words", "10-30", "--max-tokens", "8", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    [row] = json.loads(out.read_text())
    assert row["turns_ok"] == 6 and row["errors"] == 0 and row["tok_s"] > 0
    assert 0.3 < row["hit_rate"] < 1  # the turns after the first hit through the history
    assert row["ms_per_new_token"] > 0 and row["itl_p50"] > 0
    assert row["peak_kv_bytes"] is None or row["peak_kv_bytes"] > 0
    server.wait_pool_free()
