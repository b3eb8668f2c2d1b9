"""Serving throughput where MLX runs (an H200 on CUDA, a Mac, this CPU): the library, us, the peer.

    python -m benchmarks.serving --shape 1b --concurrency 1,8,32,128 --out DIR

For one random-weight model of a real shape (written once, bf16 on a GPU) it measures, side by
side in one run:

- ``library``: mlx_lm's ``BatchGenerator`` alone, in process, every request inserted up front
  (the ceiling a server can approach; no HTTP, no arrivals);
- ``ours`` for each ``--layouts`` (our server, streaming completions over loopback HTTP, closed
  loop at each concurrency);
- ``mlx_lm.server`` on the same model and load.

Prompts are ``--prompt-tokens`` long (random words sized by the tokenizer), outputs
``--max-tokens`` (a range gives varied lengths). ``--sampling`` runs each of our servers under
more kinds of traffic, one after the other on the same server: ``greedy``, ``sampled``
(temperature 0.7, top_p 0.9), ``bias`` (sampled, and a logit_bias of 8 ids) and ``schema``
(sampled, a JSON schema response_format; chat API). With ``--peak-gbs`` (the device's memory
bandwidth: 4800 for an H200) the report says, per level, the bytes a decode step must read
(the weights, and every row's KV at its mean context), the bandwidth the measured tokens/s
imply and its fraction of the peak, and the tokens/s the peak would allow (the roofline).
After each level our server's MLX memory (``/metrics``: active, cache, peak MiB) goes with
its figures, so a run shows how the device's memory moved. Writes ``serving.json`` and
``serving.md`` in ``--out``. Every server it starts is stopped by pid before it returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.models import LARGE_CONFIG, MEDIUM_CONFIG
from loadtest.__main__ import level, parse
from loadtest.probe import scrape
from loadtest.proc import free_port, server
from loadtest.runner import WORDS

SHAPES: dict[str, dict[str, Any]] = {
    "1b": {  # Llama-3.2-1B
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "8b": {  # Llama-3.1-8B
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "tiny": {},  # the embedded default model's shape
    # ~80M parameters with a 32,000-token vocabulary (Llama-2's, Mistral's): sampling's share
    # of a CPU step at a vocabulary of a real model's size.
    "32k": {**MEDIUM_CONFIG, "vocab_size": 32000},
    # scripts/make_random_model.py's 105M-parameter Llama (the CPU benchmarks' "100m").
    "100m": LARGE_CONFIG,
    # The 1B shape's 16 layers at a tiny width: a decode step is almost all host (Python and
    # launch) work, which is what a GPU step must hide behind its compute.
    "host": {
        "hidden_size": 64,
        "num_hidden_layers": 16,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
}


def layout_flags(layout: str) -> list[str]:
    """Our server's flags for a benchmark layout: dense, paged, or fused (the paged layout with
    ``--paged-attention fused``)."""
    if layout == "fused":
        return ["--kv-layout", "paged", "--paged-attention", "fused"]
    return ["--kv-layout", layout]


def layout_config(layout: str) -> dict[str, str]:
    """``EngineConfig`` fields for a benchmark layout (as ``layout_flags``)."""
    if layout == "fused":
        return {"kv_layout": "paged", "paged_attention": "fused"}
    return {"kv_layout": layout}


def write_model(
    target: Path, shape: str, dtype: str, tokenizer_vocab: bool = False, fill: bool = False
) -> Path:
    """A random-weight Llama of ``shape`` with the shipped tokenizer (reused if present).
    ``tokenizer_vocab``: the tokenizer's vocabulary instead of the shape's, so that sampled ids
    decode to text (time to first *text* then means time to first token). ``fill``: the shape's
    vocabulary, the tokenizer grown to it (``fill_tokenizer``), so that every id decodes to
    text, greedy's as sampled's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from veloxquant_mlx.engine.model.default_model import ASSETS, CONFIG, TOKENIZER_FILES

    if (target / "config.json").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, **SHAPES[shape], "torch_dtype": dtype}
    if tokenizer_vocab:
        config["vocab_size"] = CONFIG["vocab_size"]
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(target / "model.safetensors"), weights, {"format": "mlx"})
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / name, target / name)
    if fill:
        fill_tokenizer(target / "tokenizer.json", config["vocab_size"])
    return target


