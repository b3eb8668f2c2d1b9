"""Plain values the engine trades with its callers: requests, events, stats, errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from veloxquant_mlx.pool import AllocationStats, BlockPoolAllocator

if TYPE_CHECKING:
    from veloxquant_mlx.engine.request.grammar import Grammar


class EngineError(RuntimeError):
    """Base of the errors ``Engine.submit`` raises; ``reason`` is a stable, metric-safe label."""

    reason = "error"


class QueueFullError(EngineError):
    """The waiting queue is at its bound; try again later (HTTP 429)."""

    reason = "queue_full"


class RequestTooLargeError(EngineError, ValueError):
    """The request can never be served: over the context window or the whole pool (HTTP 400).
    Over the window, ``context`` is (prompt tokens, max_tokens, the window): the Messages API
    words it as Anthropic does, which clients parse."""

    reason = "too_large"

    def __init__(self, message: str, context: tuple[int, int, int] | None = None) -> None:
        super().__init__(message)
        self.context = context


class CapacityReducedError(EngineError):
    """The request fits the pool as configured, but not as an operator has shrunk it (HTTP 503)."""

    reason = "capacity"


class EngineNotReadyError(EngineError):
    """The engine is still loading, draining or dead (HTTP 503)."""

    reason = "not_ready"


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot run as given (a token id or sampling value out of the model's
    range): the caller's mistake, found before it reaches the engine thread (HTTP 400).
    ``param`` names the offending field."""

    reason = "invalid"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# Why a request ended without a result (``FinishEvent.error_code``): a stable label that the
