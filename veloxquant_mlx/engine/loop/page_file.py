"""A prefix-cache page as a file of the disk tier: one safetensors file per page (``write_page``),
its arrays named by layer, stream and part (``part_name``) and laid out part by part
(``layout_order``), its metadata the engine's ``fingerprint``, the page's digest and tokens, and
the XXH3-64 of its data. ``read_header`` checks a file's header; ``Segment`` puts the data of
consecutive pages straight into their joined place (the reader thread's side).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np
import xxhash

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
CODES = {code: np.dtype(np_dtype) for code, np_dtype in DTYPES.values()}
MX_OF = {d: getattr(mx, d.name) for d in CODES.values()}  # the MLX type of each
MAX_HEADER = 1 << 24  # a page file's header is far smaller; more is not a page file


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


def write_page(path: Path, arrays: dict[str, mx.array], meta: dict[str, str]) -> None:
    """Write a page's arrays (``arrays_of``) as a safetensors file in ``layout_order``, its
    metadata ``meta`` plus the XXH3-64 of the data; waits for the arrays' evaluation."""
    names = layout_order(arrays)
    parts = [arrays[name] for name in names]
    host = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in parts]
    mx.eval(host)
    views = [np.ascontiguousarray(np.asarray(a)).data.cast("B") for a in host]
    h = xxhash.xxh3_64()
    header: dict[str, Any] = {}
    offset = 0
    for name, a, v in zip(names, parts, views, strict=True):
        header[name] = {
            "dtype": DTYPES[a.dtype][0],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + v.nbytes],
        }
        offset += v.nbytes
        h.update(v)
    header["__metadata__"] = {**meta, "xxh3": h.hexdigest()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for v in views:
            f.write(v)


def layout_order(names: Iterable[str]) -> list[str]:
    """A page's array names in file order: by part, then layer, then K before V; so each
    part's arrays lie back to back as one ``[2 * layers, H, tokens, *]`` block."""

    def key(name: str) -> tuple[int, int, str]:
        layer, stream = name.split(".")[:2]
        return part_of(name), int(layer), stream

    return sorted(names, key=key)


@dataclass(frozen=True, slots=True)
class Group:
    """One part's arrays in a page file: ``count`` arrays of ``[1, heads, tokens, width]``
    back to back, ``nbytes`` from byte ``offset`` of the data."""

    code: str  # the safetensors dtype
    count: int
    heads: int
    width: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a page file's arrays lie in its data (every page of a tier has the same one)."""

    tokens: int
    groups: tuple[Group, ...]
    size: int  # data bytes


def read_header(
    f: BinaryIO, fp: str, name: str, tokens: list[int], n_layers: int, dtypes: tuple[Any, ...]
) -> tuple[Layout, str]:
    """An open page file's layout and data checksum, its header read and checked: the
    fingerprint ``fp``, digest ``name`` and ``tokens`` in its metadata, every part of
    ``n_layers`` layers there with ``dtypes``, one ``[1, H, len(tokens), *]`` shape per part,
    in ``layout_order`` back to back. Leaves ``f`` at the data's start.

    Raises:
        ValueError: (or another error of a short or broken file) a check failed.
    """
    header = _header(f)
    meta = _checked_meta(header.pop("__metadata__", None) or {}, fp, name)
    if json.loads(meta["tokens"]) != tokens:
        raise ValueError("its tokens differ")
    checksum = meta["xxh3"]
    want = {part_name(i, s, j) for i in range(n_layers) for s in "kv" for j in range(len(dtypes))}
    if set(header) != want:
        raise ValueError("not this tier's arrays")
    groups, offset = [], 0
    for j, dt in enumerate(dtypes):
        code, np_dtype = DTYPES[dt]
        names = [part_name(i, s, j) for i in range(n_layers) for s in "kv"]
        shape = tuple(header[names[0]]["shape"])
        if len(shape) != 4 or shape[0] != 1 or shape[2] != len(tokens):
            raise ValueError(f"unexpected shape {shape}")
        nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
        start = offset
        for key in names:
            info = header[key]
            if info["dtype"] != code or tuple(info["shape"]) != shape:
                raise ValueError("unexpected dtype or shape")
            if info["data_offsets"] != [offset, offset + nbytes]:
                raise ValueError("not this tier's layout")
            offset += nbytes
        groups.append(Group(code, len(names), shape[1], shape[3], start, offset - start))
    return Layout(len(tokens), tuple(groups), offset), checksum


def read_meta(f: BinaryIO, fp: str, name: str) -> tuple[str, list[int]]:
    """An open page file's parent's digest and tokens, once it is this tier's file for page
    ``name``.

    Raises:
        ValueError: (or another error of a short or broken file) it is not.
    """
    meta = _checked_meta(_header(f).get("__metadata__") or {}, fp, name)
    tokens = json.loads(meta["tokens"])
    if not tokens or not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ValueError("its tokens are not token ids")
    return meta["parent"], tokens


def _header(f: BinaryIO) -> dict[str, Any]:
    n = int.from_bytes(f.read(8), "little")
    if not 0 < n <= MAX_HEADER:
        raise ValueError("not a page file")
    header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("not a page file")
    return header


def _checked_meta(meta: dict[str, Any], fp: str, name: str) -> dict[str, str]:
    if meta.get("fingerprint") != fp or meta.get("digest") != name:
        raise ValueError("written for another model, format or page")
    if not isinstance(meta.get("xxh3"), str) or not isinstance(meta.get("parent"), str):
        raise ValueError("no checksum")
    if not isinstance(meta.get("tokens"), str):
        raise ValueError("no tokens")
    return meta


class Segment:
    """Consecutive pages of one layout read into their joined place: each part's ``[2 *
    layers, H, n * tokens, *]`` block, filled page by page (``fill``), taken as arrays by name
    (``arrays``). The blocks are MLX arrays written through NumPy views where MLX allows it
    (``writable_views``: one pass over fresh memory, a file's bytes copied once), else NumPy
    arrays copied into MLX at the end. Reader thread."""

    def __init__(self, layout: Layout, n_pages: int, n_layers: int) -> None:
        self.layout = layout
        self.n_layers = n_layers
        self.blocks: list[tuple[mx.array | None, np.ndarray]] = []
        shared = writable_views()
        for g in layout.groups:
            np_dtype = CODES[g.code]
            shape = (g.count, g.heads, n_pages * layout.tokens, g.width)
            if shared:
                block = mx.zeros(shape, dtype=MX_OF[np_dtype], stream=mx.cpu)
                mx.eval(block)
                self.blocks.append((block, np.array(block, copy=False)))
            else:
                self.blocks.append((None, np.empty(shape, np_dtype)))

    def fill(self, i: int, data: memoryview) -> None:
        """Page ``i``'s data (``layout.size`` bytes, checked) into its place."""
        t = self.layout.tokens
        for g, (_, dest) in zip(self.layout.groups, self.blocks, strict=True):
            np_dtype = CODES[g.code]
            src = np.frombuffer(data, np_dtype, g.nbytes // np_dtype.itemsize, g.offset)
            dest[:, :, i * t : (i + 1) * t, :] = src.reshape(g.count, g.heads, t, g.width)

    def arrays(self, n_pages: int) -> dict[str, mx.array]:
        """The first ``n_pages`` pages' arrays by name (``[1, H, n * tokens, *]``, raw:
        bfloat16 as uint16), evaluated views of the blocks (the reader's streams are its own)."""
        out = {}
        end = n_pages * self.layout.tokens
        with mx.stream(mx.cpu):
            for j, (block, dest) in enumerate(self.blocks):
                whole = block if block is not None else mx.array(dest[:, :, :end])
                if end < whole.shape[2]:
                    whole = whole[:, :, :end]
                names = [part_name(i, s, j) for i in range(self.n_layers) for s in "kv"]
                for k, name in enumerate(names):
                    out[name] = whole[k : k + 1]
            mx.eval(list(out.values()))
        return out


@functools.cache
def writable_views() -> bool:
    """Whether a NumPy view of an MLX array made on the CPU stream writes the array's own
    memory (MLX's documented buffer-protocol view; a backend whose arrays live apart from the
    host could hand out a copy instead)."""
    a = mx.zeros((4,), dtype=mx.uint8, stream=mx.cpu)
    mx.eval(a)
    try:
        view = np.array(a, copy=False)
        if not view.flags.writeable:
            return False
        view[:] = 7
    except (ValueError, TypeError, BufferError, RuntimeError):
        return False
    return bool(a.tolist() == [7, 7, 7, 7])


def arrays_of(layers: list[tuple[Parts, Parts]]) -> dict[str, mx.array]:
    """A page's arrays by their names in its file."""
    return {
        part_name(i, s, j): part
        for i, pair in enumerate(layers)
        for s, parts in zip(("k", "v"), pair, strict=True)
        for j, part in enumerate(parts)
    }


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


def part_name(layer: int, stream: str, part: int) -> str:
    """A part's name in a page file: "3.k" (a float page's, or a quantized one's codes),
    "3.k.1" / "3.k.2" (scales, biases)."""
    return f"{layer}.{stream}" if part == 0 else f"{layer}.{stream}.{part}"


def reason(exc: BaseException) -> str:
    """An exception as one short line, without paths."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:120]}" if text and "/" not in text else type(exc).__name__
