"""The prefix cache's disk tier (``--prefix-cache-dir``): pages that leave memory, and at a clean
stop every cached page, are written to disk, and a prompt that runs past its cached pages in
memory loads the next ones from there, so a conversation survives a restart.

A page on disk is one file named by its digest (``page_file``: what it holds and how a read
checks it): the hash chain of every token up to the page's end, rooted in the engine's
fingerprint, so another model, dtype or block size never matches. A file that fails a check is
skipped with one log line and removed; it is never served and never fatal. The directory is
capped at ``cap_bytes``, least recently used first (a load touches the file, so the order
survives restarts).

Writes go through one writer thread with a bounded queue (a full queue drops the page: the tier
is a cache); a page queued and not yet written is served from its copy in memory, so a prompt
that arrives right after its pages were evicted finds them. Reads go through one reader thread
(``start_read``): a request whose next pages are on disk waits for them outside the engine's
steps, which go on for everyone else; the reader checks each file and copies its bytes once,
straight into the run's joined arrays (``page_file.Segment``), and the engine thread only takes
the result (``run_kv``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import xxhash

from veloxquant_mlx.engine.loop.page_file import (
    SUFFIX,
    Layout,
    Segment,
    arrays_of,
    layers_of,
    part_of,
    read_header,
    read_meta,
    reason,
    write_page,
)
from veloxquant_mlx.engine.loop.prefix_cache import Page, chain
from veloxquant_mlx.kv.codec import Stored as Parts
from veloxquant_mlx.kv.codec import copy_span, join_spans

log = logging.getLogger("veloxquant.engine")

QUEUE_PAGES = 1024  # pages waiting for the writer at most
TMP = ".tmp"  # a file being written is "<digest>.<pid>.tmp.safetensors" until it is complete
WARN_EVERY_S = 60.0  # failed writes are logged at most this often
STALE_TMP_S = 600  # one that old was left by a crash (another server may share the directory)
PRELOAD_RUNS = 256  # conversations a restarted engine reads back at most (one request each)


@dataclass(slots=True)
class Run:
    """The pages a read found, from page ``first`` on: ``segments`` in chain order, each ``(n
    pages, the page's arrays by name)``, the arrays of consecutive files joined along the
    token axis by the reader (raw: ``run_kv`` gives them their dtype), a page still queued for
    the writer as its copy."""

    first: int
    n_pages: int
    segments: list[tuple[int, dict[str, mx.array]]]


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
        # pages queued for the writer, by name: their tokens and arrays (read under the lock)
        self._pending: dict[str, tuple[list[int], dict[str, mx.array]]] = {}
        files = []
        for f in self.dir.glob("*" + SUFFIX):
            try:
                st = f.stat()
            except OSError:
                continue
            if f.stem.endswith(TMP):  # a write in progress, or one a crash cut short
                if time.time() - st.st_mtime > STALE_TMP_S:
                    f.unlink(missing_ok=True)
                continue
            files.append((st.st_mtime, f.stem, st.st_size))
        for _, stem, size in sorted(files):
            self._index[stem] = size
        self.bytes = sum(self._index.values())
        self.hits = 0  # pages a request started from (read, then taken at its admission)
        self.writes = 0  # pages written
        self.dropped = 0  # pages not written (the queue was full, or the write failed)
        self.skipped = 0  # files refused at load (corrupt, foreign, wrong shape)
        self._warned = -WARN_EVERY_S  # when a failed write was last logged (writer thread)
        self._failed = 0  # writes failed since
        self._queue: queue.Queue[tuple[str, list[int], dict[str, mx.array], str] | None] = (
            queue.Queue(QUEUE_PAGES)
        )
        self._writer = threading.Thread(target=self._write_loop, name="vq-disk-tier", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="vq-disk-read")
        self._buffer = bytearray()  # the reader's: the file being read
        self._closing = False
        self.on_read: Callable[[], None] = lambda: None  # a read finished (the engine wakes)
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

    def has_page(self, tokens: list[int], first: int, parent: bytes, bs: int) -> bool:
        """Whether the tier holds page ``first`` of ``tokens`` (its parent's digest
        ``parent``)."""
        return self.has(chain(parent, tokens[first * bs : (first + 1) * bs]))

    def start_read(
        self, tokens: list[int], first: int, parent: bytes, limit: int, bs: int
    ) -> Future[Run] | None:
        """Read the pages of ``tokens`` from page ``first`` (whose parent's digest is
        ``parent``) up to ``limit`` pages, while the tier has them, on the reader thread; None
        when it lacks page ``first``."""
        if first >= limit or not self.has_page(tokens, first, parent, bs):
            return None
        future = self._reader.submit(self._read_run, tokens, first, parent, limit, bs)
        future.add_done_callback(lambda _: self.on_read())
        return future

    def run_kv(self, run: Run, skip: int) -> list[tuple[Parts, Parts]]:
        """``run``'s KV past its first ``skip`` pages, each layer's K and V as stored,
        concatenated (``[1, H, n * bs, *]`` each part); those pages count as hits. Engine
        thread."""
        self.hits += run.n_pages - skip
        n_parts = len(self.dtypes)
        spans: list[list[tuple[Parts, Parts]]] = []
        for n_pages, arrays in run.segments:
            if skip >= n_pages:
                skip -= n_pages
                continue
            typed = {}
            for name, a in arrays.items():
                want = self.dtypes[part_of(name)]
                a = a if a.dtype == want else a.view(want)
                if skip:
                    a = a[:, :, skip * a.shape[2] // n_pages :]
                typed[name] = a
            skip = 0
            spans.append(layers_of(typed, self.n_layers, n_parts))
        return [
            (join_spans([p[layer][0] for p in spans]), join_spans([p[layer][1] for p in spans]))
            for layer in range(self.n_layers)
        ]

    def refuse(self, digest: bytes, exc: BaseException) -> None:
        """A page file that cannot be served: one log line, and the file removed."""
        self.skipped += 1
        name = digest.hex()
        log.warning("prefix cache on disk: skipped %s (%s)", name[:16] + "...", reason(exc))
        self._forget(name, unlink=True)

    def save(
        self,
        digest: bytes,
        tokens: list[int],
        layers: list[tuple[Parts, Parts]],
        parent: bytes = b"",
    ) -> None:
        """Queue a page for the writer (its arrays' evaluation already launched); dropped when
        the page is on disk already or the queue is full. ``parent``: its parent's digest (a
        conversation's pages can then be found again from their files: ``chains``)."""
        name = digest.hex()
        if self.has(digest):
            return
        arrays = arrays_of(layers)
        with self._lock:
            self._pending[name] = (tokens, arrays)
        try:
            self._queue.put_nowait((name, tokens, arrays, parent.hex()))
        except queue.Full:
            with self._lock:
                del self._pending[name]
            self.dropped += 1

    def close(self, timeout: float = 30.0) -> None:
        """Stop the reader; write what is queued (for at most ``timeout`` seconds), then stop
        the writer."""
        if not self._closing:
            self._closing = True  # reads not started yet find nothing
            self._reader.submit(mx.clear_streams)  # MLX's streams of the reader thread
            self._reader.shutdown(wait=True)
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("prefix cache on disk: the writer is behind; pages queued are dropped")
            return
        self._writer.join(timeout)

    def chains(self, max_pages: int, max_runs: int = PRELOAD_RUNS) -> list[list[int]]:
        """The conversations the tier holds, as token runs from their first page, the most
        recently used first, at most ``max_runs`` of them and ``max_pages`` pages in all (a
        page several share counts once; the last run taken may be cut short): each ends at a
        page no other file goes on from. Reads the newest files' headers only (files whose
        header fails its checks are skipped, with one log line for all, and removed); a run
        whose chain back to the root misses a file is left out. Before the engine is
        ready."""
        with self._lock:
            names = list(reversed(self._index))[: 4 * max_pages]  # newest first
        nodes: dict[str, tuple[str, list[int]]] = {}
        bad: list[str] = []
        for name in names:
            try:
                with (self.dir / (name + SUFFIX)).open("rb") as f:
                    meta = read_meta(f, self.fp, name)
                nodes[name] = (meta["parent"], json.loads(meta["tokens"]))
            except FileNotFoundError:
                continue
            except Exception as exc:  # one line for all (an older server's files: many)
                bad.append(reason(exc))
                self.skipped += 1
                self._forget(name, unlink=True)
        if bad:
            log.warning("prefix cache on disk: skipped %d file(s) (%s)", len(bad), bad[0])
        continued = {parent for parent, _ in nodes.values()}
        root, taken, out = self.root_digest.hex(), set[str](), []
        for leaf in (n for n in nodes if n not in continued):
            path, at = [], leaf
            while at in nodes:
                path.append(at)
                at = nodes[at][0]
            if at != root:
                continue
            path.reverse()
            room = max_pages - len(taken)
            while len(set(path) - taken) > room:
                path.pop()
            if path:
                taken.update(path)
                out.append([t for name in path for t in nodes[name][1]])
            if len(taken) >= max_pages or len(out) >= max_runs:
                break
        return out

    # ------------------------------------------------------------------ reader thread

    def _read_run(self, tokens: list[int], first: int, parent: bytes, limit: int, bs: int) -> Run:
        if self._closing:
            return Run(first, 0, [])
        t0 = time.perf_counter()
        run = self._collect(tokens, first, parent, limit, bs)
        log.debug(
            "prefix cache on disk: read %d page(s) from page %d in %.0f ms",
            run.n_pages, first, (time.perf_counter() - t0) * 1000,
        )  # fmt: skip
        return run

    def _collect(self, tokens: list[int], first: int, parent: bytes, limit: int, bs: int) -> Run:
        run = Run(first, 0, [])
        seg: Segment | None = None  # consecutive pages read from files, into their place
        filled = 0

        def flush() -> None:
            nonlocal seg, filled
            if seg is not None and filled:
                run.segments.append((filled, seg.arrays(filled)))
            seg, filled = None, 0

        for i in range(first, limit):
            page_tokens = tokens[i * bs : (i + 1) * bs]
            digest = chain(parent, page_tokens)
            name = digest.hex()
            with self._lock:
                pending, on_disk = self._pending.get(name), name in self._index
            if pending is not None and pending[0] == page_tokens:
                flush()
                run.segments.append((1, pending[1]))
            elif on_disk:
                page = self._read_file(digest, page_tokens, seg.layout if seg else None)
                if page is None:
                    break
                if seg is None:
                    ahead = self._files_ahead(tokens, i, parent, limit, bs)
                    seg = Segment(page[0], ahead, self.n_layers)
                seg.fill(filled, page[1])
                filled += 1
            else:
                break
            run.n_pages += 1
            parent = digest
        flush()
        return run

    def _files_ahead(
        self, tokens: list[int], first: int, parent: bytes, limit: int, bs: int
    ) -> int:
        """How many pages from ``first`` on the tier holds as files (not queued), in a row."""
        n = 0
        for i in range(first, limit):
            parent = chain(parent, tokens[i * bs : (i + 1) * bs])
            name = parent.hex()
            with self._lock:
                if name not in self._index or name in self._pending:
                    break
            n += 1
        return max(n, 1)

    def _read_file(
        self, digest: bytes, tokens: list[int], layout: Layout | None
    ) -> tuple[Layout, memoryview] | None:
        """Page ``digest``'s layout and data (in the reader's buffer, valid until the next
        read) once its file passes ``page_file.read_header``'s checks, has that many bytes and
        their checksum, and has ``layout`` where given; else None (one log line, the file
        removed). A hit refreshes the file's place in the LRU order."""
        name = digest.hex()
        path = self.dir / (name + SUFFIX)
        try:
            with path.open("rb", buffering=0) as f:
                got, checksum = read_header(f, self.fp, name, tokens, self.n_layers, self.dtypes)
                if layout is not None and got != layout:
                    raise ValueError("not this tier's layout")
                if len(self._buffer) < got.size:
                    self._buffer = bytearray(got.size)
                data = memoryview(self._buffer)[: got.size]
                n = 0
                while n < got.size and (k := f.readinto(data[n:])):
                    n += k
                if n != got.size or f.read(1):
                    raise ValueError("its size does not match its header")
            if xxhash.xxh3_64_hexdigest(data) != checksum:
                raise ValueError("its bytes do not match their checksum")
        except Exception as exc:  # a bad file is a miss, never a failure
            self.refuse(digest, exc)
            return None
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(path)
        return got, data

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

    def _write(
        self, name: str, tokens: list[int], arrays: dict[str, mx.array], parent: str
    ) -> None:
        try:
            self._write_file(name, tokens, arrays, parent)
        finally:
            with self._lock:
                self._pending.pop(name, None)

    def _write_file(
        self, name: str, tokens: list[int], arrays: dict[str, mx.array], parent: str
    ) -> None:
        path = self.dir / (name + SUFFIX)
        # this process's own temporary name: two servers on one directory may write one page
        tmp = self.dir / f"{name}.{os.getpid()}{TMP}{SUFFIX}"
        meta = {"fingerprint": self.fp, "digest": name, "tokens": json.dumps(tokens)}
        meta["parent"] = parent
        try:
            write_page(tmp, arrays, meta)  # waits for the arrays' evaluation
            os.replace(tmp, path)
            size = path.stat().st_size
        except Exception as exc:  # a full disk, a removed directory: the page is not kept
            self.dropped += 1
            self._failed += 1
            now = time.monotonic()
            if now - self._warned >= WARN_EVERY_S:  # a full disk fails every page: one line
                log.warning(
                    "prefix cache on disk: could not write %d page(s) (%s); the pages stay "
                    "in memory only (metric veloxquant_prefix_cache_disk_dropped_total)",
                    self._failed, reason(exc),
                )  # fmt: skip
                self._warned, self._failed = now, 0
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
        tier.save(page.digest, list(page.key[1]), layers, page.parent)
