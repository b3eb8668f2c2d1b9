"""benchmarks.serving's table: a level whose streams showed no text says so, not "nan"."""

from __future__ import annotations

import math

from benchmarks.serving import NO_TEXT, report


def level(ttft_p99: float, hits: float = 0.0) -> dict[str, float]:
    return {
        "tok_s": 1000.0,
        "ttft_p50_ms": ttft_p99 / 2,
        "ttft_p99_ms": ttft_p99,
        "errors": 0.0,
        "requests": 48.0,
        "prefix_hit_rate": hits,
    }


def test_a_level_with_text_reports_its_ttft_and_share_of_the_library():
    lines = report({"library": {8: 2000.0}, "ours-dense": {8: level(150.0)}}, [8])
    assert lines[-1] == "| 8 | 2000 | 1000 (150, 50% of library, 0 err) |"
    assert NO_TEXT not in lines


def test_a_level_without_text_says_so_and_how_to_get_it():
    lines = report({"ours-dense": {8: level(math.nan, hits=0.4)}}, [8])
    assert lines[2] == "| 8 | - | 1000 (no text, TTFT p50 no text, hits 40%, 0 err) |"
    assert lines[-1] == NO_TEXT and "--tokenizer-vocab" in NO_TEXT
