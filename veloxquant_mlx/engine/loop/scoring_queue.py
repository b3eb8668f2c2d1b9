"""The prompts being scored (``ScoringJob``: a prompt's logprobs, as ``echo`` with ``logprobs``
asks), run a chunk a turn between the engine's steps, so a long prompt to score is interleaved
with everyone's decoding. The core owns one. Engine thread only.
"""

from __future__ import annotations

import logging
from typing import Any

from veloxquant_mlx.engine.request.scoring import ScoringJob
from veloxquant_mlx.engine.types import EngineNotReadyError

log = logging.getLogger("veloxquant.engine")


class ScoringQueue:
    """The scoring jobs in arrival order, the oldest scored first."""

    def __init__(self) -> None:
        self._jobs: list[ScoringJob] = []

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def add(self, prompt: tuple[int, ...], top: int) -> ScoringJob:
        """Queue a prompt; its caller is answered through the job's ``future`` (set by the turn
        that took the command) when its last chunk is scored."""
        job = ScoringJob(prompt, top)
        self._jobs.append(job)
        return job

    def step(self, model: Any, budget: int) -> None:
        """One chunk of ``budget`` tokens of the oldest job. A job whose caller gave up is
        dropped; one that fails fails its caller alone."""
        job = self._jobs[0]
        if not job.abandoned:
            try:
                if not job.step(model, budget):
                    return
            except Exception as exc:  # its own failure (an MLX error in its forward)
                log.exception("scoring a prompt failed")
                if job.future is not None and not job.future.done():
                    job.future.set_exception(exc)
                self._jobs.pop(0)
                return
            if job.future is not None and not job.future.done():
                job.future.set_result(job.scores)
        self._jobs.pop(0)

    def drop(self, message: str) -> None:
        """Answer every job's caller with EngineNotReadyError (a stop, a failure)."""
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            if job.future is not None and not job.future.done():
                job.future.set_exception(EngineNotReadyError(message))
