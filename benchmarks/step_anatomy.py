"""What one decode step costs: operations in its graph, host time to build and launch it, and
the wait for the device, for a batch of rows, greedy and sampled.

    python -m benchmarks.step_anatomy --shape 1b --rows 1,128 --context 320

A bare decode loop over the engine's dense KV layout and its batched sampler
(``request.sampling``), no engine thread and no HTTP: each step is built (the model's forward
over every row, then the sampling pass), launched with ``mx.async_eval`` and waited for
(``mx.eval``); the next step feeds the sampled tokens. Reports the medians over ``--steps``
steps after 3 of warm-up, and the primitives in one step's graph as ``mx.export_to_dot``
writes them (MLX's own operations before its compiled functions fuse theirs: an upper bound
on the kernels a step launches). ``sampled`` is temperature 0.7 and top_p 0.9 on every row.
``--formats auto,int8,int8+fused`` takes the same step apart over the quantized dense layout
(``--kv-format``), whose attention reads codes through ``mx.quantized_matmul`` (mlx_lm's), or
with ``+fused`` through ``--quantized-attention fused`` (one kernel a layer on CUDA); ``+wN``
adds an N-token residual window (``--kv-recent-tokens N``), e.g. ``int8+fused+w16``; ``+plain``
is ``+fused`` with the kernels' warp-per-position step (``kv.quantized_kernels``; ``+fused``
alone is the server's ``tile``);
``+sdpa`` (the default here) and ``+matmul`` say how a ragged step attends
(``--ragged-attention``, e.g. ``auto+matmul``, the server's on a GPU from 32 rows);
``+proj`` runs each layer's q/k/v and gate/up projections as one matmul each
(``--fused-projections``, ``engine.model.fused_linear``);
``+compiled`` steps the dense layout through the compiled forward (``--compiled-step``,
``kv.compiled_step``; its graph then holds the compile's fused kernels, one operation each). Each
line also says whether row 0's greedy tokens over the steps are the first format's; its JSON
line after it counts the graph's operations by primitive (``by_primitive``). ``--ragged N``
puts the rows at N positions (as rows that joined at different times), so the step is the
masked one a serving batch mostly takes. On a CPU a sampled step's draw reads the logits back
(``request.host_draw``): its build then includes the forward's wait.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.serving import write_model
from benchmarks.single_stream import layout_with_rows, prefill, step_logits

TRAFFIC = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}


def primitives(*outputs: object) -> Counter[str]:
    """The operations in the graph behind ``outputs`` (not yet evaluated), by primitive."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), *outputs)
        return Counter(re.findall(r'label ="?([^",\]]+)"?, shape=rectangle', path.read_text()))