def fill_tokenizer(path: Path, vocab: int) -> None:
    """Grow the tokenizer at ``path`` to ``vocab`` ids with added tokens (" w<id>", not
    special), so that a model whose vocabulary is larger than the shipped tokenizer's (2,048)
    decodes every id it emits to text, as a real model's tokenizer does: without it a random
    model's greedy ids mostly lie past the tokenizer and stream nothing, which no real model's
    traffic does."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(path))
    have = tok.get_vocab_size(with_added_tokens=True)
    tok.add_tokens([AddedToken(f" w{i}", normalized=False) for i in range(have, vocab)])
    tok.save(str(path))


def words_for(path: Path, tokens: int) -> int:
    """How many loadtest words make about ``tokens`` prompt tokens with this tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    rng = random.Random(0)
    sample = " ".join(rng.choice(WORDS) for _ in range(400))
    per_word = len(tok.encode(sample)) / 400
    return max(1, round(tokens / per_word))


def library(path: Path, c: int, n: int, prompt_tokens: int, max_tokens: tuple[int, int]) -> float:
    """BatchGenerator alone, ``n`` requests inserted up front, batch ``c``: output tok/s."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    model, _ = mlx_lm.load(str(path))[:2]
    rng = random.Random(c)
    prompts = [[rng.randrange(3, 2000) for _ in range(prompt_tokens)] for _ in range(n)]
    lengths = [rng.randint(*max_tokens) for _ in range(n)]
    gen = BatchGenerator(
        model, stop_tokens=[], completion_batch_size=c, prefill_batch_size=min(c, 8)
    )
    # warm-up outside the timing (the servers get one too): compile the step's kernels
    gen.insert(prompts[:2], [4, 4])
    warm = 0
    while warm < 8:  # both rows' 4 tokens: they have left before the timing starts
        warm += len(gen.next()[1])
    t0 = time.perf_counter()
    gen.insert(prompts, lengths)
    produced, total = 0, sum(lengths)
    while produced < total:
        _, responses = gen.next()
        produced += len(responses)
    mx.synchronize()
    rate = produced / (time.perf_counter() - t0)
    gen.close()
    del gen, model
    mx.clear_cache()  # the servers measured next share the device: give its memory back
    return rate


# --sampling: the load client's flags for each kind of traffic.
TRAFFIC: dict[str, list[str]] = {
    "greedy": [],
    "sampled": ["--temperature", "0.7", "--top-p", "0.9"],
    "bias": ["--temperature", "0.7", "--top-p", "0.9", "--logit-bias", "8"],
    "schema": ["--temperature", "0.7", "--top-p", "0.9", "--json-schema"],
}


def serve_and_load(
    cmd: list[str], port: int, model: str | None, levels: list[int],
    lts: dict[str, argparse.Namespace], requests: dict[int, int], log: Path,
) -> dict[str, dict[int, dict[str, float]]]:  # fmt: skip
    """One server, loaded with each traffic of ``lts`` in turn: {traffic: {level: figures}}."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    env = dict(os.environ)
    with server(cmd, port, env, log):
        url = f"http://127.0.0.1:{port}"
        for traffic, lt in lts.items():
            # warm-up: compile kernels for the shapes the levels use
            asyncio.run(level(lt, url, model, 4, "warm-up", n_requests=8))
            out[traffic] = {}
            for c in levels:
                s = asyncio.run(level(lt, url, model, c, f"c={c}", n_requests=requests[c]))
                out[traffic][c] = {
                    "tok_s": s.output_tokens_per_s,
                    "ttft_p50_ms": s.ttft_s["p50"] * 1e3,
                    "ttft_p99_ms": s.ttft_s["p99"] * 1e3,
                    "errors": float(sum(s.errors_by_status.values())),
                    "requests": float(s.requests),
                    "prefix_hit_rate": s.prefix_hit_rate,
                    **mlx_memory_mib(url),
                }
                print(f"  {traffic} c={c}: {out[traffic][c]}", flush=True)
    return out


def mlx_memory_mib(url: str) -> dict[str, float]:
    """Our server's MLX memory after a level (``veloxquant_mlx_memory_bytes`` in /metrics),
    MiB by kind as ``mlx_active_mib`` etc.; {} from a server without it (a peer)."""

    async def samples() -> dict[str, float]:
        async with httpx.AsyncClient() as client:
            return await scrape(client, url) or {}

    got = asyncio.run(samples())
    return {
        f"mlx_{kind}_mib": round(got[key] / 2**20, 1)
        for kind in ("active", "cache", "peak")
        if (key := f"veloxquant_mlx_memory_bytes{{kind={kind}}}") in got
    }


def step_bytes(path: Path, rows: int, context: float) -> float:
    """The bytes one decode step of ``rows`` rows at a mean ``context`` must read at least:
    every weight once, and every row's K and V."""
    config = json.loads((path / "config.json").read_text())
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = 4 if config.get("torch_dtype") == "float32" else 2
    kv_per_token = 2 * config["num_hidden_layers"] * heads * head_dim * width
    return weights + rows * context * kv_per_token


