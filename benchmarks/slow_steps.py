"""Where the slow steps' time went, from a server log at ``--log-level debug``.

    python -m benchmarks.slow_steps SERVER.log [...]

The engine logs every turn of 50 ms or more (``engine/loop/clock.py``) with its phases
(schedule, prefill, build, launch, read back), the rows decoding and the prompt tokens it
prefilled. This reads those lines and prints, for the steps with prefill in them and for the
decode-only ones: how many, the total's p50 / p90 / p99 / max, and each phase's mean and max,
so a run's inter-token p99 can be traced to the phase that makes it.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("schedule", "prefill", "build", "launch", "read back")
LINE = re.compile(
    r"slow step: (?P<total>\d+) ms \((?P<phases>[^)]*)\); (?P<rows>\d+) rows decoding, "
    r"(?P<tokens>\d+) prompt tokens prefilled"
)


@dataclass
class Step:
    total: float
    phases: dict[str, float]
    rows: int
    tokens: int


@dataclass
class Group:
    name: str
    steps: list[Step] = field(default_factory=list)


def parse(lines: list[str]) -> list[Step]:
    steps = []
    for line in lines:
        m = LINE.search(line)
        if m is None:
            continue
        phases = {}
        for part in m["phases"].split(","):
            name, _, ms = part.strip().rpartition(" ")
            phases[name] = float(ms)
        steps.append(Step(float(m["total"]), phases, int(m["rows"]), int(m["tokens"])))
    return steps


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(steps: list[Step]) -> list[str]:
    groups = [
        Group("with prefill, rows decoding", [s for s in steps if s.tokens and s.rows]),
        Group("prefill only (no row decoding)", [s for s in steps if s.tokens and not s.rows]),
        Group("decode only", [s for s in steps if not s.tokens]),
    ]
    head = "| steps | n | total p50 / p90 / p99 / max ms | " + " | ".join(
        f"{p} mean / max" for p in PHASES
    )
    out = [head + " | prompt tokens mean |", "|---" * (len(PHASES) + 4) + "|"]
    for g in groups:
        if not g.steps:
            continue
        totals = [s.total for s in g.steps]
        cells = [
            f"{g.name}",
            str(len(g.steps)),
            " / ".join(f"{_pct(totals, q):.0f}" for q in (0.5, 0.9, 0.99))
            + f" / {max(totals):.0f}",
        ]
        for p in PHASES:
            vals = [s.phases.get(p, 0.0) for s in g.steps]
            cells.append(f"{statistics.mean(vals):.0f} / {max(vals):.0f}")
        cells.append(f"{statistics.mean(s.tokens for s in g.steps):.0f}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+")
    args = p.parse_args(argv)
    steps = parse([ln for f in args.logs for ln in Path(f).read_text().splitlines()])
    if not steps:
        print("no slow steps (is the server at --log-level debug?)", file=sys.stderr)
        return 1
    print("\n".join(table(steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