def anatomy(
    model: object,
    prompt: list[int],
    rows: int,
    traffic: str,
    steps: int,
    fmt: str = "auto",
    ragged: int = 0,
) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.engine.request.sampling import BatchSampler, RowSampling
    from veloxquant_mlx.engine.types import SamplingParams
    from veloxquant_mlx.kv import attention
    from veloxquant_mlx.kv.codec import parse
    from veloxquant_mlx.kv.compiled_step import CompiledStep

    _, layers, y = prefill(model, prompt)
    k0 = layers[0][0]
    name, *hows = fmt.split("+")
    codec = parse(name, str(k0.dtype).split(".")[-1], k0.shape[-1], None)
    kernel = bool({"fused", "plain"} & set(hows))
    recent = next((int(h[1:]) for h in hows if h.startswith("w")), 0)
    mode = next((h for h in hows if h in attention.MODES), "sdpa")
    policy = attention.RaggedAttention(mode)
    if kernel or recent or mode == "matmul":
        attention.install(model)
    kv, n_ids = layout_with_rows(
        "dense", layers, rows, steps + 4, codec=codec, kernel=kernel, recent=recent,
        ragged=policy,
    )  # fmt: skip
    if "plain" in hows:  # the kernels' warp-per-position step (kv.quantized_kernels)
        kv.kernel.step = "plain"
    compiled = CompiledStep(model, kv.n_layers) if "compiled" in hows else None
    vocab = int(model(mx.array([[0]])).shape[-1])  # type: ignore[operator]
    params = SamplingParams(**TRAFFIC[traffic])  # type: ignore[arg-type]
    sampler = BatchSampler([RowSampling(params, vocab) for _ in range(rows)], vocab)
    tokens = mx.repeat(y.reshape(1).astype(mx.uint32), rows)
    # ragged: row i at (i % ragged) positions before the others, as rows that joined apart
    positions = [len(prompt) - i % ragged if ragged else len(prompt) for i in range(rows)]
    build, launch, wait, ops, row0 = [], [], [], Counter[str](), []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        drawn = sampler.draw(step_logits(model, kv, tokens, positions, n_ids, compiled))
        t1 = time.perf_counter()
        if i == 3:
            ops = primitives(drawn.tokens, *drawn.state)
        t1b = time.perf_counter()
        mx.async_eval(drawn.tokens, *drawn.state)
        t2 = time.perf_counter()
        mx.eval(drawn.tokens)
        t3 = time.perf_counter()
        row0.append(int(drawn.tokens[0]))
        if i >= 3:
            build.append(t1 - t0)
            launch.append(t2 - t1b)
            wait.append(t3 - t2)
        tokens, positions = drawn.tokens, [p + 1 for p in positions]
    ms = {k: statistics.median(v) * 1e3 for k, v in (("build", build), ("launch", launch),
                                                      ("wait", wait))}  # fmt: skip
    return {"rows": rows, "format": fmt, "traffic": traffic, "ops": ops.total(),
            "by_primitive": dict(ops.most_common()), **{f"{k}_ms": round(v, 3)
            for k, v in ms.items()}, "step_ms": round(sum(ms.values()), 3),
            "row0": row0}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", default="1,128")
    p.add_argument("--context", type=int, default=320, help="tokens in each row's KV")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--traffic", default="greedy,sampled")
    p.add_argument("--formats", default="auto", help="KV formats (--kv-format), e.g. auto,int8")
    p.add_argument("--ragged", type=int, default=0, help="rows at N positions: masked steps")
    p.add_argument("--work", default="bench-work")
    a = p.parse_args()
    import mlx_lm

    from veloxquant_mlx.engine.model import fused_linear

    path = write_model(Path(a.work) / f"model-{a.shape}", a.shape, a.dtype)
    models: dict[bool, object] = {}

    def model_for(fmt: str) -> object:
        """The model, with its projections fused (``+proj``) or as mlx_lm makes it."""
        fused = "proj" in fmt.split("+")[1:]
        if fused not in models:
            models[fused] = mlx_lm.load(str(path))[0]
            if fused:
                fused_linear.install(models[fused])
        return models[fused]

    prompt = [(7 * i) % 1000 + 3 for i in range(a.context)]
    print("| rows | KV format | traffic | ops in the graph | build ms | launch ms | wait ms "
          "| step ms | row 0's tokens as the first format's |\n"
          "|---:|---|---|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for rows in (int(x) for x in a.rows.split(",")):
        first: dict[str, list[int]] = {}
        for fmt in a.formats.split(","):
            for traffic in a.traffic.split(","):
                try:
                    r = anatomy(model_for(fmt), prompt, rows, traffic, a.steps, fmt, a.ragged)
                except Exception as e:  # one format's failure (a kernel's compile) is its line
                    print(f"| {rows} | {fmt} | {traffic} | failed: {type(e).__name__}: "
                          f"{str(e)[:300]} |", flush=True)  # fmt: skip
                    continue
                same = first.setdefault(traffic, r["row0"])
                agree = sum(x == y for x, y in zip(same, r["row0"], strict=True))
                cells = [rows, fmt, traffic, r["ops"], r["build_ms"], r["launch_ms"],
                         r["wait_ms"], r["step_ms"], f"{agree}/{len(same)}"]  # fmt: skip
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)
                print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