def roofline(results: dict[str, Any], path: Path, levels: list[int], peak_gbs: float,
             context: float) -> list[str]:  # fmt: skip
    """Per level: bytes a step reads, the roofline tok/s, and each server's achieved GB/s and
    fraction of the peak (steps/s taken as tok/s over the level's rows)."""
    servers = [k for k in results if k.startswith("ours-") or k == "mlx_lm"]
    lines = [
        f"Against the memory roofline ({peak_gbs:.0f} GB/s; mean context {context:.0f} tokens):",
        "",
        "| clients | bytes a step reads | roofline tok/s | "
        + " | ".join(f"{s} GB/s (of peak)" for s in servers) + " |",
        "|---:|---:|---:|" + "---:|" * len(servers),
    ]  # fmt: skip
    for c in levels:
        need = step_bytes(path, c, context)
        cells = [f"{need / 1e9:.2f} GB", f"{c * peak_gbs * 1e9 / need:,.0f}"]
        for s in servers:
            r = results[s].get(c)
            if r is None:
                cells.append("-")
                continue
            gbs = r["tok_s"] / c * need / 1e9
            cells.append(f"{gbs:,.0f} ({gbs / peak_gbs:.1%})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", default="128", help="N or LO-HI (varied lengths)")
    p.add_argument("--per-level", type=int, default=32, help="requests per level, at least 2c")
    p.add_argument(
        "--per-client",
        type=int,
        default=6,
        help="at least this many requests per client in a level (6+, so that the ramp-up and "
        "the last requests do not dominate: BENCHMARKS.md, 'The load client was the limit')",
    )
    p.add_argument(
        "--layouts", default="dense,paged", help="of dense, paged, fused (paged, fused attention)"
    )
    p.add_argument("--peers", default="library,mlx_lm")
    p.add_argument("--blas", default="off")
    p.add_argument("--kv-cache-mb", default="16384", help="our pool (the GPU has room)")
    p.add_argument(
        "--shared-prefix-tokens", type=int, default=0, help="a system prompt shared by all"
    )
    p.add_argument("--turns", type=int, default=1, help="conversations of this many turns (chat)")
    p.add_argument(
        "--tokenizer-vocab",
        action="store_true",
        help="the shipped tokenizer's vocabulary instead of the shape's (generated text is real)",
    )
    p.add_argument(
        "--tokenizer-fill",
        action="store_true",
        help="the shape's vocabulary, the shipped tokenizer grown to it with added tokens: every "
        "id decodes to text (greedy streams text, as with a real model)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="extra server flags for one more run of each layout (ours-LAYOUT-b, then -c, ... "
        "when repeated), e.g. '--gil-switch-interval-ms 1'",
    )
    p.add_argument(
        "--prefix-off-too",
        action="store_true",
        help="also run each layout with --no-prefix-caching (ours-LAYOUT-nopc)",
    )
    p.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="load client processes per level (one Python client caps near 4,000 tok/s)",
    )
    p.add_argument(
        "--sampling",
        default="greedy",
        help=f"kinds of traffic for our servers, of {','.join(TRAFFIC)} (each after the other)",
    )
    p.add_argument(
        "--peak-gbs", type=float, default=0.0, help="device memory bandwidth: roofline figures"
    )
    p.add_argument("--work", default="bench-work")
    p.add_argument("--out", default="bench-out")
    a = p.parse_args()
    extras: list[list[str]] = [[], ["--no-prefix-caching"]] if a.prefix_off_too else [[]]
    suffixes = ["", "-nopc"][: len(extras)]
    for i, variant in enumerate(a.variant):
        flags = shlex.split(variant)
        if not flags or any(f.endswith("=") for f in flags):  # an empty shell variable, say
            raise SystemExit(f"--variant {variant!r}: give the server flags and their values")
        extras.append(flags)
        suffixes.append("-" + chr(ord("b") + i))
    levels = [int(x) for x in a.concurrency.split(",")]
    requests = {c: max(a.per_level, a.per_client * c) for c in levels}
    lo, _, hi = a.max_tokens.partition("-")
    max_tokens = (int(lo), int(hi or lo))
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-tokvocab" if a.tokenizer_vocab else "-tokfill" if a.tokenizer_fill else ""
    path = write_model(
        work / f"model-{a.shape}{suffix}", a.shape, a.dtype, a.tokenizer_vocab, a.tokenizer_fill
    )
    words = words_for(path, a.prompt_tokens)
    shared = words_for(path, a.shared_prefix_tokens) if a.shared_prefix_tokens else 0
    base = ["--prompt-words", f"{words}-{words}", "--max-tokens", a.max_tokens,
            "--no-leak-check", "--scrape-interval", "1.0", "--shared-prefix-words",
            str(shared), "--turns", str(a.turns), "--processes", str(a.client_processes),
            "--api", "chat" if a.turns > 1 else "completions"]  # fmt: skip
    # each traffic its own prompts (a seed each): none finds another's in the prefix cache
    kinds = a.sampling.split(",")  # a kind named again runs again: "sampled-2" (warm figures)
    names = [t if kinds[:i].count(t) == 0 else f"{t}-{kinds[:i].count(t) + 1}"
             for i, t in enumerate(kinds)]  # fmt: skip
    lts = {
        name: parse([*base, *TRAFFIC[t], "--seed", str(101 * i)])
        for i, (name, t) in enumerate(zip(names, kinds, strict=True))
    }
    lt = lts.get("greedy") or next(iter(lts.values()))
    results: dict[str, Any] = {"shape": a.shape, "prompt_tokens": a.prompt_tokens,
                               "max_tokens": a.max_tokens, "words": words}  # fmt: skip
    peers = a.peers.split(",") if a.peers else []
    if "library" in peers:
        results["library"] = {}
        for c in levels:
            results["library"][c] = library(path, c, requests[c], a.prompt_tokens,
                                            max_tokens)  # fmt: skip
            print(f"library c={c}: {results['library'][c]:.0f} tok/s", flush=True)
    layouts = a.layouts.split(",") if a.layouts else []
    variants = [(layout, x) for layout in layouts for x in zip(extras, suffixes, strict=True)]
    for layout, (extra, suffix) in variants:
        name = f"ours-{layout}{suffix}"
        port = free_port()
        cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--model", str(path), "--port",
               str(port), *layout_flags(layout), "--blas", a.blas, "--max-running", "256",
               "--max-queue", "1024", "--kv-cache-mb", a.kv_cache_mb,
               "--log-level", "warning", *extra]  # fmt: skip
        print(name, flush=True)
        runs = serve_and_load(cmd, port, None, levels, lts, requests, out / f"{name}.log")
        for traffic, figures in runs.items():
            results[name if traffic == "greedy" else f"{name}-{traffic}"] = figures
    if "mlx_lm" in peers:
        port = free_port()
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(path), "--port",
               str(port)]  # fmt: skip
        print("mlx_lm.server", flush=True)
        results["mlx_lm"] = serve_and_load(
            cmd, port, str(path), levels, {"greedy": lt}, requests, out / "mlx_lm.log"
        )["greedy"]
    lines = report(results, levels)
    lines += [f"ours-LAYOUT{x}: {' '.join(e)}" for e, x in zip(extras, suffixes, strict=True) if e]
    if a.peak_gbs:
        context = a.prompt_tokens + a.shared_prefix_tokens + (max_tokens[0] + max_tokens[1]) / 4
        lines += ["", *roofline(results, path, levels, a.peak_gbs, context)]
    (out / "serving.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


NO_TEXT = (
    "no text: TTFT is the time to the first text, and no stream of that level had any (with "
    "the shape's vocabulary most sampled ids decode to nothing): pass --tokenizer-vocab"
)


def _ms(value: float) -> str:
    return "no text" if math.isnan(value) else f"{value:.0f}"


def report(results: dict[str, Any], levels: list[int]) -> list[str]:
    servers = [k for k in results if k.startswith("ours-") or k == "mlx_lm"]
    head = "| clients | library tok/s | " + " | ".join(f"{s} tok/s (TTFT p99 ms)" for s in servers)
    lines = [head + " |", "|---:|---:|" + "---:|" * len(servers)]
    unseen = False
    for c in levels:
        lib = results.get("library", {}).get(c)
        cells = [f"{lib:.0f}" if lib else "-"]
        for s in servers:
            r = results[s].get(c)
            if r is None:
                cells.append("-")
                continue
            frac = f", {r['tok_s'] / lib:.0%} of library" if lib else ""
            hits = r.get("prefix_hit_rate")
            cached = f", TTFT p50 {_ms(r['ttft_p50_ms'])}, hits {hits:.0%}" if hits else ""
            unseen = unseen or math.isnan(r["ttft_p99_ms"])
            cells.append(
                f"{r['tok_s']:.0f} ({_ms(r['ttft_p99_ms'])}{frac}{cached}, {r['errors']:.0f} err)"
            )
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return [*lines, "", NO_TEXT] if unseen else lines


if __name__ == "__main__":
    main()
