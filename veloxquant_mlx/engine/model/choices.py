"""Choices the settings leave to the engine, made per backend and layout by measurement:
the prefill budget beside decoding, prefill on a stream of its own, which answers are cached,
how much freed memory MLX keeps (DESIGN-NOTES.md names the measurements)."""

from __future__ import annotations

import logging

import mlx.core as mx

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.kv import attention

log = logging.getLogger("veloxquant.engine")


# Prompt tokens a step carries at most while other rows decode, per backend, when
# --prefill-budget is unset (DESIGN-NOTES.md, "Prefill beside decoding").
PREFILL_BUDGET = {"cpu": 64, "gpu": 512}


# In the dense layout, ``--prefix-cache-answers auto`` caches a leaving row's generated pages
# while at most this many requests run: each copy out of the working set makes the next step
# wait for it before its launch (``PageCopies.copied_out``), a cost that grows with the batch (at
# 128 clients a row leaves almost every step), while agents run a few sessions.
ANSWERS_UP_TO = 16


def answers_up_to(mode: str, keeps_pages: bool) -> int | None:
    """The running requests up to which a leaving row's answer is cached (None: always)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"prefix_cache_answers must be auto, on or off, got {mode!r}")
    if mode == "on" or (mode == "auto" and keeps_pages):
        return None
    return 0 if mode == "off" else ANSWERS_UP_TO


def _backend() -> str:
    """MLX's default device's backend: "cpu", "cuda" or "metal"."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if attention.cuda_available() else "metal"


def _switch(name: str, value: str, auto: dict[str, bool]) -> bool:
    """An auto / on / off setting: on or off as given, ``auto[backend]`` for auto."""
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{name} must be auto, on or off, got {value!r}")
    return auto[_backend()] if value == "auto" else value == "on"


# Whether prefill forwards run on a stream of their own, per backend, under --prefill-stream
# auto (DESIGN-NOTES.md, "Prefill on a stream of its own"): measured faster on CUDA, slower on
# this CPU, not measured on Metal.
PREFILL_STREAM = {"cpu": False, "cuda": True, "metal": False}


def prefill_stream(cfg: EngineConfig, keeps_pages: bool = False, grouped: bool = False) -> bool:
    """Whether prefill forwards run on a stream of their own. Never over mx.distributed
    (``grouped``: every rank must run the collectives in one order) nor where the layout
    ``keeps_pages`` (paged: a prefill reads cached pages from the blocks that decode steps
    write in place, an order only one stream keeps); one log line if ``on`` was asked for."""
    wanted = _switch("prefill_stream", cfg.prefill_stream, PREFILL_STREAM)
    if wanted and (grouped or keeps_pages):
        if cfg.prefill_stream == "on":
            why = "an mx.distributed group" if grouped else "the paged layout"
            log.info("--prefill-stream on: prefill stays on the decode steps' stream in %s", why)
        return False
    return wanted


# Whether decode steps over the dense layout run the model's forward compiled, per backend,
# under --compiled-step auto (DESIGN-NOTES.md, "A compiled decode step"): measured faster on
# this CPU; not measured yet on CUDA or Metal.
COMPILED_STEP = {"cpu": True, "cuda": False, "metal": False}
# The positions a compiled step reads, in chunks of (kv/compiled_step.py): a GPU's matmuls plan
# per shape; a CPU pays for every masked position read.
COMPILED_READ_CHUNK = {"cpu": 32, "gpu": 128}


def compiled_read_chunk() -> int:
    return COMPILED_READ_CHUNK["cpu" if _backend() == "cpu" else "gpu"]


def compiled_step(cfg: EngineConfig, grouped: bool = False) -> bool:
    """Whether decode steps run the model's forward compiled (``kv.compiled_step``). Never in
    an mx.distributed group (every rank would have to trace alike); one log line if ``on``
    was asked for there."""
    wanted = _switch("compiled_step", cfg.compiled_step, COMPILED_STEP)
    if wanted and grouped:
        if cfg.compiled_step == "on":
            log.info("--compiled-step on: decode steps run eagerly in an mx.distributed group")
        return False
    return wanted


