"""The agent benchmark's rounds: each round's ratios (ours / mlx_lm.server) and their median."""

from __future__ import annotations

from benchmarks.agent_bench import ratios
from loadtest.agent import AgentSummary


def summary(label: str, sessions: int, tok_s: float, p50: float, p99: float) -> AgentSummary:
    return AgentSummary(
        label=label, sessions=sessions, turns_ok=6, errors=0, tok_s=tok_s, ttft_p50=p50,
        ttft_p99=p99, ttft_first_turn=0.3, ttft_last_turn=0.1, ms_per_new_token=0.7,
        itl_p50=0.0, itl_p99=0.03, hit_rate=0.9, peak_kv_bytes=None, mean_prompt_tokens_last=10,
    )  # fmt: skip


def test_each_rounds_ratio_and_their_median_per_session_count():
    rounds = [
        [summary("ours", 1, 150, 0.05, 0.3), summary("mlx_lm.server", 1, 100, 0.1, 0.4)],
        [summary("mlx_lm.server", 1, 100, 0.1, 0.4), summary("ours", 1, 120, 0.06, 0.2)],
        [summary("ours", 1, 200, 0.04, 0.4), summary("mlx_lm.server", 1, 100, 0.1, 0.4)],
    ]
    lines = ratios("m", rounds)
    (row,) = [line for line in lines if line.startswith("| 1 |")]
    assert row == (
        "| 1 | 1.50x / 1.20x / 2.00x (**1.50x**) | 0.50x / 0.60x / 0.40x (**0.50x**) "
        "| 0.75x / 0.50x / 1.00x (**0.75x**) |"
    )


def test_a_round_without_the_peer_gives_no_ratio():
    lines = ratios("m", [[summary("ours", 4, 150, 0.05, 0.3)]])
    assert "| 4 | - | - | - |" in lines
