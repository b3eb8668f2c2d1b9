"""The settings of how the engine runs on its hardware: attention routes, sampling's cut,
prefill's stream and padding, MLX's memory and CUDA graphs, the BLAS and the GIL. Each is a flag
and a ``VQ_`` variable of ``Settings``, which takes them from here; unset or ``auto``, each is
the measured best for the backend (``engine/model/choices.py``, DESIGN-NOTES.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class TuningSettings(BaseModel):
    """Hardware tuning (a part of ``Settings``)."""

    ragged_attention: Literal["auto", "sdpa", "matmul"] = Field(
        "auto",
        description="Attention of a decode step whose rows sit at different positions: sdpa "
        "(MLX's, with a mask), matmul (each KV head's query heads as one product's rows), auto "
        "(the measured best: matmul on a GPU, sdpa on a CPU).",
    )
    attention_softmax: Literal["auto", "exp", "exp2", "host"] = Field(
        "auto",
        description="The softmax of the engine's attention (prefill and decode): exp (MLX's), "
        "exp2 (as powers of two: MLX's CPU exp is about 2.5x slower than its power), host "
        "(exp2, and a prefill chunk's powers taken by numpy on the host: 4x faster than "
        "MLX's on a CPU), auto (host on a CPU, exp on a GPU).",
    )
    sampling_cut: Literal["auto", "sort", "histogram"] = Field(
        "auto",
        description="How sampled rows' top_p / top_k cut is found: sort (one sort of the "
        "step's logits), histogram (the probability mass at each of the 65,536 values of "
        "16-bit logits, summed from the top: the same tokens, no sort), auto (sort). On a CPU "
        "every sampled row is drawn on the host, which sorts only rows whose drawn token "
        "top_p may cut, whatever this says.",
    )
    prefill_attention: Literal["auto", "sdpa", "matmul", "buckets"] = Field(
        "auto",
        description="How a prefill chunk attends: sdpa (MLX's; on CUDA cuDNN, which builds a "
        "graph for every new chunk and context length, 20-70 ms), matmul (plain products, "
        "KV heads' query heads as rows, MLX's softmax), buckets (MLX's over the keys padded "
        "to one of 4 lengths an octave, so cuDNN meets a bounded number of shapes, built by "
        "the warm-up), auto (buckets on CUDA, sdpa elsewhere).",
    )
    prefill_bucket: int | None = Field(
        None,
        ge=0,
        le=4096,
        description="Pad each prefill's tokens to a multiple of this (the padding is never "
        "seen by the prompt and is dropped after): CUDA plans every product per shape, ~5 ms "
        "the first time; unset: 64 on CUDA, 0 (no padding) elsewhere.",
    )
    mlx_cache_limit_mb: int | None = Field(
        None,
        ge=0,
        description="MiB of freed device buffers MLX keeps for reuse (mx.set_cache_limit); "
        "unset: 4096 on CUDA, where MLX's own limit (0.8 of the device) let a long-running "
        "server run out of device memory, MLX's default elsewhere.",
    )
    prefill_stream: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Run prefill forwards on an MLX stream of their own, so a decode step does "
        "not queue behind a prompt's chunk on the device: on, off, auto (the measured best per "
        "backend: on with CUDA, off on a CPU and, not measured, on Metal).",
    )
    prefill_join: Literal["now", "ready"] = Field(
        "now",
        description="With prefill on a stream of its own, when a prefilled request joins the "
        "decode batch: now (the step built with its last chunk, which waits for it), ready "
        "(the first step built once its prefill is probably done on the device; on an H100 "
        "the agent benchmark's TTFT p50 was 15-40% higher and its inter-token p99 no lower "
        "but in one of two 8B runs).",
    )
    prefill_parts: str = Field(
        "auto",
        pattern=r"^(auto|adaptive|[1-9]|1[0-6])$",
        description="While other requests decode, launch a prompt's chunk over this many "
        "steps (1 to 16), a run of its layers each, so each of their steps waits for a part "
        "of the chunk instead of all of it; 1: the whole chunk in one step; adaptive: the "
        "fewest parts that keep a step carrying one within twice a decode-only step, learned "
        "from the steps; auto: adaptive on CUDA, 1 on a CPU and on Metal.",
    )
    fused_projections: Literal["on", "off"] = Field(
        "on",
        description="Run each layer's q/k/v projections as one matmul and its gate/up "
        "projections as another (their weights concatenated at load), where the model's "
        "own forward made five: on (kept only where a probe forward gives the same logits), "
        "off. Never in an mx.distributed group.",
    )
    compiled_step: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Run a decode step's model forward as one compiled MLX function (traced "
        "once per batch shape, element-wise chains fused), which spares the host building "
        "the step op by op: on, off, auto (the measured best per backend). The dense KV "
        "layout only; a model whose forward does not compile steps eagerly, with one log line.",
    )
    paged_attention: Literal["gather", "fused"] = Field(
        "gather",
        description="How the paged layout's decode steps read the blocks: gather (copies of each "
        "row's blocks, then MLX's attention), fused (attention through the block tables where "
        "the blocks lie: one CUDA kernel a layer on MLX's CUDA backend, the same in MLX ops "
        "elsewhere). Needs --kv-layout paged.",
    )
    quantized_attention: Literal["auto", "mlx", "fused"] = Field(
        "auto",
        description="How --kv-format int8/int4 rows attend in a decode step: mlx (mlx_lm's "
        "quantized attention, MLX's quantized products), fused (one kernel a layer that reads "
        "each row's own codes: on MLX's CUDA backend a kernel of this server's; the same in MLX "
        "ops elsewhere), auto (fused on CUDA, where MLX 0.32.4's own route computed wrong "
        "outputs; mlx elsewhere). Either is checked against the dequantized attention at start.",
    )
    cuda_graph_ops: int | None = Field(
        None,
        ge=1,
        le=254,
        description="On MLX's CUDA backend: operations per CUDA graph it launches "
        "(MLX_MAX_OPS_PER_BUFFER; MLX's default 20); unset: MLX's default. An "
        "MLX_MAX_OPS_PER_BUFFER already in the environment wins.",
    )
    cuda_graph_cache: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="On MLX's CUDA backend: CUDA graphs it keeps instantiated for reuse "
        "(MLX_CUDA_GRAPH_CACHE_SIZE); unset: MLX's default. The environment's value wins.",
    )
    cuda_thrashing_check: bool = Field(
        False,
        description="On MLX's CUDA backend: its caches' lifetime fuse "
        "(MLX_ENABLE_CACHE_THRASHING_CHECK). On, a process that has met more than twice a "
        "cache's capacity of new shapes (CUDA graphs, cuDNN attention graphs) fails every "
        "later new one, and a failed commit can leave MLX's command encoder unusable; a "
        "server meets new shapes for as long as it runs, so off (the caches still evict). "
        "The environment's value wins.",
    )
    cuda_sdpa_cache: int | None = Field(
        1024,
        ge=1,
        le=100_000,
        description="On MLX's CUDA backend: cuDNN attention graphs it keeps for reuse "
        "(MLX_CUDA_SDPA_CACHE_SIZE; MLX's default 256), one per prefill shape met; unset: "
        "MLX's default. The environment's value wins.",
    )
    gil_switch_interval_ms: float | None = Field(
        None,
        gt=0,
        le=100,
        description="How often Python hands the GIL between the event loop and the engine "
        "thread (sys.setswitchinterval); unset: Python's 5 ms.",
    )
    blas: str = Field("auto", description="auto | off | PATH: optimized BLAS for MLX on Linux.")
    blas_gemv: bool = Field(
        False,
        description="Experimental, Linux CPU: build (with the C compiler) and preload the gemv "
        "forwarder in front of the optimized BLAS (few-row float32 matmuls go to sgemv).",
    )
