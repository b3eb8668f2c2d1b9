"""How fast the prefix cache's disk tier reads a run of pages back (``--prefix-cache-dir``):
``--pages`` pages of a model's KV geometry written by the tier's writer, then read by a fresh
tier (as after a restart), ``--repeats`` times; the files were just written, as in
``benchmarks.restart_bench``. Reports the read (files checked and joined, on the reader
thread) and the engine's take of the run (``run_kv``, evaluated), medians.

    python -m benchmarks.disk_read_bench --pages 395
    python -m benchmarks.disk_read_bench --pages 395 --head-dim 64 --layers 16   # the 1B shape

The defaults are the 8B Llama shape's geometry (32 layers, 8 KV heads of 128, bfloat16): 395
pages of 16 tokens are the 6,320-token conversation of ``restart_bench`` at 8B, ~2 MB a page.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from veloxquant_mlx.engine.loop.disk_tier import QUEUE_PAGES, DiskTier
from veloxquant_mlx.engine.loop.page_file import writable_views
from veloxquant_mlx.engine.loop.prefix_cache import chain

BS = 16


def write_pages(root: Path, fp: str, args: argparse.Namespace, dtype: mx.Dtype) -> list[int]:
    """``args.pages`` pages of random KV written through the tier; the run's tokens."""
    tier = DiskTier(root, 1 << 40, fp, args.layers, (dtype,))
    tokens = list(range(args.pages * BS))
    parent = tier.root_digest
    shape = (1, args.kv_heads, BS, args.head_dim)
    for i in range(args.pages):
        page = tokens[i * BS : (i + 1) * BS]
        layers = [
            ((mx.random.normal(shape).astype(dtype),), (mx.random.normal(shape).astype(dtype),))
            for _ in range(args.layers)
        ]
        mx.eval(layers)
        parent = chain(parent, page)
        tier.save(parent, page, layers)
    tier.close(600)
    return tokens


def read_once(root: Path, fp: str, tokens: list[int], args, dtype) -> tuple[float, float]:
    """A fresh tier reads the whole run: seconds on the reader, then in ``run_kv``."""
    tier = DiskTier(root, 1 << 40, fp, args.layers, (dtype,))
    try:
        t0 = time.perf_counter()
        future = tier.start_read(tokens, 0, tier.root_digest, args.pages, BS)
        assert future is not None
        run = future.result()
        t1 = time.perf_counter()
        assert run.n_pages == args.pages, f"read {run.n_pages} of {args.pages} pages"
        mx.eval(tier.run_kv(run, 0))
        return t1 - t0, time.perf_counter() - t1
    finally:
        tier.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=395)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.pages > QUEUE_PAGES:
        p.error(f"--pages at most {QUEUE_PAGES} (the writer's queue)")
    dtype = getattr(mx, args.dtype)
    page_mb = 2 * args.layers * args.kv_heads * BS * args.head_dim * dtype.size / 2**20
    total_mb = page_mb * args.pages
    fp = hashlib.sha256(b"disk_read_bench").hexdigest()
    with tempfile.TemporaryDirectory(prefix="vq-disk-read-") as tmp:
        root = Path(tmp)
        tokens = write_pages(root, fp, args, dtype)
        print(
            f"{args.pages} pages of {page_mb:.2f} MiB ({total_mb:.0f} MiB), {mx.default_device()}"
        )
        times = [read_once(root, fp, tokens, args, dtype) for _ in range(args.repeats)]
        print(f"read straight into MLX's memory (page_file.writable_views): {writable_views()}")
        read = statistics.median(t[0] for t in times)
        take = statistics.median(t[1] for t in times)
        print("| read ms | ms a page | GB/s | run_kv + eval ms |")
        print("|---:|---:|---:|---:|")
        gbs = total_mb * 2**20 / read / 1e9
        per_page = 1000 * read / args.pages
        print(f"| {1000 * read:.0f} | {per_page:.2f} | {gbs:.2f} | {1000 * take:.0f} |")


if __name__ == "__main__":
    main()
