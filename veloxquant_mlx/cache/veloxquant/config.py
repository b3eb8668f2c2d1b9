"""KVCacheConfig, KVCacheFactory and the fluent KVCacheBuilder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from veloxquant_mlx.cache.veloxquant.base import KVCache
from veloxquant_mlx.cache.veloxquant.kivi import KIVIKVCache
from veloxquant_mlx.cache.veloxquant.methods import AffineKVCache, FP16KVCache

_MX_GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Settings of one VeloxQuant KV cache.

    Attributes:
        method: "fp16" (exact reference), "int8", "int4" (per-token group-wise affine) or
            "kivi" (2-bit KIVI). See ``KVCacheFactory.methods()``.
        head_dim: Width of each key/value vector (> 0).
        group_size: Channels per scale/bias group for int8/int4, tokens per key group and
            channels per value group for kivi; one of 32, 64, 128, dividing ``head_dim``.
        residual_length: kivi only: recent tokens kept fp16 (>= 0).

    Raises:
        ValueError: On an unknown method or a setting the method cannot use.
    """

    method: str = "fp16"
    head_dim: int = 128
    group_size: int = 32
    residual_length: int = 128

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(
                f"unknown KV cache method {self.method!r}; known: {', '.join(sorted(_METHODS))}"
            )
        for name in ("head_dim", "group_size", "residual_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.head_dim <= 0:
            raise ValueError(f"head_dim must be > 0, got {self.head_dim}")
        if self.residual_length < 0:
            raise ValueError(f"residual_length must be >= 0, got {self.residual_length}")
        if self.method != "fp16":
            if self.group_size not in _MX_GROUP_SIZES:
                raise ValueError(
                    f"group_size must be one of {_MX_GROUP_SIZES}, got {self.group_size}"
                )
            if self.head_dim % self.group_size:
                raise ValueError(
                    f"{self.method} needs head_dim ({self.head_dim}) divisible by group_size "
                    f"({self.group_size})"
                )


_METHODS: dict[str, Callable[[KVCacheConfig], KVCache]] = {
    "fp16": lambda c: FP16KVCache(c.head_dim),
    "int8": lambda c: AffineKVCache(c.head_dim, bits=8, group_size=c.group_size),
    "int4": lambda c: AffineKVCache(c.head_dim, bits=4, group_size=c.group_size),
    "kivi": lambda c: KIVIKVCache(
        c.head_dim, bits=2, group_size=c.group_size, residual_length=c.residual_length
    ),
}


class KVCacheFactory:
    """Makes a VeloxQuant KVCache from a KVCacheConfig."""

    @staticmethod
    def methods() -> tuple[str, ...]:
        """The method names ``create`` knows."""
        return tuple(sorted(_METHODS))

    @staticmethod
    def create(config: KVCacheConfig) -> KVCache:
        """A new, empty cache for ``config``.

        Raises:
            ValueError: If ``config`` is not a KVCacheConfig.
        """
        if not isinstance(config, KVCacheConfig):
            raise ValueError(f"expected a KVCacheConfig, got {type(config).__name__}")
        return _METHODS[config.method](config)


class KVCacheBuilder:
    """Fluent construction: ``KVCacheBuilder().with_method("kivi").with_head_dim(128).build()``.

    Every ``with_*`` returns the builder; settings are validated by ``build()`` / ``config()``.
    """

    def __init__(self) -> None:
        self._settings: dict[str, Any] = {}

    def with_method(self, method: str) -> KVCacheBuilder:
        self._settings["method"] = method
        return self

    def with_head_dim(self, head_dim: int) -> KVCacheBuilder:
        self._settings["head_dim"] = head_dim
        return self

    def with_group_size(self, group_size: int) -> KVCacheBuilder:
        self._settings["group_size"] = group_size
        return self

    def with_residual_length(self, residual_length: int) -> KVCacheBuilder:
        self._settings["residual_length"] = residual_length
        return self

    def config(self) -> KVCacheConfig:
        """The validated KVCacheConfig (ValueError on bad settings)."""
        return replace(KVCacheConfig(), **self._settings) if self._settings else KVCacheConfig()

    def build(self) -> KVCache:
        """A new cache of the configured method (ValueError on bad settings)."""
        return KVCacheFactory.create(self.config())
