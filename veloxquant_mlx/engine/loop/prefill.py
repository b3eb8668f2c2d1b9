"""Prefill forwards (``Prefiller``): a prompt's chunks into stock mlx_lm caches that start from
its cached and loaded KV, or several short prompts in one left-padded forward, on an MLX stream
of their own where asked; the prompt's first token is sampled by the runner's sampler. What
comes out is a ``Prefilled`` (first tokens, each row's KV) for the runner to join to the batch.
Engine thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from veloxquant_mlx.engine.loop import last_logits, layer_capture
from veloxquant_mlx.engine.loop.join_clock import OVERHEAD_TOKENS, Launch
from veloxquant_mlx.engine.loop.joins import Prefilled
from veloxquant_mlx.engine.loop.seq import Chunk, Seq
from veloxquant_mlx.kv.layout import KVLayout
from veloxquant_mlx.kv.room import joined, make_room

if TYPE_CHECKING:
    from veloxquant_mlx.engine.loop.rows import Sampled


@dataclass(slots=True)
class _Staged:
    """A chunk's forward, built, being launched in parts (``--prefill-parts``): ``stages``
    (hidden states after runs of layers) one an engine turn, then ``final`` (its caches, for a
    chunk with more to come) or, for a prompt's last chunk, ``done`` (``Prefiller.advance``)."""

    seq: Seq
    stages: list[mx.array]
    final: list[Any]
    done: Prefilled | None
    work: float  # a part's share of the chunk's tokens and overhead


