"""Automatic prefix caching: full KV blocks shared between requests by content. No MLX.

A *page* is one block-sized run of a sequence's tokens in every layer: the ``2 * n_layers`` pool
blocks at one index of a request's block table (K and V of each layer). A full page is keyed by
its parent page (the page before it in the same sequence, ``ROOT`` for the first) and its own
token ids; keys are compared exactly (a dict key, not a digest), so two sequences share a page
only when every token before and in it is the same. One engine serves one model with one KV
format, so the model, adapter and format need not be in the key.

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
    ids: list[int]  # the block id in each of the 2 * n_layers table lists
    blocks: list[Any]  # the pool's Block objects, for freeing
    kv: Any = None  # the runner's copy of the page's K/V when the layout does not keep it
    refs: int = 0
    digest: bytes = b""  # the hash chain of its tokens and all before (``chain``)


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
        self.counts = CacheCounts()

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: list[int], limit: int) -> list[Page]:
        """The longest chain of cached pages that covers a prefix of ``tokens[:limit]``."""
        bs = self.block_size
        found: list[Page] = []
        parent = ROOT
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
            page.refs += 1

    def release(self, pages: list[Page]) -> None:
        for page in pages:
            page.refs -= 1
            if page.refs == 0:
                self._lru[page.serial] = page  # the most recently used end

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
    ) -> None:
        """Cache the full pages of ``tokens[:n_tokens]`` (KV written) past ``seq.n_known``.

        A new page takes the request's blocks at its index (handed to ``CACHE_OWNER``) and
        ``kv_of(index)`` as its payload; the request holds it. Where the same content is cached
        already, the request keeps its own blocks and the chain goes on from the cached twin.
        """
        bs = self.block_size
        end = min(n_tokens // bs, len(table[0]) if table else 0)
        if end <= seq.n_known:
            return
        mine = {b.block_id: b for b in self.pool.blocks_for(owner)}
        digest = self.root if seq.tail_digest is None else seq.tail_digest
        for i in range(seq.n_known, end):
            key = (seq.tail, tuple(tokens[i * bs : (i + 1) * bs]))
            digest = chain(digest, key[1])
            page = self._pages.get(key)
            if page is None:
                ids = [column[i] for column in table]
                blocks = [mine[b] for b in ids if b in mine]
                if len(blocks) != len(ids):  # not all its own (cannot happen): leave it
                    break
                self._serial += 1
                page = Page(self._serial, key, ids, blocks, kv_of(i), refs=1, digest=digest)
                self.pool.transfer(blocks, owner=owner, new_owner=CACHE_OWNER)
                self._pages[key] = page
                seq.held.append(page)
            seq.tail, seq.tail_digest = page.serial, digest
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
            page.kv = None
            gone += 1
        self.counts.evictions += gone
        return gone

    def reset(self) -> int:
        """Drop every unreferenced page; returns the blocks freed."""
        return self.evict(len(self._lru)) * self.blocks_per_page

    def n_evictable(self) -> int:
        return len(self._lru)

    def refresh_counts(self) -> CacheCounts:
        c = self.counts
        c.pages, c.evictable_pages = len(self._pages), len(self._lru)
        c.blocks = c.pages * self.blocks_per_page
        c.evictable_blocks = c.evictable_pages * self.blocks_per_page
        return c

    def pages(self) -> list[Page]:
        return list(self._pages.values())
