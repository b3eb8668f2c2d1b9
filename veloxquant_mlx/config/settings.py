"""Server settings from ``VQ_*`` environment variables and ``--flags`` of the same names."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from veloxquant_mlx.config.edge import EdgeSettings
from veloxquant_mlx.config.launch import launched_rank
from veloxquant_mlx.config.tuning import TuningSettings


class ServingFields(BaseModel):
    """What the server serves and how: the model, the KV pool and its requests, prefix caching,
    the engine's host, keys, logs (a part of ``Settings``)."""

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port).")
    model: str | None = Field(
        None, description="Local mlx_lm model directory; the embedded tiny model when unset."
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template to use instead of the model's: a file's path, or "
        "the template itself (as vLLM and mlx_lm.server take it). Its tool-call format is "
        "recognised as a model's own is.",
    )
    served_model_name: str | None = Field(
        None, description="Model id in the API (default: the model directory's name)."
    )
    model_aliases: str = Field(
        "",
        description="Comma-separated other model ids requests may name, shell-style patterns "
        "allowed: e.g. 'claude-*' serves every model Claude Code asks for (its main and "
        "background models) with this one. Ids without a pattern are listed in /v1/models.",
    )
    model_cache_dir: str | None = Field(
        None,
        description="Where the embedded default model is made (default ~/.cache/veloxquant-mlx).",
    )
    dtype: Literal["auto", "model", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights dtype; auto = float32 on a CPU, as stored on a GPU."
    )
    block_size: int = Field(16, ge=1, le=4096, description="Token slots per KV block.")
    kv_cache_mb: float | None = Field(
        256.0, gt=0, description="KV memory budget in MiB (ignored when --n-blocks is set)."
    )
    n_blocks: int | None = Field(None, ge=1, description="Pool size in blocks (K + V).")
    separate_kv: bool = Field(True, description="Separate K and V free lists.")
    grow_on_exhaustion: bool = Field(False, description="Let the pool grow up to --max-blocks.")
    max_blocks: int | None = Field(None, ge=1, description="Cap on blocks when growing.")
    max_running: int = Field(32, ge=1, le=1024, description="Requests decoded together at most.")
    max_queue: int = Field(256, ge=1, description="Requests waiting at most (then 429).")
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="max_tokens when a request omits it; unset: to EOS or the context end "
        "(4096 for a model that states no context length).",
    )
    max_n: int = Field(
        8, ge=1, le=128, description="Choices per request at most (n), and prompts per request."
    )
    prefill_step: int = Field(512, ge=16, description="Prompt tokens per prefill chunk.")
    prefill_budget: int | None = Field(
        None,
        ge=16,
        description="Prompt tokens prefilled per step at most while other requests decode (a "
        "long prompt arriving pauses their streams for a step of about this many tokens); "
        "unset: the measured choice per backend (64 on a CPU, 512 on a GPU).",
    )
    idle_prefill_budget: int = Field(
        2048,
        ge=16,
        description="Prompt tokens prefilled per step at most while no request decodes.",
    )
    prefill_stall_ratio: float = Field(
        0.0,
        ge=0,
        le=100,
        description="Move the prefill budget, between a quarter of --prefill-budget and all of "
        "it, so that a step carrying prefill beside decoding requests takes at most about this "
        "many times a step of decoding alone (their inter-token gap), while at most 16 requests "
        "decode; 0 (the default): a fixed budget (measured better for agent turns; "
        "docs/configuration.md).",
    )
    warm_up: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Run the batch sizes and prefill shapes the engine will meet before /ready "
        "answers 200, so that no request pays a kernel compile; auto: on a GPU (on a CPU the "
        "first burst costs ~70 ms more, the warm-up 2-3 s of start).",
    )
    warm_up_context: int = Field(
        0,
        ge=0,
        description="Tokens of a long conversation the warm-up also runs (a prompt prefilled in "
        "chunks beside a decoding row, then resent with more tokens); 0: none; capped by the "
        "context window and the pool. Off by default: on an H200 it cost an 8B server ~55 s of "
        "start and did not make a restarted first turn faster.",
    )
    kv_layout: Literal["auto", "paged", "dense"] = Field(
        "auto",
        description="Where running requests' KV lives: paged (the pool's blocks, read through "
        "block tables), dense (a contiguous working set), auto (the measured best per device).",
    )
    kv_format: Literal["auto", "fp16", "bf16", "fp32", "int8", "int4"] = Field(
        "auto",
        description="How the KV blocks hold keys and values: auto (the model's float type), "
        "int8 or int4 (group-wise quantized, written once per token and read by quantized "
        "attention: about 1.9x / 3.6x the tokens in the same --kv-cache-mb for a bf16 model "
        "with 128-wide heads). fp16/bf16/fp32 name the model's own type. Needs the dense layout.",
    )
    kv_formats: str = Field(
        "",
        description="Comma-separated formats a request may ask for with kv_format in its body "
        "(auto, int8, int4; the model's float type by name too), beside --kv-format, which "
        "requests that do not ask get. Empty: --kv-format only. Each format is checked at "
        "start; needs the dense layout.",
    )
    kv_group_size: int | None = Field(
        None,
        description="Values per scale and bias of --kv-format int8/int4: 32 or 64 (unset: 64 "
        "where it divides the model's head_dim, else 32).",
    )
    kv_recent_tokens: int = Field(
        0,
        ge=0,
        le=4096,
        description="With int8/int4 (--kv-format, or a request's --kv-formats choice): each "
        "running request's newest N tokens are also kept in the model's float type and "
        "attended from there (a residual window, as KIVI does), held as pool blocks while it "
        "runs.",
    )
    prefix_caching: bool = Field(
        True,
        description="Share full KV blocks between requests with the same prompt prefix "
        "(cached blocks no request holds are evicted, LRU, before any allocation fails).",
    )
    prefix_cache_answers: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Cache a finished request's generated pages too, so a conversation's next "
        "turn, which resends the answer, prefills only its new tokens; auto: always in the "
        "paged layout, in the dense one while at most 16 requests run (there each copy out of "
        "the batch's working set costs the next step an in-place update).",
    )
    resent_answers: int = Field(
        32,
        ge=0,
        le=4096,
        description="Remember this many recent chat answers with the tokens the model generated "
        "for them: a next turn that resends one (the conversation so far, then the answer's "
        "text) is encoded with those tokens, so its prefix-cache hit runs through the answer "
        "(re-encoding an answer's text need not give back its tokens); with "
        "--prefix-cache-dir they are kept there across a clean restart; 0: off.",
    )
    responses_store: int = Field(
        256,
        ge=0,
        le=1_000_000,
        description="Keep this many Responses API responses in memory (those created with "
        "store, the API's default), so a request can continue one by previous_response_id "
        "and GET /v1/responses/{id} returns it; the oldest are dropped; per process; 0: none.",
    )
    prefix_cache_dir: str | None = Field(
        None,
        description="Keep the prefix cache's pages on disk here too (written as they leave "
        "memory and at a clean stop, loaded on a hit), so conversations survive a restart; "
        "keyed by the model's files, the KV dtype and the block size.",
    )
    prefix_cache_disk_gb: float = Field(
        10.0, gt=0, description="Disk the --prefix-cache-dir pages may use (LRU beyond)."
    )
    prefix_cache_preload_gb: float | None = Field(
        None,
        ge=0,
        description="At start, before /ready answers 200, read the most recently used "
        "conversations of --prefix-cache-dir into the prefix cache in memory, up to this many "
        "GiB of KV, so a restarted server's first turns start from memory; unset: up to half "
        "the KV pool; 0: none (pages are then read from disk on a hit).",
    )
    engine_process: bool = Field(
        False,
        description="Run the engine (model, scheduler, pool) in a process of its own, so that "
        "HTTP and SSE work never holds the GIL a decode step waits for (on an H200 at 128 "
        "clients 1.16-1.36x the thread, mixed at 32: DESIGN-NOTES.md); off: a thread of the "
        "server's process.",
    )
    pipeline: bool = Field(
        False,
        description="Launched over mx.distributed (mlx.launch): split the model's layers "
        "between the ranks (pipeline parallel) instead of its tensors (the default).",
    )
    engine_stall_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds the engine may have work and show no progress before /ready "
        "answers 503 engine_stalled; at 4x this, /health does too (for a supervisor).",
    )
    group_timeout: float = Field(
        300.0,
        gt=0,
        description="Launched over mx.distributed: seconds one step may wait on the other "
        "ranks before the group counts as dead (/health 503, exit 1).",
    )
    stream_interval_ms: float = Field(
        25.0,
        ge=0,
        le=1000,
        description="A stream's tokens are sent at most this often, batched (the first at once); "
        "0: every token as it is made.",
    )
    admin_key: str | None = Field(
        None, description="Bearer key for /admin (random, printed once, when unset)."
    )
    api_key: str | None = Field(None, description="Bearer key required on /v1 when set.")
    cors_origins: list[str] = Field(
        default_factory=list, description="Origins allowed by CORS on /v1 (never on /admin)."
    )
    drain_timeout: float = Field(
        30.0, ge=0, description="Seconds running requests may finish after SIGTERM."
    )
    register_with: str | None = Field(
        None,
        description="An SMG router's URL: join its workers at start (POST /workers), leave "
        "when draining (DELETE /workers/{id}).",
    )
    advertise_url: str | None = Field(
        None,
        description="This server's URL as the router reaches it (default: http://HOST:PORT).",
    )
    metrics_compat: Literal["none", "vllm"] = Field(
        "none",
        description="Also export vLLM's names for the load a router reads "
        "(vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc, "
        "vllm:cache_config_info, vllm:prefix_cache_*), for routers that know only those.",
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    reasoning: Literal["auto", "off"] = Field(
        "auto",
        description="auto: a thinking model's reasoning comes back apart from its answer "
        "(reasoning_content, a reasoning item, a thinking block); off: left in the answer.",
    )
    access_log: bool = Field(
        True,
        description="One log line per HTTP request: method, path, status, milliseconds, request "
        "id, prompt and completion tokens (--no-access-log: none).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info")


class Settings(BaseSettings, EdgeSettings, TuningSettings, ServingFields):
    """Everything the server can be told. Built once at the entry point, passed down.

    Each field is ``--kebab-case`` on the command line and ``VQ_UPPER_CASE`` in the
    environment (the command line wins).
    """

    model_config = SettingsConfigDict(
        env_prefix="VQ_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="veloxquant-serve",
        extra="forbid",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        """A path is read here: the engine and the server get the template's text."""
        if value is None:
            return None
        path = Path(value).expanduser()
        if len(value) < 4096 and "\n" not in value and path.is_file():
            return path.read_text(encoding="utf-8")
        if "{{" in value or "{%" in value:
            return value
        raise ValueError("not a readable file, and not a Jinja template ({{ ... }} / {% ... %})")

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.model is not None and not Path(self.model).expanduser().is_dir():
            raise ValueError(
                f"--model {self.model}: not a local model directory (nothing is downloaded)"
            )
        if self.n_blocks is None and self.kv_cache_mb is None:
            raise ValueError("set --kv-cache-mb or --n-blocks")
        if self.kv_group_size not in (None, 32, 64):
            raise ValueError(f"--kv-group-size must be 32 or 64, got {self.kv_group_size}")
        known = ("auto", "fp16", "bf16", "fp32", "int8", "int4")
        bad = [f for f in self.kv_format_list if f not in known]
        if bad:
            raise ValueError(f"--kv-formats takes {', '.join(known)}; got {', '.join(bad)}")
        if 0 < self.prefill_stall_ratio < 1:
            raise ValueError(
                "--prefill-stall-ratio must be 0 (a fixed budget) or at least 1 (a step with "
                f"prefill is never shorter than one without), got {self.prefill_stall_ratio}"
            )
        if self.max_blocks is not None and self.grow_on_exhaustion:
            floor = self.n_blocks or 0
            if self.max_blocks < floor:
                raise ValueError("--max-blocks must be >= --n-blocks")
        for name, url in (
            ("register_with", self.register_with),
            ("advertise_url", self.advertise_url),
        ):
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"--{name.replace('_', '-')} must be an http(s) URL")
        unreachable = self.port == 0 or self.host in ("0.0.0.0", "::", "")
        if self.register_with and self.advertise_url is None and unreachable:
            raise ValueError(
                "--register-with needs --advertise-url when listening on "
                f"--host {self.host} --port {self.port}: the router must reach this server"
            )
        if self.engine_process and launched_rank() is not None:
            raise ValueError("--engine-process does not run in an mx.distributed group")
        for name in ("admin_key", "api_key"):
            value = getattr(self, name)
            if value is not None and len(value) < 8:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 8 characters")
        return self

    def model_alias_list(self) -> tuple[str, ...]:
        """--model-aliases as ids and patterns, in order, without repeats."""
        names = (a.strip() for a in self.model_aliases.split(","))
        return tuple(dict.fromkeys(a for a in names if a))

    @property
    def kv_format_list(self) -> tuple[str, ...]:
        """--kv-formats as names, in order, without repeats."""
        names = (f.strip() for f in self.kv_formats.split(","))
        return tuple(dict.fromkeys(f for f in names if f))

    def with_admin_key(self) -> tuple[Settings, bool]:
        """These settings with an admin key (a random one if unset) and whether it was made."""
        if self.admin_key:
            return self, False
        return self.model_copy(update={"admin_key": secrets.token_urlsafe(24)}), True


class SettingsError(SystemExit):
    """Invalid settings: carries the one-line message the CLI prints before exiting 2."""


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    """Settings from the environment and ``argv`` (the process's arguments when None).

    Raises:
        SettingsError: With a one-line message naming each invalid setting.
    """
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return Settings(_cli_parse_args=args)  # type: ignore[call-arg]
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise SettingsError(f"veloxquant-serve: invalid settings: {problems}") from None
