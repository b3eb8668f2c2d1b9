"""One fixed engine workload, run alone or as the ranks of a group (``python -m``): the JSON
it writes lets a test compare a sharded run with a single process.

    python -m tests.support.group_workload OUT.json MODEL_DIR_OR_- [--pipeline] [--paged]

In a group, rank 0 runs the workload and the other ranks follow (``engine.follower``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from veloxquant_mlx.config.launch import launched_rank
from veloxquant_mlx.engine.hosts.follower import run_follower
from veloxquant_mlx.engine.hosts.thread import Engine, EngineConfig
from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _collect(handle) -> dict:
    tokens, logprobs, finish = [], [], None
    for event in handle.events():
        if isinstance(event, FinishEvent):
            finish = event.finish_reason
        else:
            tokens.append(event.token_id)
            logprobs.append([event.logprob, list(event.top_logprobs)])
    return {"tokens": tokens, "logprobs": logprobs, "finish": finish}


def workload(engine: Engine) -> dict:
    out: dict = {}
    # Rows of different lengths batched together, joining and leaving at different steps.
    requests = [
        GenerationRequest(tuple(range(3, 3 + n)), m, GREEDY, logprobs=True, top_logprobs=2)
        for n, m in ((5, 12), (40, 6), (9, 20), (23, 3))
    ]
    requests.append(
        GenerationRequest((5, 6, 7), 10, SamplingParams(temperature=0.9, seed=11), logprobs=True)
    )
    handles = [engine.submit(r) for r in requests]
    out["batch"] = [_collect(h) for h in handles]
    # A prompt that shares the first one's prefix (a prefix-cache hit on every rank).
    again = GenerationRequest(tuple(range(3, 40)), 5, GREEDY)
    out["hit"] = _collect(engine.submit(again))
    # Cancel a long request once it has made a few tokens.
    handle = engine.submit(GenerationRequest((9, 8, 7), 2000, GREEDY))
    for seen, event in enumerate(handle.events(), 1):
        if isinstance(event, FinishEvent):
            out["cancelled"] = event.finish_reason
            break
        if seen == 3:
            engine.cancel(handle)
    deadline = time.monotonic() + 30
    while engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    # Shrink, then a request still runs in what is left.
    out["retired"] = engine.shrink("kv", 40)
    out["after_shrink"] = _collect(engine.submit(GenerationRequest((4, 4, 4), 4, GREEDY)))
    out["scored"] = [[lp, list(top)] for lp, top in engine.score((3, 4, 5, 6), 2)]
    engine.reset_prefix_cache()
    out["pools"] = engine.group_pools()
    return out


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out_path, model = sys.argv[1], sys.argv[2]
    config = EngineConfig(
        model=None if model == "-" else model,
        model_cache_dir=os.environ.get("VQ_TEST_MODEL_CACHE"),
        kv_cache_mb=16,
        kv_layout="paged" if "--paged" in sys.argv else "auto",
        distributed=launched_rank() is not None,
        pipeline="--pipeline" in sys.argv,
        group_timeout=60,
    )
    rank = launched_rank()
    if rank is not None and rank > 0:
        return run_follower(config)
    engine = Engine(config).start()
    engine.wait_ready(120)
    try:
        result = workload(engine)
    finally:
        engine.shutdown(10)
    result["world_size"] = engine.group_info.world_size
    result["mode"] = engine.group_info.mode
    with open(out_path, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
