"""Automatic prefix caching: full KV blocks shared between requests by content. No MLX.

A *page* is one block-sized run of a sequence's tokens in every layer: the ``2 * n_layers`` pool
blocks at one index of a request's block table (K and V of each layer). A full page is keyed by
its parent page (the page before it in the same sequence, its format's root for the first:
``ROOT`` for the server's own) and its own token ids; keys are compared exactly (a dict key,
not a digest), so two sequences share a page only when every token before and in it is the
same, in the same format. One engine serves one model, so the model need not be in the key.
A page of a format wider than the pool's blocks takes ``span`` blocks per layer and stream
(``blocks.BlockMath``); the counts below are in units of one block per layer and stream.

A request that finds cached pages for its prompt holds them (a reference each) in its table
instead of blocks of its own, and prefills only the rest (at least its last token, so there
are logits). Pages a request fills are registered (their blocks handed to ``CACHE_OWNER`` in the
pool, in place): its prompt's once it is prefilled, the generated ones when it ends. A page no
request references stays cached and evictable, least recently used first; allocation evicts
before it refuses, queues or preempts anyone, so caching never costs a request its admission.

Owned by the scheduler (engine thread only); the snapshot publishes its counts.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from veloxquant_mlx.pool import BlockPoolAllocator

CACHE_OWNER = -1  # the pool owner of every cached block (request ids count up from 1)
ROOT = 0  # the parent serial of a sequence's first page


def chain(parent: bytes, tokens: Iterable[int]) -> bytes:
    """A page's digest: its parent's digest and its own tokens (the disk tier's key; the
    first page's parent is the cache's root, the engine's fingerprint)."""
    return hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in tokens)).digest()


@dataclass(eq=False, slots=True)
class Page:
    """One cached page: its key, its pool blocks (one per table list) and its references."""

    serial: int
    key: tuple[int, tuple[int, ...]]
    ids: list[int]  # its ``span`` block ids in each of the 2 * n_layers table lists, in order
    blocks: list[Any]  # the pool's Block objects, for freeing
    kv: Any = None  # the runner's copy of the page's K/V when the layout does not keep it
    refs: int = 0
    digest: bytes = b""  # the hash chain of its tokens and all before (``chain``)
    fmt: str = ""  # the KV format it holds ("": the server's own)
    span: int = 1  # blocks per table list
    parent: bytes = b""  # its parent's digest (the disk tier keeps the link)

    def column(self, j: int) -> list[int]:
        """Its block ids in table list ``j``."""
        return self.ids[j * self.span : (j + 1) * self.span]


@dataclass(slots=True)
class CacheCounts:
    """What ``/metrics`` and ``/admin`` show of the cache."""

    pages: int = 0
    evictable_pages: int = 0
    blocks: int = 0
    evictable_blocks: int = 0
    queries: int = 0  # prompt tokens looked up, one lookup per request
    hits: int = 0  # of them, tokens found cached
    evictions: int = 0  # pages evicted (pressure, shrink or reset)


@dataclass(slots=True)
class SeqPages:
    """One request's side of the cache: the pages it references and how far it is registered."""

    held: list[Page] = field(default_factory=list)
    n_known: int = 0  # pages 0..n_known-1 are cached (held by it, or a duplicate someone holds)
    tail: int = ROOT  # the serial of page n_known - 1's cached twin
    tail_digest: bytes | None = None  # its digest (None: the cache's root)
    n_cached: int = 0  # prompt tokens its first admission found cached (usage.cached_tokens)