class Prefiller:
    """Runs prompts through the model before they join the batch.

    Args:
        model: The mlx_lm model (the runner's decode steps run it from here too).
        kv: The batch's layout (its attention route and prefill bucket; the cached pages a
            prompt starts from).
        n_layers: The model's caches.
        own_stream: Run the forwards and their first tokens on a stream of their own (made at
            the first prefill, on the engine thread: MLX's streams are per thread).
        sample_first: The runner's sampling of prompts' first tokens from their last logits.
        launched: A forward of this many tokens is launched: when it should be done (the join
            clock's), or None.
        split: A chunk's forward may be launched over several engine turns while rows
            decode (``chunk``'s ``split``, in the chunk's ``parts``; ``--prefill-parts``):
            each turn a run of its layers.
    """

    def __init__(
        self,
        model: Any,
        kv: KVLayout,
        n_layers: int,
        own_stream: bool,
        sample_first: Callable[[list[Seq], mx.array], Sampled],
        launched: Callable[[int], Launch | None],
        split: bool = False,
    ) -> None:
        self.model = model
        self.split = split and layer_capture.install(model)
        self.kv = kv
        self._n_layers = n_layers
        self.own_stream = own_stream
        self._stream: mx.Stream | None = None  # the prefill's, once made
        self._sample_first = sample_first
        self._launched = launched
        self._staged: list[_Staged] = []  # chunks launched a part a turn, oldest first
        self._work = 0.0  # tokens' worth launched since ``take_work``

    def stream(self) -> contextlib.AbstractContextManager[Any]:
        """Where a prefill forward and its first token run: its own stream, or the default."""
        if not self.own_stream:
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = mx.new_stream(mx.default_device())
        return mx.stream(self._stream)

    def take_work(self) -> float:
        """The tokens' worth of forwards launched since the last call (a forward's tokens and
        ``OVERHEAD_TOKENS``; a part its share): what the scheduler's parts learn from."""
        work, self._work = self._work, 0.0
        return work

    @property
    def staging(self) -> bool:
        """Whether a chunk's forward is being launched a part a turn (``advance``)."""
        return bool(self._staged)

    def advance(self, decoding: bool) -> list[Prefilled]:
        """Launch the next part of the oldest staged chunk (all of every one where no row is
        ``decoding``: nobody's step waits); a chunk whose parts are all launched is launched
        whole. Returns the prompts whose last chunk that was, to join the batch."""
        done: list[Prefilled] = []
        while self._staged:
            staged = self._staged[0]
            self._work += staged.work
            if staged.stages:
                mx.async_eval(staged.stages.pop(0))
            else:
                self._staged.pop(0)
                if staged.done is None:
                    mx.async_eval(staged.final)
                else:
                    done.append(staged.done)
            if decoding:
                break
        return done

    def forget(self, seq: Seq) -> None:
        """``seq`` left (finish, cancel, preemption): its staged chunk, if any, is dropped."""
        self._staged = [s for s in self._staged if s.seq is not seq]

    def chunk(self, chunk: Chunk, split: bool = False) -> Prefilled | None:
        """Run one chunk of a prompt into its row's prefill caches; once the prompt is all in,
        its first token sampled and its KV (``Prefilled``), else None. With ``split`` (rows
        decode, the chunk's ``parts`` > 1, no chunk staged already) only the first of its
        parts is launched now and None comes back: ``advance`` launches the rest, a part a turn, and
        returns the ``Prefilled`` of a prompt's last chunk once it is launched."""
        seq = chunk.seq
        state = seq.state
        assert state is not None
        bucket = self.kv.ragged.prefill_bucket
        if state.caches is None:
            state.caches = self._start_caches(seq, chunk.start, bucket)
        tokens = seq.tokens[chunk.start : chunk.start + chunk.n]
        # Padded at the end to the policy's bucket (kv.attention.CUDA_PREFILL_BUCKET): the
        # prompt's tokens never see the padding (causal), which is trimmed off the caches after
        extra = -chunk.n % bucket if bucket else 0
        launch = self._launched(chunk.n + extra)
        last = chunk.n - 1  # the position a completing chunk samples from
        parts = chunk.parts if split and self.split and not self._staged else 1
        with (
            self.stream(),
            last_logits.position(self.model, last),
            layer_capture.capturing(self.model, parts > 1) as outputs,
        ):
            logits = self.model(mx.array([tokens + [0] * extra]), cache=state.caches)
            if extra:
                for cache in state.caches:
                    cache.trim(extra)
            stages = layer_capture.stages(outputs, self._n_layers, parts)
            work = (chunk.n + extra + OVERHEAD_TOKENS) / (len(stages) + 1)  # a part's
            self._work += work
            if not chunk.completes:  # the next chunk builds on these: start them now
                if not chunk.start:  # the first chunk of an uncached prompt
                    make_room(state.caches, len(seq.tokens) + bucket)
                final = [(c.keys, c.values) for c in state.caches]
                if stages:
                    self._stage(_Staged(seq, stages, final, None, work))
                else:
                    mx.async_eval(final)
                return None
            sampled = self._sample_first([seq], last_logits.row(logits, last))
            layers = filled(state.caches)
        state.next_input = sampled.tokens
        done = Prefilled(sampled, [(seq, layers)], launch)
        if stages:
            self._stage(_Staged(seq, stages, [], done, work))
            return None
        return done

    def _stage(self, staged: _Staged) -> None:
        """Launch ``staged``'s first part now; ``advance`` the rest."""
        mx.async_eval(staged.stages.pop(0))
        self._staged.append(staged)

    def together(self, seqs: list[Seq]) -> Prefilled:
        """Prefill several whole prompts (each at most one chunk) in one left-padded forward
        and sample their first tokens: a burst of arrivals costs one forward instead of one
        each."""
        lengths = [len(s.tokens) for s in seqs]
        width = max(lengths)
        bucket = self.kv.ragged.prefill_bucket
        if bucket:  # more left padding, as in a chunk (``chunk``)
            width += -width % bucket
        padding = [width - n for n in lengths]
        tokens = mx.array([[0] * p + s.tokens for p, s in zip(padding, seqs, strict=True)])
        caches: list[Any] = [BatchKVCache(padding) for _ in range(self._n_layers)]
        for cache in caches:
            cache.vq_route = self.kv.ragged.prefill_route
        launch = self._launched(width * len(seqs))
        self._work += width * len(seqs) + OVERHEAD_TOKENS
        joins = []
        with self.stream(), last_logits.position(self.model, width - 1):
            logits = last_logits.row(self.model(tokens, cache=caches), width - 1)
            sampled = self._sample_first(list(seqs), logits)
            for i, seq in enumerate(seqs):
                p = padding[i]
                rows = [
                    (c.keys[i : i + 1, :, p:width], c.values[i : i + 1, :, p:width]) for c in caches
                ]
                joins.append((seq, rows))
                assert seq.state is not None
                seq.state.next_input = sampled.tokens[i : i + 1]
        return Prefilled(sampled, joins, launch)

    def _start_caches(self, seq: Seq, n_cached: int, bucket: int = 0) -> list[KVCache]:
        """Fresh prefill caches, holding the KV of the ``n_cached`` tokens ``seq`` starts
        with (found at admission): its cached pages', then what the disk tier loaded, with
        room for the rest of its prompt (and a bucket's padding) after them, so its chunks
        write in place (a stock cache grows by copying itself whole every 256 tokens)."""
        caches = [KVCache() for _ in range(self._n_layers)]
        for cache in caches:  # how the routed attention takes them (kv.attention)
            cache.vq_route = self.kv.ragged.prefill_route  # type: ignore[attr-defined]
        if not n_cached:
            return caches
        n_pages = seq.pages.n_known
        store = self.kv.layout_for(seq.kv_format)
        pieces: list[tuple[list[mx.array], list[mx.array]]] = [
            ([k], [v]) for k, v in (store.read_pages(seq.pages.held[:n_pages]) if n_pages else [])
        ]
        loaded, seq.preloaded = seq.preloaded, None
        if loaded is not None:  # as stored on disk (kv.codec): in the model's type for prefill
            decoded = [([self.decode(k)], [self.decode(v)]) for k, v in loaded]
            pieces = (
                [(a[0] + b[0], a[1] + b[1]) for a, b in zip(pieces, decoded, strict=True)]
                if pieces
                else decoded
            )
        room = len(seq.tokens) - n_cached + bucket
        for cache, (ks, vs) in zip(caches, pieces, strict=True):
            k, v = (joined(parts, room) for parts in (ks, vs))
            cache.keys, cache.values, cache.offset = k, v, n_cached
        keys = caches[0].keys
        assert keys is not None and keys.shape[2] == n_cached + room, "a prefill's KV ends there"
        return caches

    def decode(self, parts: tuple[mx.array, ...]) -> mx.array:
        """A span as the layout stores the server's own format (``kv.codec``; what the disk
        tier holds), in the model's type."""
        codec = getattr(self.kv.layout_for(""), "codec", None)
        return parts[0] if codec is None else codec.decode(parts)


def filled(caches: list[Any]) -> list[tuple[mx.array, mx.array]]:
    """Each prefill cache's keys and values up to its offset."""
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]
