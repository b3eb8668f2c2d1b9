"""One load level split over several client processes (``--processes``): one Python process
with asyncio and httpx tops out at a few thousand streamed tokens a second (measured on the
H200 host: 4,312 tok/s from one process, 6,182 from four against the same server;
BENCHMARKS.md), so a fast server needs several to be measured and not its client.

The parent gives each child a share of the concurrency and of the requests (and its own seed),
runs them at once and merges their records; times are ``time.monotonic``, one clock for every
process of a machine, so the merged wall time is the last end minus the first start.

    python -m loadtest.split IN.pickle OUT.pickle   (a child; the parent writes IN)
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import sys
import tempfile
from pathlib import Path

import httpx

from loadtest.runner import Scenario, run
from loadtest.stats import Record


def shares(sc: Scenario, k: int) -> list[Scenario]:
    """``sc`` cut into ``k`` scenarios whose concurrency and requests add up to its own."""
    k = max(1, min(k, sc.concurrency, sc.n_requests))
    out = []
    for i in range(k):
        c = sc.concurrency // k + (1 if i < sc.concurrency % k else 0)
        n = sc.n_requests // k + (1 if i < sc.n_requests % k else 0)
        out.append(dataclasses.replace(sc, concurrency=c, n_requests=n, seed=sc.seed + 7919 * i))
    return out


async def run_split(sc: Scenario, label: str, k: int) -> tuple[list[Record], float]:
    """The level in ``k`` child processes at once: every record, and the wall time."""
    with tempfile.TemporaryDirectory(prefix="loadtest-split-") as tmp:
        procs = []
        for i, share in enumerate(shares(sc, k)):
            src, dst = Path(tmp) / f"in-{i}", Path(tmp) / f"out-{i}"
            src.write_bytes(pickle.dumps((share, f"{label} [{i + 1}/{k}]")))
            procs.append(
                (await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "loadtest.split", str(src), str(dst)
                ), dst)
            )  # fmt: skip
        records: list[Record] = []
        for proc, dst in procs:
            if await proc.wait() != 0:
                raise RuntimeError(f"a load client process exited {proc.returncode}")
            records.extend(pickle.loads(dst.read_bytes()))
    if not records:
        return records, 0.0
    return records, max(r.end for r in records) - min(r.start for r in records)


async def _child(sc: Scenario, label: str) -> list[Record]:
    limits = httpx.Limits(max_connections=max(sc.concurrency, 64) * 2)
    async with httpx.AsyncClient(limits=limits, timeout=sc.request_timeout) as client:
        records, _ = await run(client, sc, label)
    return records


def main() -> int:
    sc, label = pickle.loads(Path(sys.argv[1]).read_bytes())
    records = asyncio.run(_child(sc, label))
    Path(sys.argv[2]).write_bytes(pickle.dumps(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
