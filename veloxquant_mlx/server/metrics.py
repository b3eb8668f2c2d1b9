"""/metrics: request histograms and counters, live engine and pool state, one app registry."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from veloxquant_mlx.engine.client import EngineClient
from veloxquant_mlx.engine.types import (
    CAPACITY_REDUCED,
    DRAINING,
    ENGINE_FAILED,
    REQUEST_FAILED,
    EngineView,
)

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class EngineCollector(Collector):
    """Reads the engine and its pool at scrape time (gauges are never set by hand)."""

    def __init__(self, engine: EngineClient, model_name: str, compat: str = "none") -> None:
        self.engine = engine
        self.model_name = model_name
        self.compat = compat
        self.view: EngineView | None = None  # set by Metrics.render for the scrape

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        view = self.view if self.view is not None else engine.view()
        stats = view.stats
        info = GaugeMetricFamily(
            "veloxquant_build_info",
            "Build and runtime facts (value is always 1).",
            labels=[
                "version",
                "model",
                "blas",
                "mlx_device",
                "world_size",
                "parallel",
                "kv_layout",
                "kv_format",
                "ragged_attention",
            ],
        )
        from veloxquant_mlx import __version__

        group = engine.group_info
        info.add_metric(
            [
                __version__,
                self.model_name,
                engine.blas,
                engine.device,
                str(group.world_size),
                group.mode,
                stats.kv_layout,
                stats.kv_format,
                stats.ragged_attention,
            ],
            1,
        )
        yield info
        yield _gauge("veloxquant_engine_alive", "1 while the engine thread runs.", stats.alive)
        yield _gauge(
            "veloxquant_engine_ready",
            "1 when serving (loaded, not draining).",
            stats.ready and not stats.draining,
        )
        yield _gauge(
            "veloxquant_engine_snapshot_age_seconds",
            "How old the engine figures in this scrape are (0 but when the engine process did "
            "not answer in time: then its last ones are shown).",
            view.age_s,
        )
        yield _gauge(
            "veloxquant_engine_stalled_seconds",
            "Seconds the engine has had work and shown no progress (0 when progressing).",
            engine.stalled_for(),
        )
        yield _gauge("veloxquant_requests_running", "Requests being decoded.", stats.running)
        yield _gauge("veloxquant_requests_waiting", "Requests queued for admission.", stats.waiting)
        yield _counter(
            "veloxquant_prompt_tokens", "Prompt tokens admitted.", stats.prompt_tokens_total
        )
        yield _counter(
            "veloxquant_generation_tokens", "Tokens generated.", stats.generated_tokens_total
        )
        finished = CounterMetricFamily(
            "veloxquant_requests_finished", "Requests finished, by reason.", labels=["reason"]
        )
        for reason in ("stop", "length", "cancelled", "error"):
            finished.add_metric([reason], stats.requests_finished_total.get(reason, 0))
        yield finished
        rejected = CounterMetricFamily(
            "veloxquant_requests_rejected",
            "Requests refused at submit, by reason.",
            labels=["reason"],
        )
        for reason in ("queue_full", "too_large", "capacity", "not_ready", "invalid"):
            rejected.add_metric([reason], stats.rejections_total.get(reason, 0))
        yield rejected
        failed = CounterMetricFamily(
            "veloxquant_requests_failed",
            "Admitted requests that ended with an error, by code.",
            labels=["code"],
        )
        for code in (REQUEST_FAILED, CAPACITY_REDUCED, DRAINING, ENGINE_FAILED):
            failed.add_metric([code], stats.failures_total.get(code, 0))
        yield failed
        if view.pool is not None:
            pstats = view.pool.stats
            per_block = stats.kv_bytes_per_block
            yield _gauge("veloxquant_kv_bytes_per_block", "Bytes behind one KV block.", per_block)
            yield _gauge(
                "veloxquant_kv_cache_used_bytes",
                "KV bytes checked out to requests.",
                pstats.blocks_in_use() * per_block,
            )
            fmt = stats.kv_format or "unknown"
            blocks = GaugeMetricFamily(
                "veloxquant_kv_format_blocks",
                "Pool blocks checked out, by the format they hold (--kv-format, --kv-formats).",
                labels=["format"],
            )
            window = stats.kv_window_blocks  # --kv-recent-tokens: blocks in the model's type
            by_format = dict(stats.kv_format_blocks) or {fmt: pstats.blocks_in_use() - window}
            if stats.kv_window_format:
                by_format[stats.kv_window_format] = window
            used = GaugeMetricFamily(
                "veloxquant_kv_format_bytes",
                "KV bytes checked out, by the format the blocks hold (--kv-format, --kv-formats).",
                labels=["format"],
            )
            for name, n in by_format.items():
                blocks.add_metric([name], n)
                used.add_metric([name], n * per_block)
            yield blocks
            yield used
            yield _gauge(
                "veloxquant_kv_cache_capacity_bytes",
                "KV bytes the pool manages.",
                pstats.n_blocks * per_block,
            )
            yield _gauge(
                "veloxquant_kv_cache_usage_ratio",
                "Share of the pool's blocks (as it is now) that running requests hold, 0-1; "
                "cached blocks no request holds are free to any allocation and not counted.",
                min(1.0, stats.blocks_in_use / pstats.n_blocks) if pstats.n_blocks else 0.0,
            )
            yield _gauge(
                "veloxquant_kv_working_set_bytes",
                "Bytes of the batch's KV memory MLX holds (the paged store, or the dense "
                "working set).",
                stats.kv_working_bytes,
            )
            memory = GaugeMetricFamily(
                "veloxquant_mlx_memory_bytes",
                "MLX's memory in the engine's process after its last step: active (arrays "
                "alive: weights, KV, a step's temporaries), cache (freed buffers kept for reuse, "
                "--mlx-cache-limit-mb), peak (the most active at once).",
                labels=["kind"],
            )
            for kind, n in stats.mlx_memory:
                memory.add_metric([kind], n)
            yield memory
            yield _gauge(
                "veloxquant_prefill_budget_tokens",
                "Prompt tokens a step carries at most beside decoding requests, as the engine "
                "last set it (--prefill-budget, moved under --prefill-stall-ratio).",
                stats.prefill_budget,
            )
            yield _counter(
                "veloxquant_preemptions_total",
                "Requests preempted (blocks freed, recomputed later) when the pool ran out.",
                stats.preemptions_total,
            )
            yield _gauge(
                "veloxquant_prefix_cache_blocks",
                "Blocks the prefix cache holds (shared by requests, or evictable).",
                stats.cached_blocks,
            )
            yield _gauge(
                "veloxquant_prefix_cache_evictable_blocks",
                "Cached blocks no request holds: kept for reuse, evicted (LRU) before any "
                "allocation would fail. Counted in the pool's blocks_in_use.",
                stats.evictable_blocks,
            )
            yield _counter(
                "veloxquant_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache (once per request).",
                stats.prefix_queries_total,
            )
            yield _counter(
                "veloxquant_prefix_cache_hits_total",
                "Prompt tokens whose KV came from the prefix cache.",
                stats.prefix_hits_total,
            )
            yield _counter(
                "veloxquant_prefix_cache_evictions_total",
                "Cached pages (a block per layer for K and V) evicted.",
                stats.prefix_evictions_total,
            )
        if stats.prefix_disk:
            yield _gauge(
                "veloxquant_prefix_cache_disk_pages",
                "Prefix-cache pages on disk (--prefix-cache-dir).",
                stats.prefix_disk_pages,
            )
            yield _gauge(
                "veloxquant_prefix_cache_disk_bytes",
                "Bytes of the prefix-cache pages on disk.",
                stats.prefix_disk_bytes,
            )
            yield _counter(
                "veloxquant_prefix_cache_disk_hits_total",
                "Pages loaded from disk into a request's prefill.",
                stats.prefix_disk_hits_total,
            )
            yield _counter(
                "veloxquant_prefix_cache_disk_writes_total",
                "Pages written to disk.",
                stats.prefix_disk_writes_total,
            )
            yield _counter(
                "veloxquant_prefix_cache_disk_dropped_total",
                "Pages not written (the writer was behind, or a write failed).",
                stats.prefix_disk_dropped_total,
            )
            yield _counter(
                "veloxquant_prefix_cache_disk_skipped_total",
                "Files refused at load (corrupt, truncated, or another model's).",
                stats.prefix_disk_skipped_total,
            )

        if self.compat == "vllm":
            yield from _vllm_aliases(view, self.model_name, engine.kv_layers)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _vllm_aliases(view: EngineView, model: str, kv_layers: int) -> Iterator[Metric]:
    """vLLM's names for what routers read (the gateway-api-inference-extension's model-server
    protocol): ``--metrics-compat vllm``. KV usage is the running requests' share of the pool
    as it is now; a vLLM block is one token block here (K and V of every layer)."""
    stats, pool = view.stats, view.pool
    labels = ["model_name"]

    def one(family: GaugeMetricFamily | CounterMetricFamily, value: float) -> Metric:
        family.add_metric([model], value)
        return family

    yield one(GaugeMetricFamily("vllm:num_requests_running", "Requests running.", labels=labels),
              stats.running)  # fmt: skip
    yield one(GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting.", labels=labels),
              stats.waiting)  # fmt: skip
    total = pool.stats.n_blocks if pool is not None else 0
    usage = min(1.0, stats.blocks_in_use / total) if total else 0.0
    yield one(
        GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV usage, 1 is full.", labels=labels),
        usage,
    )
    yield one(
        CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up.", labels=labels),
        stats.prefix_queries_total,
    )
    yield one(
        CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found cached.", labels=labels),
        stats.prefix_hits_total,
    )
    if pool is not None:
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV cache configuration (value is always 1).",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        token_blocks = total // (2 * max(1, kv_layers))
        info.add_metric([str(pool.block_size), str(token_blocks), str(stats.prefix_caching)], 1)
        yield info


def _gauge(name: str, doc: str, value: float | bool) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class Metrics:
    """The app's registry: request latency histograms plus the live collector."""

    def __init__(self, engine: EngineClient, model_name: str, compat: str = "none") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self.engine = engine
        self.ttft = Histogram(
            "veloxquant_time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "veloxquant_inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "veloxquant_request_duration_seconds",
            "Time from request arrival to its last event.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.resent_answers = Counter(
            "veloxquant_resent_answers",
            "Chat prompts encoded with a resent answer's generated tokens (--resent-answers).",
            registry=self.registry,
        )
        self.collector = EngineCollector(engine, model_name, compat)
        self.registry.register(self.collector)

    def observe(self, arrived: float, token_times: list[float], finished: float) -> None:
        if token_times:
            self.ttft.observe(max(0.0, token_times[0] - arrived))
            for a, b in itertools.pairwise(token_times):
                self.itl.observe(max(0.0, b - a))
        self.e2e.observe(max(0.0, finished - arrived))

    def render(self, view: EngineView) -> bytes:
        """The scrape's text, from ``view`` (one read of the engine; a registry collects in one
        thread at a time, so the collector's view is this scrape's)."""
        with self._lock:
            self.collector.view = view
            try:
                text = generate_latest(self.registry)
            finally:
                self.collector.view = None
        if view.pool is not None:
            text += view.pool.stats.to_prometheus().encode()
        return text


def as_dict(stats: Any) -> dict[str, Any]:
    """AllocationStats as plain JSON values (admin view)."""
    return {
        "n_blocks": stats.n_blocks,
        "blocks_in_use": stats.blocks_in_use(),
        "blocks_free": dict(stats._free_by_stream),
        "peak_blocks_in_use": stats.peak_blocks_in_use,
        "fragmentation": stats.fragmentation(),
        "n_allocations": stats.n_allocations,
        "n_frees": stats.n_frees,
        "n_reused": stats.n_reused,
        "n_exhausted": stats.n_exhausted,
        "n_grown": stats.n_grown,
        "n_retired": stats.n_retired,
    }
