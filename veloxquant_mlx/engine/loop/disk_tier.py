"""The prefix cache's disk tier (``--prefix-cache-dir``): pages that leave memory, and at a clean
stop every cached page, are written to disk, and a prompt that runs past its cached pages in
memory loads the next ones from there, so a conversation survives a restart.

A page on disk is one safetensors file named by its digest: the hash chain of every token up to
the page's end, rooted in the engine's fingerprint (the model's files, the KV dtype, geometry
and block size: ``fingerprint``), so another model, dtype or block size never matches; the
file's metadata repeats the fingerprint, the digest and the page's tokens and holds a CRC-32
of the arrays' bytes, and a load checks them, every array's shape and dtype and the bytes'
CRC. A file that fails is skipped with one log line and removed; it is never served and never
fatal. The directory is capped at ``cap_bytes``, least
recently used first (a load touches the file, so the order survives restarts).

Writes go through one writer thread with a bounded queue (a full queue drops the page: the tier
is a cache); a page queued and not yet written is served from its copy in memory, so a prompt
that arrives right after its pages were evicted finds them. Loads run on the engine thread at
admission, bounded by the prompt they serve.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx.engine.loop.prefix_cache import Page, chain
from veloxquant_mlx.kv.codec import Stored as Parts
from veloxquant_mlx.kv.codec import copy_span, join_spans

log = logging.getLogger("veloxquant.engine")

SUFFIX = ".safetensors"
QUEUE_PAGES = 1024  # pages waiting for the writer at most


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


class DiskTier:
    """Pages on disk by digest, in LRU order, and the writer thread that puts them there.

    Args:
        root: ``--prefix-cache-dir``; pages go in a subdirectory named by ``fp``.
        cap_bytes: The directory's size at most.
        fp: ``fingerprint``'s value.
        n_layers: Layers (a page is a K and a V per layer).
        dtypes: The dtype of each part a stream is stored as (``kv.codec``): the KV's float
            type alone, or a quantized format's codes, scales and biases.
    """

    def __init__(
        self, root: Path, cap_bytes: int, fp: str, n_layers: int, dtypes: tuple[Any, ...]
    ) -> None:
        self.dir = Path(root) / fp[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fp = fp
        self.root_digest = bytes.fromhex(fp)
        self.cap = cap_bytes
        self.n_layers = n_layers
        self.dtypes = dtypes
        self._lock = threading.Lock()  # the index: the engine thread and the writer
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._crcs: dict[str, str] = {}  # of the pages opened and not yet checked
        # pages queued for the writer, by name: their tokens and arrays (read under the lock)
        self._pending: dict[str, tuple[list[int], dict[str, mx.array]]] = {}
        files = []
        for f in self.dir.glob("*" + SUFFIX):
            try:
                st = f.stat()
            except OSError:
                continue
            files.append((st.st_mtime, f.stem, st.st_size))
        for _, stem, size in sorted(files):
            self._index[stem] = size
        self.bytes = sum(self._index.values())
        self.hits = 0  # pages loaded
        self.writes = 0  # pages written
        self.dropped = 0  # pages not written (the queue was full, or the write failed)
        self.skipped = 0  # files refused at load (corrupt, foreign, wrong shape)
        self._queue: queue.Queue[tuple[str, list[int], dict[str, mx.array]] | None] = queue.Queue(
            QUEUE_PAGES
        )
        self._writer = threading.Thread(target=self._write_loop, name="vq-disk-tier", daemon=True)
        self._writer.start()
        self._trim()
        log.info(
            "prefix cache on disk: %s, %d pages (%.1f MiB of %.1f)",
            self.dir,
            len(self._index),
            self.bytes / 2**20,
            cap_bytes / 2**20,
        )

    # ------------------------------------------------------------------ engine thread

    def n_pages(self) -> int:
        with self._lock:
            return len(self._index)

    def has(self, digest: bytes) -> bool:
        name = digest.hex()
        with self._lock:
            return name in self._index or name in self._pending

    def open(self, digest: bytes, tokens: list[int]) -> list[tuple[Parts, Parts]] | None:
        """The page ``digest`` of ``tokens`` (each layer's K and V as stored, each part
        ``[1, H, bs, *]``), read lazily (``check`` evaluates it), or None (with one log line,
        and the file removed) when the file is missing, foreign or not this page's. A page
        still queued for the writer comes from its copy in memory."""
        name = digest.hex()
        with self._lock:
            pending = self._pending.get(name)
        if pending is not None and pending[0] == tokens:
            return _layers(pending[1], self.n_layers, len(self.dtypes))
        path = self.dir / (name + SUFFIX)
        try:
            loaded: Any = mx.load(str(path), return_metadata=True)
            arrays: dict[str, mx.array] = loaded[0]
            meta: dict[str, str] = loaded[1]
            if meta.get("fingerprint") != self.fp or meta.get("digest") != name:
                raise ValueError("written for another model, format or page")
            if json.loads(meta.get("tokens", "null")) != tokens:
                raise ValueError("its tokens differ")
            layers = _layers(arrays, self.n_layers, len(self.dtypes))
            crc = meta.get("crc")
            if crc is None:
                raise ValueError("no CRC")
            shape = layers[0][0][0].shape
            if len(shape) != 4 or shape[0] != 1 or shape[2] != len(tokens):
                raise ValueError(f"unexpected shape {shape}")
            for pair in layers:
                for parts in pair:
                    for part, dtype in zip(parts, self.dtypes, strict=True):
                        if part.dtype != dtype or part.shape[:3] != shape[:3]:
                            raise ValueError("unexpected dtype or shape")
        except Exception as exc:  # a bad file is a miss, never a failure
            self.refuse(digest, exc)
            return None
        self._crcs[name] = crc  # checked once the bytes are read (``check``)
        return layers

    def check(self, digests: list[bytes], pages: list[list[tuple[Parts, Parts]]]) -> int:
        """Read ``pages`` (opened in chain order) in one evaluation; where that fails, page by
        page; then each page's bytes against its CRC, refusing the first page that fails.
        Returns how many, from the first, are good."""
        try:
            mx.eval([x for layers in pages for pair in layers for parts in pair for x in parts])
            read = len(pages)
        except Exception:
            read = 0
            for digest, layers in zip(digests, pages, strict=True):
                try:
                    mx.eval([x for pair in layers for parts in pair for x in parts])
                except Exception as exc:  # a short or damaged file
                    self.refuse(digest, exc)
                    break
                read += 1
        good = 0
        # a page read from its file is checked against its CRC; one still queued (no CRC
        # waiting) is the engine's own copy
        files = [i for i, digest in enumerate(digests[:read]) if digest.hex() in self._crcs]
        crcs = dict(zip(files, _crcs([_arrays(pages[i]) for i in files]), strict=True))
        for i, digest in enumerate(digests[:read]):
            if i in crcs and crcs[i] != self._crcs.pop(digest.hex(), None):
                self.refuse(digest, ValueError("its bytes do not match their CRC"))
                break
            good += 1
        for digest in digests[good:]:
            self._crcs.pop(digest.hex(), None)
        for digest in digests[:good]:
            name = digest.hex()
            with self._lock:
                if name in self._index:
                    self._index.move_to_end(name)
            with contextlib.suppress(OSError):
                os.utime(self.dir / (name + SUFFIX))
        self.hits += good
        return good

    def refuse(self, digest: bytes, exc: BaseException) -> None:
        """A page file that cannot be served: one log line, and the file removed."""
        self.skipped += 1
        name = digest.hex()
        log.warning("prefix cache on disk: skipped %s (%s)", name[:16] + "...", _reason(exc))
        self._forget(name, unlink=True)

    def save(self, digest: bytes, tokens: list[int], layers: list[tuple[Parts, Parts]]) -> None:
        """Queue a page for the writer (its arrays' evaluation already launched); dropped when
        the page is on disk already or the queue is full."""
        name = digest.hex()
        if self.has(digest):
            return
        arrays = _arrays(layers)
        with self._lock:
            self._pending[name] = (tokens, arrays)
        try:
            self._queue.put_nowait((name, tokens, arrays))
        except queue.Full:
            with self._lock:
                del self._pending[name]
            self.dropped += 1

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (for at most ``timeout`` seconds), then stop the writer."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("prefix cache on disk: the writer is behind; pages queued are dropped")
            return
        self._writer.join(timeout)

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                self._write(*item)
        finally:
            mx.clear_streams()

    def _write(self, name: str, tokens: list[int], arrays: dict[str, mx.array]) -> None:
        try:
            self._write_file(name, tokens, arrays)
        finally:
            with self._lock:
                self._pending.pop(name, None)

    def _write_file(self, name: str, tokens: list[int], arrays: dict[str, mx.array]) -> None:
        path = self.dir / (name + SUFFIX)
        tmp = path.with_suffix(".tmp" + SUFFIX)
        meta = {"fingerprint": self.fp, "digest": name, "tokens": json.dumps(tokens)}
        meta["crc"] = _crcs([arrays])[0]  # waits for the arrays' evaluation
        try:
            mx.save_safetensors(str(tmp), arrays, meta)
            os.replace(tmp, path)
            size = path.stat().st_size
        except Exception as exc:  # a full disk, a removed directory: the page is not kept
            self.dropped += 1
            log.warning("prefix cache on disk: could not write a page (%s)", _reason(exc))
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self._index[name] = size
            self.bytes += size
        self.writes += 1
        self._trim()

    # ------------------------------------------------------------------ both

    def _forget(self, name: str, unlink: bool) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self.bytes -= size
        if unlink:
            (self.dir / (name + SUFFIX)).unlink(missing_ok=True)

    def _trim(self) -> None:
        """Remove the least recently used files while the directory is over its cap."""
        while True:
            with self._lock:
                if self.bytes <= self.cap or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                self.bytes -= size
            (self.dir / (name + SUFFIX)).unlink(missing_ok=True)


def _arrays(layers: list[tuple[Parts, Parts]]) -> dict[str, mx.array]:
    """A page's arrays by their names in its file."""
    return {
        _name(i, s, j): part
        for i, pair in enumerate(layers)
        for s, parts in zip(("k", "v"), pair, strict=True)
        for j, part in enumerate(parts)
    }


def _layers(arrays: dict[str, mx.array], n_layers: int, n_parts: int) -> list[tuple[Parts, Parts]]:
    """A page's K and V per layer, as stored, from its arrays by name (``_arrays``' inverse)."""
    return [
        (
            tuple(arrays[_name(i, "k", j)] for j in range(n_parts)),
            tuple(arrays[_name(i, "v", j)] for j in range(n_parts)),
        )
        for i in range(n_layers)
    ]


def _crcs(pages: list[dict[str, mx.array]]) -> list[str]:
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


def _name(layer: int, stream: str, part: int) -> str:
    """A part's name in a page file: "3.k" (a float page's, or a quantized one's codes),
    "3.k.1" / "3.k.2" (scales, biases)."""
    return f"{layer}.{stream}" if part == 0 else f"{layer}.{stream}.{part}"


def _reason(exc: BaseException) -> str:
    """An exception as one short line, without paths."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:120]}" if text and "/" not in text else type(exc).__name__


def load_run(
    tier: DiskTier, tokens: list[int], first: int, parent: bytes, limit: int, bs: int
) -> tuple[int, list[tuple[Parts, Parts]] | None]:
    """Load the pages of ``tokens`` from page ``first`` (whose parent's digest is ``parent``)
    up to ``limit`` pages, while the tier has them: how many, and their K and V per layer as
    stored, concatenated (``[1, H, n * bs, *]`` each part)."""
    pages: list[list[tuple[Parts, Parts]]] = []
    digests: list[bytes] = []
    for i in range(first, limit):
        page_tokens = tokens[i * bs : (i + 1) * bs]
        digest = chain(parent, page_tokens)
        if not tier.has(digest):
            break
        layers = tier.open(digest, page_tokens)  # read lazily, checked below in one go
        if layers is None:
            break
        pages.append(layers)
        digests.append(digest)
        parent = digest
    if pages:
        pages = pages[: tier.check(digests, pages)]
    if not pages:
        return 0, None
    if len(pages) == 1:
        return 1, pages[0]
    joined = [
        (join_spans([p[layer][0] for p in pages]), join_spans([p[layer][1] for p in pages]))
        for layer in range(len(pages[0]))
    ]
    return len(pages), joined


def save_pages(tier: DiskTier, kv: Any, pages: list[Page]) -> None:
    """Queue ``pages`` for the disk (those it lacks): a copy of each one's KV, read through the
    layout ``kv`` and launched now (the writer waits for it). Pages of the server's own KV
    format only: the tier's files hold that one (a request's other ``kv_format`` is cached in
    memory only)."""
    for page in pages:
        if page.fmt or tier.has(page.digest):
            continue
        layers = [(copy_span(k), copy_span(v)) for k, v in kv.page_parts([page])]
        mx.async_eval([x for pair in layers for parts in pair for x in parts])
        tier.save(page.digest, list(page.key[1]), layers)