# server maps to an HTTP status (errors.py) and that the metrics count.
CAPACITY_REDUCED = "capacity_reduced"  # a shrink left the pool too small for it (503)
DRAINING = "draining"  # the server is shutting down (503)
REQUEST_FAILED = "request_failed"  # this request's own sampler/processor/text failed (500)
ENGINE_FAILED = "engine_failed"  # the engine itself failed; the process exits (503)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. ``temperature=0`` is greedy; ``seed`` makes sampling reproducible,
    alone or batched (each request draws from its own random key).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    # mx.random.key takes an unsigned 64-bit seed; negative seeds (valid for OpenAI and vLLM
    # clients) are taken modulo 2**64.
    SEED_MIN: ClassVar[int] = -(2**63)
    SEED_MAX: ClassVar[int] = 2**64 - 1
    # The API's bounds (server/schemas.py reads them): one range at the edge and here.
    TEMPERATURE_MAX: ClassVar[float] = 2.0
    REPETITION_PENALTY_MAX: ClassVar[float] = 10.0

    def __post_init__(self) -> None:
        checks = (
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0),
            ("temperature", 0.0 <= self.temperature <= self.TEMPERATURE_MAX),
            ("top_p", 0.0 < self.top_p <= 1.0),
            ("top_k", self.top_k >= 0),
            ("min_p", 0.0 <= self.min_p <= 1.0),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= self.REPETITION_PENALTY_MAX),
            ("seed", self.seed is None or self.SEED_MIN <= self.seed <= self.SEED_MAX),
        )
        for name, ok in checks:
            value = getattr(self, name)
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"{name} out of range: {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def key_seed(self) -> int | None:
        """``seed`` as the unsigned 64-bit value ``mx.random.key`` accepts."""
        return None if self.seed is None else self.seed % 2**64


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One completion to run: token ids in, up to ``max_tokens`` out.

    ``stop`` strings end generation when they appear in the text (matched across token
    boundaries; never emitted). ``logprobs`` asks for the sampled token's logprob and the
    ``top_logprobs`` most likely alternatives with every token. ``grammar`` (compiled by the
    engine's ``GrammarCompiler`` off the engine thread) constrains the output to it; generation
    ends when it is complete.
    """

    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Grammar | None = None
    # The client request it belongs to (its n choices of each prompt share one): while others
    # wait, a group gets a fair share of the running slots and the prefill budget. 0: its own.
    group: int = 0
    # How its KV is stored: "" the server's --kv-format; another of --kv-formats by its
    # canonical name ("int8", "int4", "bfloat16", ...; ``checks.resolve_kv_format``).
    kv_format: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError("prompt_tokens must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token: its id, the text it completes (may be empty while a multi-byte
    character or a possible stop string is held back) and, if asked, logprobs."""

    token_id: int
    text: str
    time: float
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a finished request, and the most KV it held at once."""

    prompt_tokens: int
    completion_tokens: int
    peak_kv_blocks: int
    peak_kv_bytes: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class FinishEvent:
    """The last event of a request. ``finish_reason``: "stop" (EOS or a stop string), "length"
    (max_tokens), "cancelled" (the caller cancelled it: nobody is listening), or "error" (then
    ``error`` says why, for the client, and ``error_code`` is one of CAPACITY_REDUCED, DRAINING,
    REQUEST_FAILED, ENGINE_FAILED)."""

    finish_reason: str
    usage: Usage
    time: float
    text: str = ""  # text released at the end (held back for a stop string that did not match)
    error: str | None = None
    error_code: str | None = None
    refusal: Refusal | None = None  # refused before it ran (an engine in its own process)
    stop_string: str | None = None  # the request's stop string that ended it, if one did


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSnapshot:
    """What the engine loop publishes after each turn that changed something (engine thread
    writes, any thread reads; it crosses the engine process's pipe as it is)."""

    running: int = 0
    waiting: int = 0
    blocks_in_use: int = 0  # K + V blocks the running requests hold (shared pages once)
    preemptions_total: int = 0
    kv_layout: str = ""  # "paged" or "dense" (kv.paged)
    kv_format: str = ""  # what the blocks hold: the model's float type, "int8" or "int4"
    kv_window_format: str = ""  # the residual windows' (--kv-recent-tokens): the float type
    kv_window_blocks: int = 0  # pool blocks the running rows' windows hold (in blocks_in_use)
    # With --kv-formats: pool blocks held by the format they hold ((format, blocks) pairs:
    # running requests' and the cache's); () with one format.
    kv_format_blocks: tuple[tuple[str, int], ...] = ()
    ragged_attention: str = ""  # "sdpa", "matmul" or "matmul>=N" (kv.attention)
    kv_working_bytes: int = 0  # bytes of the batch's KV memory MLX holds now
    # MLX's memory in the engine's process (mx.get_active_memory, get_cache_memory,
    # get_peak_memory): arrays alive, freed buffers kept for reuse, the most alive at once
    mlx_memory: tuple[tuple[str, int], ...] = ()
    prefix_caching: bool = False
    cached_blocks: int = 0  # blocks the prefix cache holds (some may be held by requests too)
    evictable_blocks: int = 0  # cached blocks no request holds: free for any allocation
    prefix_queries_total: int = 0  # prompt tokens looked up
    prefix_hits_total: int = 0  # of them, found cached
    prefix_evictions_total: int = 0  # cached pages evicted (pressure, shrink, reset)
    prefix_disk: bool = False  # the disk tier is on (--prefix-cache-dir)
    prefix_disk_pages: int = 0  # pages on disk
    prefix_disk_bytes: int = 0  # their bytes
    prefix_disk_hits_total: int = 0  # pages loaded from disk
    prefix_disk_writes_total: int = 0  # pages written
    prefix_disk_dropped_total: int = 0  # pages not written (the writer behind, a failed write)
    prefix_disk_skipped_total: int = 0  # files refused at load (corrupt, foreign)
    waiting_tokens: int = 0  # prompt tokens the waiting requests still have to prefill
    prefill_budget: int = 0  # prompt tokens a step carries at most beside decoding rows, now
    # False once a shrink left the pool unable to hold the smallest request the engine was
    # started to serve (``EngineConfig.min_request_tokens``): /ready then answers 503
    holds_a_request: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats(StepSnapshot):
    """The engine's last ``StepSnapshot`` with its host's state and the request counters."""

    alive: bool = False
    ready: bool = False
    draining: bool = False
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    requests_finished_total: dict[str, int] = field(default_factory=dict)
    rejections_total: dict[str, int] = field(default_factory=dict)
    failures_total: dict[str, int] = field(default_factory=dict)  # by FinishEvent.error_code
    kv_bytes_per_block: int = 0

    @classmethod
    def of(cls, step: StepSnapshot, **rest: Any) -> EngineStats:
        """``step``'s fields as they are, and ``rest`` (the fields only a host knows)."""
        return cls(**{f.name: getattr(step, f.name) for f in fields(StepSnapshot)}, **rest)


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pool as it was at one moment: what ``/metrics`` and ``/admin/pool`` show. Plain
    values (it crosses threads, and processes when the engine runs in its own)."""

    block_size: int
    separate_kv: bool
    stats: AllocationStats
    free: dict[str, int]  # free blocks per stream ("k", "v") or ("kv",)
    total: dict[str, int]  # blocks managed per stream
    owners: dict[str, int]  # owner id (as text) -> blocks held

    @classmethod
    def of(cls, pool: BlockPoolAllocator) -> PoolView:
        """A view of ``pool`` through its thread-safe methods (any thread)."""
        streams = pool.streams
        return cls(
            block_size=pool.config.block_size,
            separate_kv=pool.config.separate_kv,
            stats=pool.stats,
            free={s: pool.n_free(s) for s in streams},
            total={s: pool.n_total(s) for s in streams},
            owners={str(owner): n for owner, n in pool.owner_block_counts().items()},
        )


@dataclass(frozen=True, slots=True)
class EngineView:
    """Counters and pool at one moment (``Engine.view``): one read per scrape or admin call."""

    stats: EngineStats
    pool: PoolView | None
    age_s: float = 0.0  # how old it is when the engine did not answer (an engine process)


REFUSALS: dict[str, type[EngineError]] = {
    e.reason: e
    for e in (
        QueueFullError,
        RequestTooLargeError,
        CapacityReducedError,
        EngineNotReadyError,
        InvalidRequestError,
    )
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the engine refused before running it, as a value (it crosses the engine
    process's pipe in a ``FinishEvent``): the error's ``reason``, message and field."""

    reason: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: EngineError) -> Refusal:
        return cls(error.reason, str(error), getattr(error, "param", None))

    def error(self) -> EngineError:
        kind = REFUSALS.get(self.reason, EngineNotReadyError)
        if kind is InvalidRequestError:
            return InvalidRequestError(self.message, self.param)
        return kind(self.message)


def rejection_of(finish: FinishEvent) -> EngineError | None:
    """The refusal a FinishEvent carries, as the error ``submit`` would have raised, or None."""
    return None if finish.refusal is None else finish.refusal.error()


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """What the server shows of the group: ``world_size`` 1 is a single process."""

    world_size: int = 1
    rank: int = 0
    mode: str = "none"  # "tensor", "pipeline" or "none"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine is, fixed at load and sent once when it is ready (by every host: it
    crosses the engine process's pipe as it is)."""

    model_name: str
    model_path: str
    vocab_size: int
    context_window: int | None  # the model's maximum positions, None if it does not say
    kv_bytes_per_block: int
    kv_layers: int  # layers whose K and V take pool blocks
    block_size: int
    kv_layout: str  # "dense" or "paged"
    blas: str
    device: str
    group: GroupInfo = field(default_factory=GroupInfo)
    chat_template: str | None = None  # --chat-template's text: the host's tokenizer uses it too
    # The KV formats a request may ask for (canonical names, kv.codec): the server's own
    # first, then the rest of --kv-formats.
    kv_formats: tuple[str, ...] = ()
    # The disk tier's directory for this model (--prefix-cache-dir, keyed by the model's
    # files): the server keeps its remembered answers there too. None: no disk tier.
    disk_dir: str | None = None
