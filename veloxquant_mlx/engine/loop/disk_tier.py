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
(``start_read``; ``disk_read.PageReader``): a request whose next pages are on disk waits for
them outside the engine's steps, which go on for everyone else; the reader checks each file and
copies its bytes once, straight into the run's joined arrays, and the engine thread only takes
the result (``run_kv``). Before a restarted engine is ready, ``chains`` names the conversations
to read back into memory.
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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import mlx.core as mx

from veloxquant_mlx.engine.loop.disk_read import PageReader, Run, conversations
from veloxquant_mlx.engine.loop.page_file import (
    SUFFIX,
    arrays_of,
    layers_of,
    part_of,
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
        self._reader = PageReader(self)
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
        future = self._reader.start(tokens, first, parent, limit, bs)
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
        self._reader.close()
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("prefix cache on disk: the writer is behind; pages queued are dropped")
            return
        self._writer.join(timeout)

    def chains(self, max_pages: int, max_runs: int = PRELOAD_RUNS) -> list[list[int]]:
        """The conversations the tier holds (``disk_read.conversations``), from the newest
        files' headers only (files whose header fails its checks are skipped, with one log
        line for all, and removed). Before the engine is ready."""
        with self._lock:
            names = list(reversed(self._index))[: 4 * max_pages]  # newest first
        nodes: dict[str, tuple[str, list[int]]] = {}
        bad: list[str] = []
        for name in names:
            try:
                with (self.dir / (name + SUFFIX)).open("rb") as f:
                    nodes[name] = read_meta(f, self.fp, name)
            except FileNotFoundError:
                continue
            except Exception as exc:  # one line for all (an older server's files: many)
                bad.append(reason(exc))
                self.skipped += 1
                self._forget(name, unlink=True)
        if bad:
            log.warning("prefix cache on disk: skipped %d file(s) (%s)", len(bad), bad[0])
        return conversations(nodes, self.root_digest.hex(), max_pages, max_runs)

    # ------------------------------------------------------------------ the reader's side

    def lookup(self, name: str) -> tuple[tuple[list[int], dict[str, mx.array]] | None, bool]:
        """Page ``name``'s copy queued for the writer (its tokens and arrays) if any, and
        whether its file is in the index."""
        with self._lock:
            return self._pending.get(name), name in self._index

    def touched(self, name: str) -> None:
        """A file was read: it goes to the LRU order's end, its time to now."""
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(self.dir / (name + SUFFIX))

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


def persist_at_stop(tier: DiskTier, cache: Any, kv: Any) -> None:
    """At a stop: every page of the prefix cache ``cache`` (None: none) to ``tier`` (those it
    lacks), then wait for its writer (bounded). A failure is logged: it never stops the
    shutdown."""
    try:
        if cache is not None:
            pages = cache.pages()
            save_pages(tier, kv, pages)
            log.info("prefix cache: %d pages kept on disk", len(pages))
    except Exception as exc:
        log.warning("prefix cache: pages not written at stop (%s)", type(exc).__name__)
    finally:
        tier.close()
