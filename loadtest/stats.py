"""Per-request records and the summary a run reports."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class Record:
    """One request as the client saw it (seconds on the client's monotonic clock)."""

    start: float
    end: float = 0.0
    status: int = 0  # HTTP status; 0: the connection failed
    error: str = ""
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when the server says
    text: str = ""  # the answer (multi-turn conversations resend it)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _dist(values: list[float]) -> dict[str, float]:
    return {f"p{int(q * 100)}": percentile(values, q) for q in (0.5, 0.9, 0.99)} | {
        "mean": sum(values) / len(values) if values else math.nan
    }


@dataclass(slots=True)
class Summary:
    label: str
    duration_s: float
    requests: int
    ok: int
    errors_by_status: dict[str, int]
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    goodput_requests_per_s: float
    ttft_s: dict[str, float]
    ttft_after_ramp_up_s: dict[str, float]  # without the first `concurrency` requests
    itl_s: dict[str, float]
    tpot_s: dict[str, float]
    e2e_s: dict[str, float]
    server: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefix_hit_rate: float = 0.0  # cached / prompt tokens, as the server reported them

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    label: str,
    records: list[Record],
    duration: float,
    slo_ttft: float,
    slo_tpot: float,
    ramp_up: int = 0,
) -> Summary:
    """Figures over ``records``; ``ramp_up``: how many of the earliest-started requests (a closed
    loop's first burst, all sent at once) to leave out of ``ttft_after_ramp_up_s``."""
    ok = [r for r in records if r.ok]
    late = sorted(records, key=lambda r: r.start)[ramp_up:]
    errors = Counter(str(r.status or "connection") for r in records if not r.ok)
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    good = [
        r for r in ok
        if (r.ttft is not None and r.ttft <= slo_ttft) and (r.tpot is None or r.tpot <= slo_tpot)
    ]  # fmt: skip
    tokens = sum(r.output_tokens for r in ok)
    return Summary(
        label=label,
        duration_s=duration,
        requests=len(records),
        ok=len(ok),
        errors_by_status=dict(errors),
        output_tokens=tokens,
        output_tokens_per_s=tokens / duration if duration else 0.0,
        requests_per_s=len(ok) / duration if duration else 0.0,
        goodput_requests_per_s=len(good) / duration if duration else 0.0,
        ttft_s=_dist([r.ttft for r in ok if r.ttft is not None]),
        ttft_after_ramp_up_s=_dist([r.ttft for r in late if r.ok and r.ttft is not None]),
        itl_s=_dist(itl),
        tpot_s=_dist([r.tpot for r in ok if r.tpot is not None]),
        e2e_s=_dist([r.e2e for r in ok]),
        prompt_tokens=(prompt := sum(r.prompt_tokens for r in ok)),
        cached_tokens=(cached := sum(r.cached_tokens for r in ok)),
        prefix_hit_rate=cached / prompt if prompt else 0.0,
    )


def markdown(summaries: list[Summary]) -> str:
    rows = [
        "| run | ok/total | errors | out tok/s | req/s | goodput req/s | TTFT p50/p90/p99 ms | "
        "ITL p50/p99 ms | TPOT p50 ms | E2E p50/p90/p99 s | prefix hits |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(s.errors_by_status.items())) or "none"
        rows.append(
            f"| {s.label} | {s.ok}/{s.requests} | {errs} | {s.output_tokens_per_s:.1f} | "
            f"{s.requests_per_s:.2f} | {s.goodput_requests_per_s:.2f} | "
            f"{s.ttft_s['p50'] * 1e3:.0f} / {s.ttft_s['p90'] * 1e3:.0f} / "
            f"{s.ttft_s['p99'] * 1e3:.0f} | "
            f"{s.itl_s['p50'] * 1e3:.1f} / {s.itl_s['p99'] * 1e3:.1f} | "
            f"{s.tpot_s['p50'] * 1e3:.1f} | {s.e2e_s['p50']:.2f} / {s.e2e_s['p90']:.2f} / "
            f"{s.e2e_s['p99']:.2f} | {s.prefix_hit_rate:.0%} |"
        )
    return "\n".join(rows)
