"""The KV formats a server holds (``--kv-format`` and ``--kv-formats``) and what a page of each
takes of the pool.

With one format the pool's blocks are that format's size and a page (``block_size`` tokens
of one layer's K or V) is one block. With several, the blocks are the smallest format's size
and a page of format ``f`` takes ``span(f)`` blocks, its bytes over a block's rounded up: a
bf16 page (128-wide heads) is 2 int8-sized blocks (6% of them unused) or 4 int4-sized ones
(12%), so that admission, ``/v1/loads`` and the metrics count every format in one unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.model.sizing import KVGeometry
from veloxquant_mlx.kv import codec as kv_codec
from veloxquant_mlx.kv.codec import KVCodec


@dataclass(frozen=True, slots=True)
class Formats:
    """The server's own codec first, then the others a request may ask for (canonical names,
    ``kv.codec``); ``block`` is the codec the pool's blocks are sized for."""

    codecs: dict[str, KVCodec]
    block: KVCodec

    @property
    def own(self) -> KVCodec:
        return next(iter(self.codecs.values()))

    @property
    def mixed(self) -> bool:
        return len(self.codecs) > 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.codecs)

    def spans(self, geometry: KVGeometry, block_size: int) -> dict[str, int]:
        """Blocks per layer and stream a page of each format takes ("" for the server's own);
        empty with one format (every page one block)."""
        if not self.mixed:
            return {}
        block = geometry.bytes_per_block(block_size, self.block)
        out = {
            name: -(-geometry.bytes_per_block(block_size, c) // block)
            for name, c in self.codecs.items()
        }
        out[""] = out[self.own.name]
        return out


def kv_formats(cfg: EngineConfig, geometry: KVGeometry) -> Formats:
    """The formats ``cfg`` asks for, for this model.

    Raises:
        ValueError: One line: a format the model cannot use, or several formats with a
            setting that holds one (the paged layout).
    """

    def parse(name: str) -> KVCodec:
        return kv_codec.parse(name, geometry.dtype, geometry.head_dim, cfg.kv_group_size)

    own = parse(cfg.kv_format)
    codecs = {own.name: own}
    for name in cfg.kv_formats:
        other = parse(name)
        codecs.setdefault(other.name, other)
    formats = Formats(codecs, min(codecs.values(), key=lambda c: geometry.bytes_per_block(1, c)))
    if formats.mixed and cfg.kv_layout == "paged":
        raise ValueError("--kv-formats with several formats needs --kv-layout dense (or auto)")
    return formats