class PrefixCache:
    """Pages by key, the evictable ones in LRU order, and the pool blocks they own.

    Args:
        pool: The shared pool; cached blocks are checked out to ``CACHE_OWNER``.
        n_layers: Layers of the model (a page is ``2 * n_layers`` blocks).
    """

    def __init__(self, pool: BlockPoolAllocator, n_layers: int, root: bytes = b"") -> None:
        self.pool = pool
        self.root = root  # the first page's parent digest
        # Called with each page about to be evicted (its KV still there): the disk tier's.
        self.on_evict: Callable[[list[Page]], None] | None = None
        self.block_size = pool.config.block_size
        self.blocks_per_page = 2 * n_layers
        self._pages: dict[tuple[int, tuple[int, ...]], Page] = {}
        self._lru: collections.OrderedDict[int, Page] = collections.OrderedDict()
        self._serial = ROOT
        self._roots: dict[str, int] = {"": ROOT}  # each format's first-page parent serial
        self._units = 0  # spans of every page
        self.units_by_format: collections.Counter[str] = collections.Counter()  # "" own format
        self._evictable_units = 0  # spans of the pages nobody holds
        self.counts = CacheCounts()

    def root_of(self, fmt: str) -> tuple[int, bytes]:
        """The parent serial and digest of a first page of format ``fmt`` ("": the server's
        own, ``ROOT`` and ``root``; another format its own, below every page's serial)."""
        if not fmt:
            return ROOT, self.root
        serial = self._roots.setdefault(fmt, ROOT - len(self._roots))
        return serial, hashlib.sha256(self.root + fmt.encode()).digest()

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: list[int], limit: int, fmt: str = "") -> list[Page]:
        """The longest chain of cached pages of format ``fmt`` that covers a prefix of
        ``tokens[:limit]``."""
        bs = self.block_size
        found: list[Page] = []
        parent = self.root_of(fmt)[0]
        for i in range(limit // bs):
            page = self._pages.get((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if page is None:
                break
            found.append(page)
            parent = page.serial
        return found

    def acquire(self, pages: list[Page]) -> None:
        for page in pages:
            if page.refs == 0:
                del self._lru[page.serial]
                self._evictable_units -= page.span
            page.refs += 1

    def release(self, pages: list[Page]) -> None:
        """Let go of ``pages`` (a chain, root first). Those nobody holds now join the most
        recently used end tail first, so eviction takes a chain from its tail: the pages
        left stay a prefix that a lookup can still reach (a page past an evicted one cannot
        be matched), and the disk tier picks up where memory stops."""
        for page in reversed(pages):
            page.refs -= 1
            if page.refs == 0:
                self._lru[page.serial] = page
                self._evictable_units += page.span

    def count_lookup(self, queried: int, hit: int) -> None:
        self.counts.queries += queried
        self.counts.hits += hit

    # ------------------------------------------------------------------ registration

    def register(
        self,
        seq: SeqPages,
        tokens: list[int],
        n_tokens: int,
        table: list[list[int]],
        owner: int,
        kv_of: Callable[[int], Any],
        fmt: str = "",
        span: int = 1,
    ) -> None:
        """Cache the full pages of ``tokens[:n_tokens]`` (KV written, in format ``fmt``, each
        page ``span`` blocks of each table list) past ``seq.n_known``.

        A new page takes the request's blocks at its index (handed to ``CACHE_OWNER``) and
        ``kv_of(index)`` as its payload; the request holds it. Where the same content is cached
        already, the request keeps its own blocks and the chain goes on from the cached twin.
        """
        bs = self.block_size
        end = min(n_tokens // bs, len(table[0]) // span if table else 0)
        if end <= seq.n_known:
            return
        mine = {b.block_id: b for b in self.pool.blocks_for(owner)}
        root, root_digest = self.root_of(fmt)
        tail = root if seq.n_known == 0 else seq.tail
        digest = root_digest if seq.tail_digest is None else seq.tail_digest
        for i in range(seq.n_known, end):
            key = (tail, tuple(tokens[i * bs : (i + 1) * bs]))
            parent, digest = digest, chain(digest, key[1])
            page = self._pages.get(key)
            if page is None:
                ids = [b for column in table for b in column[i * span : (i + 1) * span]]
                blocks = [mine[b] for b in ids if b in mine]
                if len(blocks) != len(ids):  # not all its own (cannot happen): leave it
                    break
                self._serial += 1
                page = Page(self._serial, key, ids, blocks, kv_of(i), 1, digest, fmt, span, parent)
                self.pool.transfer(blocks, owner=owner, new_owner=CACHE_OWNER)
                self._pages[key] = page
                self._units += span
                self.units_by_format[fmt] += span
                seq.held.append(page)
            tail = page.serial
            seq.tail, seq.tail_digest = tail, digest
            seq.n_known = i + 1

    # ------------------------------------------------------------------ eviction

    def evict(self, n_pages: int) -> int:
        """Drop up to ``n_pages`` unreferenced pages, least recently used first; returns how
        many went (their blocks are free in the pool)."""
        if self.on_evict is not None and self._lru:
            self.on_evict(list(itertools.islice(self._lru.values(), n_pages)))
        gone = 0
        while gone < n_pages and self._lru:
            _, page = self._lru.popitem(last=False)
            del self._pages[page.key]
            self.pool.free(page.blocks, owner=CACHE_OWNER)
            self._units -= page.span
            self.units_by_format[page.fmt] -= page.span
            self._evictable_units -= page.span
            page.kv = None
            gone += 1
        self.counts.evictions += gone
        return gone

    def evict_units(self, n_units: int) -> None:
        """Evict the least recently used pages until ``n_units`` units (one block per layer
        and stream each) are free, or none is left."""
        n_pages = units = 0
        for page in self._lru.values():
            if units >= n_units:
                break
            n_pages += 1
            units += page.span
        self.evict(n_pages)

    def reset(self) -> int:
        """Drop every unreferenced page; returns the blocks freed."""
        before = self._units
        self.evict(len(self._lru))
        return (before - self._units) * self.blocks_per_page

    def n_evictable(self) -> int:
        """Units (one block per layer and stream) of the pages nobody holds: a page of the
        server's own format is one."""
        return self._evictable_units

    def refresh_counts(self) -> CacheCounts:
        c = self.counts
        c.pages, c.evictable_pages = len(self._pages), len(self._lru)
        c.blocks = self._units * self.blocks_per_page
        c.evictable_blocks = self._evictable_units * self.blocks_per_page
        return c

    def pages(self) -> list[Page]:
        return list(self._pages.values())