# The parts a chunk beside decoding rows is launched in under --prefill-parts auto, per
# backend (None: adaptive, as many as keep a turn within twice a decode-only one:
# engine/loop/prefill_parts.py; DESIGN-NOTES.md, "A chunk launched a run of layers a step"):
# on an H100 adaptive brought the agent benchmark's inter-token p99 from 4.0x to 2.7x its
# median at 8B (0.97x the throughput) and from 4.4-4.8x to 3.0-3.6x at 1B; on this CPU parts
# traded the arriving prompt's first token for the others' smoothness about as a smaller
# budget does; Metal is not measured.
PREFILL_PARTS: dict[str, int | None] = {"cpu": 1, "cuda": None, "metal": 1}


def prefill_parts(cfg: EngineConfig, grouped: bool = False) -> int | None:
    """The parts a chunk beside decoding rows is launched in (None: as many as the turns show
    are needed: ``adaptive``, or ``auto`` where that is the backend's). Never learned in an
    mx.distributed group (``grouped``): every rank plans each step alike, and each rank's own
    clock would make their plans differ."""
    value = str(cfg.prefill_parts)
    if value in ("auto", "adaptive"):
        parts = PREFILL_PARTS[_backend()] if value == "auto" else None
        return 1 if parts is None and grouped else parts
    if not value.isdigit() or not 1 <= int(value) <= 16:
        raise ValueError(f"prefill_parts must be auto, adaptive or 1 to 16, got {value!r}")
    return int(value)


def prefill_join(cfg: EngineConfig) -> bool:
    """Whether a prefilled row joins once its prefill is probably done (``ready``; ``now``,
    the default, joins it to the step built with its last chunk), where prefill runs on a
    stream of its own (elsewhere the step queues behind the prefill either way)."""
    if cfg.prefill_join not in ("ready", "now"):
        raise ValueError(f"prefill_join must be ready or now, got {cfg.prefill_join!r}")
    return cfg.prefill_join == "ready"


def prefill_budget(cfg: EngineConfig) -> int:
    if cfg.prefill_budget is not None:
        return cfg.prefill_budget
    return PREFILL_BUDGET["cpu" if mx.default_device() == mx.cpu else "gpu"]


def prefill_stall_ratio(cfg: EngineConfig, grouped: bool = False) -> float:
    """The stall ratio the scheduler's budget follows (0, the default: fixed; DESIGN-NOTES.md,
    "A budget that follows the steps", says why). Never in an mx.distributed
    group (``grouped``): every rank plans each step from the same turns, and a budget moved by
    each rank's own clock would make their plans differ; one log line if it was asked for."""
    if grouped:
        if cfg.prefill_stall_ratio:
            log.info("--prefill-stall-ratio: the prefill budget stays fixed in a group")
        return 0.0
    return cfg.prefill_stall_ratio


def sampling_cut(cfg: EngineConfig) -> str:
    """How sampled rows' top_p / top_k cut is found: ``--sampling-cut``, "auto" being the sort.
    The histogram cut took 0.2 / 1.1 / 3.0 ms a step at 1 / 32 / 128 rows of 128,256 bf16
    logits on an H100 against 0.5 / 1.3 / 2.9 for the sort, but through the server the
    sampled/greedy ratio swung more between passes than that (BENCHMARKS.md, "The disk tier's
    one-copy read"): opt-in until a serving run shows the gain. (The servers those runs lost
    ran out of device memory, the sort's as well: ``mlx_cache_limit``.)"""
    return "sort" if cfg.sampling_cut == "auto" else cfg.sampling_cut


# MLX's buffer cache on CUDA under --mlx-cache-limit-mb unset, in MiB. MLX keeps freed
# buffers for reuse up to its memory limit (0.8 of the device's), and on CUDA it allocates
# from a stream-ordered pool that keeps freed memory reserved too: a server meeting buffers of
# ever new sizes (prompts, contexts, batch widths) filled an 80 GB H100 and died of
# cudaMallocAsync's "out of memory" with a 1B model and an 8 GiB KV pool (BENCHMARKS.md,
# "MLX's buffer cache on CUDA"). A step's own temporaries fit this many times over.
CUDA_CACHE_LIMIT_MB = 4096


def mlx_cache_limit(cfg: EngineConfig) -> int | None:
    """Bytes of freed buffers MLX may keep for reuse (``mx.set_cache_limit``), or None to
    leave MLX's default: ``--mlx-cache-limit-mb``, else ``CUDA_CACHE_LIMIT_MB`` on CUDA."""
    if cfg.mlx_cache_limit_mb is not None:
        return cfg.mlx_cache_limit_mb * 2**20
    if mx.default_device() != mx.cpu and attention.cuda_available():
        return CUDA_CACHE_LIMIT_MB * 2**20
    return None
