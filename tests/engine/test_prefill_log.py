"""The long-prefill log lines (``engine/loop/prefill_log.py``), on a clock the test moves: a
prefill that runs past ``EVERY_S`` says how far it got, that it ended, or what it kept when it
was cut; a short one says nothing."""

from __future__ import annotations

import logging

from veloxquant_mlx.engine.loop.prefill_log import EVERY_S, PrefillProgress
from veloxquant_mlx.engine.loop.seq import Chunk, Seq
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import GenerationRequest


def seq(request_id: int, n: int) -> Seq:
    handle = RequestHandle(request_id, GenerationRequest(tuple(range(3, 3 + n)), 8))
    return Seq(handle, list(handle.request.prompt_tokens), n)


def test_a_long_prefill_logs_its_progress_its_end_and_what_a_cut_one_kept(caplog):
    now = [0.0]
    progress = PrefillProgress(clock=lambda: now[0])
    long, cut, short = seq(1, 3000), seq(2, 2000), seq(3, 1024)
    caplog.set_level(logging.INFO, logger="veloxquant.engine")
    # ``long`` starts at 512 cached tokens; ``short`` is done within EVERY_S
    progress.chunks([Chunk(long, 512, 512), Chunk(cut, 0, 512), Chunk(short, 0, 512)])
    now[0] = EVERY_S / 2
    progress.chunks([Chunk(long, 1024, 512), Chunk(short, 512, 512)])
    assert caplog.messages == []
    now[0] = EVERY_S + 1
    progress.chunks([Chunk(long, 1536, 512), Chunk(cut, 512, 512)])
    assert caplog.messages == [
        f"request 1: prefilling, 1536 of 2488 prompt tokens (62%) in {EVERY_S + 1:.0f} s",
        f"request 2: prefilling, 1024 of 2000 prompt tokens (51%) in {EVERY_S + 1:.0f} s",
    ]
    caplog.clear()
    now[0] = EVERY_S + 5  # not EVERY_S since the last line: no line, but its end has one
    progress.chunks([Chunk(long, 2048, 952), Chunk(cut, 1024, 512)])
    assert caplog.messages == [
        f"request 1: prompt prefilled, 2488 tokens in {EVERY_S + 5:.0f} s "
        f"({2488 / (EVERY_S + 5):.0f} tokens/s; 512 were cached)"
    ]
    caplog.clear()
    progress.left(cut, "cancelled", 1536)
    progress.left(short, "cancelled", 0)  # never followed: nothing
    assert caplog.messages == [
        f"request 2 ended during its prefill (cancelled) after {EVERY_S + 5:.0f} s: 1536 of its "
        "2000 prompt tokens are in the prefix cache for a retry"
    ]
    assert progress._prompts == {}  # nothing left behind


def test_a_preempted_prefill_is_followed_anew_on_its_return(caplog):
    now = [0.0]
    progress = PrefillProgress(clock=lambda: now[0])
    s = seq(4, 4000)
    caplog.set_level(logging.INFO, logger="veloxquant.engine")
    progress.chunks([Chunk(s, 0, 512)])
    progress.forget(s)
    now[0] = EVERY_S + 1
    progress.chunks([Chunk(s, 512, 512)])  # its return, from its cached pages: a new start
    assert caplog.messages == []
    now[0] = 2 * EVERY_S + 2
    progress.chunks([Chunk(s, 1024, 512)])
    assert caplog.messages == [
        f"request 4: prefilling, 1024 of 3488 prompt tokens (29%) in {EVERY_S + 1:.0f} s"
    ]
