"""What the prefix cache keeps of a request's KV: ``kv_of(i)`` for its page ``i``, made when a
prefilled row joins (``page_source``), when a row leaves (``row_pages``, the pages it
generated) and when a prompt leaves before it joined (``prefill_pages``). Nothing to copy where
the layout keeps pages in the pool's blocks (paged); in the dense layout, one copy per layer
and stream of the new pages' span, which the pages point into. Engine thread only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from veloxquant_mlx.engine.loop.prefill import filled
from veloxquant_mlx.engine.loop.seq import Seq
from veloxquant_mlx.kv.layout import KVLayout
from veloxquant_mlx.kv.paged import PagedKV


class PageCopies:
    """The copies a page's KV is kept in, for the runner's ``kv`` and its batch's ``rows`` (the
    runner's list, by slot); ``defer`` evaluates arrays with the next launch."""

    def __init__(
        self,
        kv: KVLayout,
        block_size: int,
        rows: list[Seq | None],
        defer: Callable[[list[mx.array]], None],
    ) -> None:
        self.kv = kv
        self.block_size = block_size
        self.rows = rows
        self.defer = defer
        self._copied_out = False  # a leaving row's pages were copied since the last launch

    def page_source(
        self, seq: Seq, layers: list[tuple[mx.array, mx.array]], n_tokens: int | None = None
    ) -> Any:
        """What the prefix cache keeps for the joined ``seq``'s prompt page ``i``
        (``kv_of(i)``): nothing where the layout keeps pages in the pool's blocks (paged); in
        the dense layout, one copy per layer and stream of the new pages' span, made on the
        first call and evaluated with the next launch (pages point into it: a few copies per
        request, not one per page and layer)."""
        encode = self.kv.layout_for(seq.kv_format).encode_span
        return self._span_source(
            seq,
            lambda a, b: [(encode(k[:, :, a:b]), encode(v[:, :, a:b])) for k, v in layers],
            n_tokens=n_tokens,
        )

    def row_pages(self, seq: Seq) -> Any:
        """``kv_of`` for the pages a leaving row generated (``BlockTables.cache_leaving``), None
        if ``seq`` is not a row of the batch: in the dense layout a copy out of the row's slot
        of the working set, started at once (not deferred to the next launch): a read of the
        working set still pending when the next step writes it makes that write copy every
        layer's working set (``copied_out`` says the launch must wait for it)."""
        if seq not in self.rows:
            return None
        slot = self.rows.index(seq)
        return self._span_source(seq, lambda a, b: self.kv.row_span(slot, a, b), at_once=True)

    def prefill_pages(self, seq: Seq) -> tuple[int, Any] | None:
        """What a prompt that leaves before it joined the batch (its client gave up: agents
        resend a prompt whose prefill outlasted their timeout; or it was preempted) has
        written: how many of its tokens have KV in its prefill caches, and ``kv_of`` for
        their pages; None if nothing (no chunk run yet). The paged layout writes a prompt's
        blocks when it joins: here its full pages past the cached ones are written first."""
        state = seq.state
        if state is None or state.caches is None:
            return None
        layers = filled(state.caches)
        n = min(seq.n_kv, len(seq.tokens), int(layers[0][0].shape[2]))
        if isinstance(self.kv, PagedKV) and seq.table:
            start = seq.pages.n_known * self.block_size
            self.kv.put_span(layers, seq.table, start, n // self.block_size * self.block_size)
        return n, self.page_source(seq, layers, n)

    def copied_out(self) -> bool:
        """Whether a leaving row's pages were copied out of the working set since the last
        launch (``row_pages``). MLX writes an array in place only when nothing else holds it,
        and it holds a launched copy's input until the copy has run: the next step is
        launched once the copy is done (``mx.synchronize``), or its first write to each
        layer's working set copies the whole of it (BENCHMARKS.md, "Answers cached")."""
        return self._copied_out

    def launched(self) -> None:
        """A step was launched: what was copied before it runs before it."""
        self._copied_out = False

    def _span_source(
        self,
        seq: Seq,
        read: Callable[[int, int], list[Any]],
        at_once: bool = False,
        n_tokens: int | None = None,
    ) -> Any:
        bs = self.block_size
        region: list[Any] = []  # [(first page index, [(k, v) per layer])]

        def kv_of(i: int) -> Any:
            if self.kv.keeps_pages:
                return None
            if not region:
                known = min(seq.n_kv, len(seq.tokens)) if n_tokens is None else n_tokens
                end = known // bs * bs
                span = tree_map(mx.contiguous, read(i * bs, end))  # quantized: 3 parts each
                flat: list[mx.array] = [x for _, x in tree_flatten(span)]  # type: ignore[misc,str-unpack]
                if at_once:
                    mx.async_eval(flat)
                    self._copied_out = True
                else:
                    self.defer(flat)
                region.append((i, span))
            first, span = region[0]
            return span, i - first

        return kv_of
