"""Errors raised by the block pool.

Each subclasses the builtin that fits it, so callers that only know the builtin still catch it.
"""

from __future__ import annotations


class BlockPoolError(Exception):
    """Base class of every error the block pool raises on purpose."""


class BlockPoolExhaustedError(BlockPoolError, RuntimeError):
    """An allocation needed more free blocks than the pool has or may grow to."""


class OwnerAlreadyActiveError(BlockPoolError, ValueError):
    """register_owner() was called for an owner id that is still active on the pool."""
