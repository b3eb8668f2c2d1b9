"""The disk tier's reader (``disk_tier.DiskTier``): the thread that reads a prompt's next pages
from their files while the engine's steps go on (``PageReader``), and which conversations a
restarted engine reads back (``conversations``).

A read walks the prompt's hash chain from its first page the memory lacks: a page still queued
for the writer is taken as its copy; a file is checked (``page_file.read_header``), its data read
into one reused buffer, its size and checksum checked, and copied once into its place in the
run's joined arrays (``page_file.Segment``); the first missing or bad page ends the run.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import xxhash

from veloxquant_mlx.engine.loop.page_file import SUFFIX, Layout, Segment, read_header
from veloxquant_mlx.engine.loop.prefix_cache import chain

log = logging.getLogger("veloxquant.engine")


@dataclass(slots=True)
class Run:
    """The pages a read found, from page ``first`` on: ``segments`` in chain order, each ``(n
    pages, the page's arrays by name)``, the arrays of consecutive files joined along the
    token axis by the reader (raw: ``run_kv`` gives them their dtype), a page still queued for
    the writer as its copy."""

    first: int
    n_pages: int
    segments: list[tuple[int, dict[str, mx.array]]]


Step = tuple[bytes, list[int], dict[str, mx.array] | None]  # ``PageReader._walk``'s


class Files(Protocol):
    """What the reader needs of the tier (``DiskTier``)."""

    dir: Path
    fp: str
    n_layers: int
    dtypes: tuple[Any, ...]

    def lookup(self, name: str) -> tuple[tuple[list[int], dict[str, mx.array]] | None, bool]:
        """A page's queued copy if any, and whether its file is indexed."""

    def refuse(self, digest: bytes, exc: BaseException) -> None:
        """A file that cannot be served: logged and removed."""

    def touched(self, name: str) -> None:
        """A file was read (its LRU place)."""


class PageReader:
    """One reader thread for the tier's reads, and its buffer (the file being read)."""

    def __init__(self, tier: Files) -> None:
        self.tier = tier
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vq-disk-read")
        self._buffer = bytearray()
        self.closing = False  # reads not started yet find nothing

    def start(
        self, tokens: list[int], first: int, parent: bytes, limit: int, bs: int
    ) -> Future[Run]:
        """Read ``tokens``' pages from page ``first`` (its parent's digest ``parent``) up to
        ``limit``, on the reader thread."""
        return self._pool.submit(self._read_run, tokens, first, parent, limit, bs)

    def close(self) -> None:
        """Let the reads in flight end, then stop the thread (MLX's streams of the thread
        cleared on it first)."""
        if not self.closing:
            self.closing = True
            self._pool.submit(mx.clear_streams)
            self._pool.shutdown(wait=True)

    def _read_run(self, tokens: list[int], first: int, parent: bytes, limit: int, bs: int) -> Run:
        if self.closing:
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
        steps = self._walk(tokens, first, parent, limit, bs)
        seg: Segment | None = None  # consecutive pages read from files, into their place
        filled = 0

        def flush() -> None:
            nonlocal seg, filled
            if seg is not None and filled:
                run.segments.append((filled, seg.arrays(filled)))
            seg, filled = None, 0

        for k, (digest, page_tokens, queued) in enumerate(steps):
            if queued is not None:
                flush()
                run.segments.append((1, queued))
            else:
                page = self._read_file(digest, page_tokens, seg.layout if seg else None)
                if page is None:
                    break
                if seg is None:  # sized for the files in a row from here
                    end = next(
                        (j for j in range(k, len(steps)) if steps[j][2] is not None), len(steps)
                    )
                    seg = Segment(page[0], end - k, self.tier.n_layers)
                seg.fill(filled, page[1])
                filled += 1
            run.n_pages += 1
        flush()
        return run

    def _walk(
        self, tokens: list[int], first: int, parent: bytes, limit: int, bs: int
    ) -> list[Step]:
        """The pages from ``first`` on while the tier has them: each one's digest, tokens, and
        its arrays where it is still queued for the writer (None: read its file)."""
        steps: list[Step] = []
        for i in range(first, limit):
            page_tokens = tokens[i * bs : (i + 1) * bs]
            parent = chain(parent, page_tokens)
            pending, on_disk = self.tier.lookup(parent.hex())
            if pending is not None and pending[0] == page_tokens:
                steps.append((parent, page_tokens, pending[1]))
            elif on_disk:
                steps.append((parent, page_tokens, None))
            else:
                break
        return steps

    def _read_file(
        self, digest: bytes, tokens: list[int], layout: Layout | None
    ) -> tuple[Layout, memoryview] | None:
        """Page ``digest``'s layout and data (in the reader's buffer, valid until the next
        read) once its file passes ``page_file.read_header``'s checks, has that many bytes and
        their checksum, and has ``layout`` where given; else None (one log line, the file
        removed). A hit refreshes the file's place in the LRU order."""
        name = digest.hex()
        tier = self.tier
        try:
            with (tier.dir / (name + SUFFIX)).open("rb", buffering=0) as f:
                got, checksum = read_header(f, tier.fp, name, tokens, tier.n_layers, tier.dtypes)
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
            tier.refuse(digest, exc)
            return None
        tier.touched(name)
        return got, data


def conversations(
    nodes: dict[str, tuple[str, list[int]]], root: str, max_pages: int, max_runs: int
) -> list[list[int]]:
    """The conversations among ``nodes`` (page name -> its parent's name and its tokens, the
    newest first) as token runs from their first page (whose parent is ``root``), the newest
    first, at most ``max_runs`` of them and ``max_pages`` pages in all (a page several share
    counts once; the last run taken may be cut short): each ends at a page no other goes on
    from; a run whose chain back to the root misses a page is left out."""
    continued = {parent for parent, _ in nodes.values()}
    taken: set[str] = set()
    out: list[list[int]] = []
    for leaf in (n for n in nodes if n not in continued):
        path: list[str] = []
        at = leaf
        while at in nodes and len(path) <= len(nodes):  # a broken header's cycle ends too
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
