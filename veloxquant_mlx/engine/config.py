"""EngineConfig: what the engine loads and how it batches (plain values from Settings)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine loads and how it batches; plain values from Settings."""

    model: str | None = None  # None: the embedded default model
    model_cache_dir: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_mb: float | None = 256.0
    n_blocks: int | None = None
    separate_kv: bool = True
    grow_on_exhaustion: bool = False
    max_blocks: int | None = None
    max_running: int = 32
    max_queue: int = 256
    prefill_step: int = 512
    # Prompt tokens prefilled per engine turn at most (padding included) while some request
    # decodes: each step carries its decode and at most this much prefill, so a long prompt
    # arriving pauses the running streams for one such step at a time. None: the measured
    # choice per backend (model/choices.py PREFILL_BUDGET). More starts a burst sooner, less keeps
    # running streams smoother.
    prefill_budget: int | None = None
    # ... and while no request decodes (nobody's stream waits on the step).
    idle_prefill_budget: int = 2048
    # Move the budget (between a quarter of it and all of it) so that a step carrying prefill
    # takes at most about this many times a decode-only step (loop/prefill_budget.py); 0, the
    # default: a fixed budget (measured better for agent turns: DESIGN-NOTES.md).
    prefill_stall_ratio: float = 0.0
    # Run the shapes the engine will meet before it is ready (loop/warmup.py), so that no
    # request pays a kernel compile: "on", "off", or "auto" (on a GPU). Not in a group (the
    # ranks step together from rank 0).
    warm_up: str = "auto"
    warm_up_context: int = 0  # tokens of the warm-up's long conversation (0: none)
    # Seconds between deliveries of one request's tokens (the first token goes at once): each
    # delivery wakes the consumer's thread, which on a small CPU competes with decoding.
    stream_interval: float = 0.025
    # Where running rows' KV lives: "paged" (the pool's blocks, read through block tables),
    # "dense" (a contiguous working set, O(row) joins and leaves), "auto" (the measured best).
    kv_layout: str = "auto"
    # How the pool's blocks hold K and V (kv/codec.py): "auto" (the model's float type),
    # "int8" / "int4" (group-wise quantized, read by quantized attention; the dense layout).
    kv_format: str = "auto"
    # What else a request may ask for (``GenerationRequest.kv_format``), as --kv-format names;
    # () : kv_format only. The rows of each format are kept apart in one batch (kv/mixed.py).
    kv_formats: tuple[str, ...] = ()
    # Values per scale and bias of a quantized format (32 or 64); None: 64 where it divides
    # the model's head_dim, else 32.
    kv_group_size: int | None = None
    # A quantized format's residual window: each row's newest tokens also kept in the model's
    # float type (the windows of max_running rows are set aside from kv_cache_mb). 0: none.
    kv_recent_tokens: int = 0
    # How a decode step whose rows sit at different positions attends (kv/attention.py):
    # "sdpa" (MLX's, masked), "matmul" (KV heads' query heads as one product's rows), "auto"
    # (the measured best: matmul on a GPU, sdpa on a CPU).
    ragged_attention: str = "auto"
    # The softmax of the engine's attention (kv/attention.py): "exp" (MLX's), "exp2" (powers
    # of two), "auto" (exp2 on a CPU, where MLX's exp is slow; exp on a GPU).
    attention_softmax: str = "auto"
    # How the engine's prefill chunks attend (kv/attention.py): "sdpa" (MLX's), "matmul"
    # (grouped products), "buckets" (MLX's over bucketed shapes), "auto" (buckets on CUDA,
    # where cuDNN builds a graph per new shape: the warm-up builds the buckets').
    prefill_attention: str = "auto"
    # How sampled rows' top_p / top_k cut is found ("sort", "histogram" or "auto";
    # request/sampling.py, model/choices.py sampling_cut).
    sampling_cut: str = "auto"
    # Prefill widths padded to a multiple of this (cuBLAS plans per shape); None: 64 on CUDA,
    # 0 (none) elsewhere (kv/attention.py).
    prefill_bucket: int | None = None
    # MiB of freed buffers MLX keeps for reuse (mx.set_cache_limit); None: 4 GiB on CUDA,
    # MLX's default elsewhere (model/choices.py mlx_cache_limit).
    mlx_cache_limit_mb: int | None = None
    # Prefill forwards on an MLX stream of their own (loop/runner.py): "on", "off", "auto"
    # (the measured best per backend: on with CUDA; model/choices.py's PREFILL_STREAM).
    prefill_stream: str = "auto"
    # With prefill on its own stream, when a prefilled row joins the batch (loop/join_clock.py):
    # "now" (the step built with its last chunk, which then waits for that chunk), "ready"
    # (the first step built once its prefill is probably done on the device).
    prefill_join: str = "now"
    # Launch a prompt's chunk over this many engine turns while other rows decode, a run of
    # its layers a turn (loop/layer_capture.py): each of their steps then waits for a part of
    # the chunk's launches, not all. 1: the whole chunk in one turn; "adaptive": as many as
    # keep a turn within twice a decode-only one (loop/prefill_parts.py); "auto": the measured
    # best per backend (model/choices.py).
    prefill_parts: int | str = "auto"
    # Each layer's q/k/v and gate/up projections as one matmul each (model/fused_linear.py):
    # "on" (where a probe gives the same logits), "off".
    fused_projections: str = "on"
    # Decode steps over the dense layout run the model's forward compiled (kv/compiled_step.py):
    # "on", "off", "auto" (the measured best per backend: model/choices.py's COMPILED_STEP).
    compiled_step: str = "auto"
    # How the paged layout's decode attention reads the blocks (kv/paged_attention.py):
    # "gather" (copies of each row's blocks, then MLX's attention), "fused" (through the block
    # tables where they lie: a CUDA kernel; elsewhere the same in MLX ops).
    paged_attention: str = "gather"
    # How quantized KV rows attend (kv/quantized_attention.py): "mlx" (mlx_lm's quantized
    # attention), "fused" (one kernel a layer reading the codes: CUDA; elsewhere MLX ops),
    # "auto" (fused where the kernel runs: model/kv_routes.py quantized_kernel).
    quantized_attention: str = "auto"
    # Launch a decode step only once the previous one has finished (its graph is built while
    # it runs). False launches at once, one step ahead of the tokens being read, as mlx_lm's
    # BatchGenerator does (the dense layout's choice, measured faster). None: the layout's
    # choice (kv.paged; BENCHMARKS.md, "The paged store launched after the previous step").
    launch_after_previous: bool | None = None
    # Share full KV blocks between requests with the same token prefix (loop/prefix_cache.py).
    prefix_caching: bool = True
    # Cache a leaving row's generated pages too (the next turn resends the answer): "on",
    # "off", or "auto": always where the layout keeps pages in the pool's blocks (paged); in
    # the dense layout, which copies them out of its working set, while at most
    # model/choices.py ANSWERS_UP_TO requests run.
    prefix_cache_answers: str = "auto"
    # The prefix cache's disk tier (loop/disk_tier.py): pages leaving memory, and every
    # cached page at a clean stop, are written under this directory and loaded back on a
    # hit, so a conversation survives a restart; capped at ``prefix_cache_disk_gb``.
    prefix_cache_dir: str | None = None
    prefix_cache_disk_gb: float = 10.0
    # At start, before ready, read the disk tier's most recent conversations into the memory
    # cache, up to this many GiB of KV (None: half the pool; 0: none), so a restarted
    # server's first turns hit memory (loop/preload.py).
    prefix_cache_preload_gb: float | None = None
    # The smallest request the pool must be able to hold, or the engine refuses to start
    # (a server that would answer every request with 400 is a configuration error).
    min_request_tokens: int = 2
    # A Jinja chat template (its text) to use instead of the model's (--chat-template).
    chat_template: str | None = None
    # Join the mx.distributed group this process was launched into (engine/loop/group.py): rank 0
    # serves, every rank runs the same steps on its shard. ``pipeline``: split the layers
    # (model.model.pipeline) instead of the tensors (model.shard).
    distributed: bool = False
    pipeline: bool = False
    # Seconds one turn may wait on the other ranks before the group is declared dead (a rank
    # stopped or cut off); an idle leader broadcasts an empty turn every ``heartbeat`` seconds.
    group_timeout: float = 300.0
    heartbeat: float = 1.0
