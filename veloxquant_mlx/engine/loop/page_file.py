"""A prefix-cache page as a file of the disk tier: one safetensors file per page, its arrays
named by layer, stream and part (``part_name``), its metadata the engine's ``fingerprint``, the
page's digest and tokens, and a CRC-32 of the arrays' names and bytes (``crcs``); ``parse``
reads a file's bytes back with every check, without MLX (the reader thread's side).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx.kv.codec import Stored as Parts

SUFFIX = ".safetensors"
# A stored part's dtype in a safetensors header, and how numpy holds its bytes (bfloat16 as
# uint16: numpy has no bfloat16; the engine thread views it back)
DTYPES = {
    mx.float32: ("F32", np.float32),
    mx.float16: ("F16", np.float16),
    mx.bfloat16: ("BF16", np.uint16),
    mx.uint32: ("U32", np.uint32),
    mx.uint8: ("U8", np.uint8),
    mx.int8: ("I8", np.int8),
}


def fingerprint(model_path: Path, parts: Iterable[object]) -> str:
    """The identity of a page's KV: the model's config and weight files (name, size, first and
    last MiB of each) and ``parts`` (dtype, geometry, block size, format)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
    config = model_path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(model_path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def parse(
    data: bytes, fp: str, name: str, tokens: list[int], n_layers: int, dtypes: tuple[Any, ...]
) -> dict[str, np.ndarray]:
    """A page file's arrays by name (bfloat16 as uint16), read straight from its bytes, once
    every check holds: the fingerprint ``fp``, digest ``name`` and ``tokens`` in its metadata,
    every part of ``n_layers`` layers there with ``dtypes`` and one ``[1, H, len(tokens), *]``
    shape, and the CRC of their bytes.

    Raises:
        ValueError: (or another error of a short or broken file) a check failed.
    """
    view = memoryview(data)
    n = int.from_bytes(view[:8], "little")
    header = json.loads(bytes(view[8 : 8 + n]))
    meta = header.pop("__metadata__", None) or {}
    if meta.get("fingerprint") != fp or meta.get("digest") != name:
        raise ValueError("written for another model, format or page")
    if json.loads(meta.get("tokens", "null")) != tokens:
        raise ValueError("its tokens differ")
    if meta.get("crc") is None:
        raise ValueError("no CRC")
    want = {part_name(i, s, j): dt for i in range(n_layers) for s in "kv"
            for j, dt in enumerate(dtypes)}  # fmt: skip
    if set(header) != set(want):
        raise ValueError("not this tier's arrays")
    arrays, crc, lead = {}, 0, None
    for key in sorted(want):
        info = header[key]
        code, np_dtype = DTYPES[want[key]]
        shape = tuple(info["shape"])
        lead = lead or shape[:3]
        if info["dtype"] != code or len(shape) != 4 or shape[:3] != lead:
            raise ValueError("unexpected dtype or shape")
        if shape[0] != 1 or shape[2] != len(tokens):
            raise ValueError(f"unexpected shape {shape}")
        begin, end = info["data_offsets"]
        raw = view[8 + n + begin : 8 + n + end]
        arrays[key] = np.frombuffer(raw, dtype=np_dtype).reshape(shape)  # a short file raises
        crc = zlib.crc32(raw, zlib.crc32(key.encode(), crc))
    if f"{crc:08x}" != meta["crc"]:
        raise ValueError("its bytes do not match their CRC")
    return arrays


def arrays_of(layers: list[tuple[Parts, Parts]]) -> dict[str, mx.array]:
    """A page's arrays by their names in its file."""
    return {
        part_name(i, s, j): part
        for i, pair in enumerate(layers)
        for s, parts in zip(("k", "v"), pair, strict=True)
        for j, part in enumerate(parts)
    }


def join_files(pages: list[dict[str, np.ndarray]]) -> dict[str, mx.array]:
    """Pages' arrays joined along the token axis, as MLX arrays (a copy, made by the reader
    thread; nothing is evaluated there)."""
    return {
        key: mx.array(np.concatenate([p[key] for p in pages], axis=2) if len(pages) > 1
                      else pages[0][key])
        for key in pages[0]
    }  # fmt: skip


def part_of(name: str) -> int:
    """A part's index from its name in a page file (``part_name``)."""
    tail = name.rsplit(".", 1)[1]
    return int(tail) if tail.isdigit() else 0


def layers_of(
    arrays: dict[str, mx.array], n_layers: int, n_parts: int
) -> list[tuple[Parts, Parts]]:
    """A page's K and V per layer, as stored, from its arrays by name (``arrays_of``' inverse)."""
    return [
        (
            tuple(arrays[part_name(i, "k", j)] for j in range(n_parts)),
            tuple(arrays[part_name(i, "v", j)] for j in range(n_parts)),
        )
        for i in range(n_layers)
    ]


def crcs(pages: list[dict[str, mx.array]]) -> list[str]:
    """Each page's CRC-32 of its arrays' names and bytes, in name order (contiguous arrays:
    a page's copies, or what a file loaded). One evaluation for all of them: an evaluation
    per array cost the restart benchmark 40 ms for its 98 pages."""
    views = [[(name, page[name].view(mx.uint8)) for name in sorted(page)] for page in pages]
    mx.eval([v for page in views for _, v in page])
    out = []
    for page in views:
        crc = 0
        for name, v in page:
            crc = zlib.crc32(np.asarray(v).data, zlib.crc32(name.encode(), crc))
        out.append(f"{crc:08x}")
    return out


def part_name(layer: int, stream: str, part: int) -> str:
    """A part's name in a page file: "3.k" (a float page's, or a quantized one's codes),
    "3.k.1" / "3.k.2" (scales, biases)."""
    return f"{layer}.{stream}" if part == 0 else f"{layer}.{stream}.{part}"


def reason(exc: BaseException) -> str:
    """An exception as one short line, without paths."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:120]}" if text and "/" not in text else type(exc).__name__
