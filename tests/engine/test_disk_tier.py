"""The prefix cache's disk tier (``--prefix-cache-dir``) on the real engine: a conversation's
pages survive a restart and give the same tokens as a cold prefill; pages evicted under
pressure are written while serving; another model geometry never matches; corrupt, truncated
and foreign files are skipped with one log line each and never served; the directory stays
under its cap."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
import time

import pytest

from tests.engine.conftest import wait_idle
from veloxquant_mlx.engine.hosts.thread import Engine
from veloxquant_mlx.engine.loop import disk_tier, page_file
from veloxquant_mlx.engine.loop.disk_read import PageReader
from veloxquant_mlx.engine.loop.disk_tier import DiskTier
from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
BS = 16


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(n)]


def turn(engine: Engine, prompt: list[int], n: int = 12) -> tuple[list[int], int]:
    tokens, finish = engine.submit(GenerationRequest(tuple(prompt), n, GREEDY)).collect(120)
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
    return [t.token_id for t in tokens], finish.usage.cached_tokens


def files(path) -> list:
    """The page files (not one being written: ``<digest>.<pid>.tmp.safetensors``)."""
    return sorted(f for f in path.rglob("*.safetensors") if not f.stem.endswith(".tmp"))


@pytest.mark.parametrize("views", [True, False], ids=["into-mlx", "numpy-copy"])
def test_a_conversation_survives_a_restart_with_the_same_tokens(
    make_engine, tmp_path, caplog, monkeypatch, views
):
    """Read into MLX's memory through NumPy views, or (a backend without them) into NumPy and
    copied: the same tokens either way."""
    monkeypatch.setattr(page_file, "writable_views", lambda: views)
    rng = random.Random(3)
    prompt = words(rng, 70)
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    answer, _ = turn(first, prompt, 30)
    first.shutdown(5)  # a clean stop writes every cached page
    assert len(files(tmp_path)) == (70 + 30) // BS
    turn_two = prompt + answer + words(rng, 9)
    restarted = make_engine(
        kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0
    )
    with caplog.at_level(logging.DEBUG, logger="veloxquant.engine"):
        got, cached = turn(restarted, turn_two)
    assert cached == (70 + 30) // BS * BS
    reads = [r.getMessage() for r in caplog.records if "read" in r.getMessage()]
    assert any(f"read {(70 + 30) // BS} page(s) from page 0 in" in m for m in reads), reads
    stats = restarted.stats()
    assert stats.prefix_disk and stats.prefix_disk_hits_total == (70 + 30) // BS
    assert stats.prefix_disk_pages == (70 + 30) // BS and stats.prefix_disk_skipped_total == 0
    plain = make_engine(kv_cache_mb=32, prefix_caching=False)
    assert got == turn(plain, turn_two)[0]
    # loaded pages are cached in memory again: the next turn hits there, not on disk
    third = turn_two + got + words(rng, 4)
    assert turn(restarted, third)[1] == (len(turn_two) + len(got)) // BS * BS
    assert restarted.stats().prefix_disk_hits_total == (70 + 30) // BS
    wait_idle(restarted)


def test_files_a_crash_left_mid_write_are_not_pages_and_old_ones_are_removed(make_engine, tmp_path):
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    turn(first, words(random.Random(9), 40), 4)
    first.shutdown(5)
    pages = files(tmp_path)
    page = pages[0]
    fresh = page.with_name("f" * 64 + ".tmp.safetensors")
    stale = page.with_name("e" * 64 + ".tmp.safetensors")
    for f in (fresh, stale):
        f.write_bytes(page.read_bytes()[:50])
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    restarted = make_engine(
        kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0
    )
    assert restarted.stats().prefix_disk_pages == len(pages)
    assert fresh.exists() and not stale.exists()  # another server's write may be in progress


def test_a_page_is_written_under_a_name_of_this_process_then_renamed(
    make_engine, tmp_path, monkeypatch
):
    """Servers sharing the directory may write one page at once: each writes its own
    temporary file, so neither renames the other's half-written bytes."""
    written: list[str] = []
    save = disk_tier.write_page

    def recorded(path, *args, **kwargs):
        written.append(os.path.basename(path))
        return save(path, *args, **kwargs)

    monkeypatch.setattr(disk_tier, "write_page", recorded)
    engine = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    turn(engine, words(random.Random(12), 40), 4)
    engine.shutdown(5)
    assert len(written) == 40 // BS
    assert all(name.endswith(f".{os.getpid()}.tmp.safetensors") for name in written), written
    assert [f.name for f in files(tmp_path)] == sorted(n.split(".")[0] + ".safetensors"
                                                       for n in written)  # fmt: skip
    assert not list(tmp_path.rglob("*.tmp.safetensors"))


def test_writes_that_fail_are_dropped_with_one_log_line(make_engine, tmp_path, caplog):
    engine = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    turn(engine, words(random.Random(10), 100), 4)  # 6 full pages
    shutil.rmtree(tmp_path)  # the directory goes away under the server: every write fails
    with caplog.at_level(logging.WARNING, logger="veloxquant.engine"):
        engine.shutdown(5)  # a clean stop writes every cached page
    lines = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(lines) == 1 and "could not write 1 page(s)" in lines[0]
    assert engine.stats().prefix_disk_dropped_total == 100 // BS


def test_pages_evicted_under_pressure_are_written_and_found(make_engine, tmp_path):
    rng = random.Random(4)
    engine = make_engine(
        n_blocks=2 * 4 * 40, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0
    )  # 40 pages
    prompts = [words(rng, 300) for _ in range(3)]  # 18 full pages each: the first is evicted
    for p in prompts:
        turn(engine, p, 4)
    wait_idle(engine)
    written = files(tmp_path)
    assert engine.stats().prefix_evictions_total > 0
    assert 0 < len(written) <= engine.stats().prefix_disk_writes_total
    again = prompts[0] + words(rng, 3)
    got, cached = turn(engine, again, 4)
    assert cached == 300 // BS * BS  # from disk (evicted from memory)
    assert engine.stats().prefix_disk_hits_total > 0
    plain = make_engine(kv_cache_mb=32, prefix_caching=False)
    assert got == turn(plain, again, 4)[0]


def test_a_page_queued_for_the_writer_is_served_before_it_is_written(
    make_engine, tmp_path, monkeypatch
):
    rng = random.Random(6)
    engine = make_engine(
        n_blocks=2 * 4 * 40, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0
    )
    gate = threading.Event()
    save = disk_tier.write_page

    def held_back(*args, **kwargs):  # the writer is slow: nothing reaches the disk yet
        assert gate.wait(60)
        save(*args, **kwargs)

    monkeypatch.setattr(disk_tier, "write_page", held_back)
    prompts = [words(rng, 300) for _ in range(3)]
    for p in prompts:
        turn(engine, p, 4)
    wait_idle(engine)
    assert engine.stats().prefix_evictions_total > 0 and files(tmp_path) == []
    again = prompts[0] + words(rng, 3)
    got, cached = turn(engine, again, 4)
    assert cached == 300 // BS * BS  # memory, then the writer's queue
    assert engine.stats().prefix_disk_hits_total > 0 and files(tmp_path) == []
    gate.set()
    plain = make_engine(kv_cache_mb=32, prefix_caching=False)
    assert got == turn(plain, again, 4)[0]
    engine.shutdown(10)  # the writer finishes what is queued (and every cached page)
    assert len(files(tmp_path)) == engine.stats().prefix_disk_writes_total > 0


def test_a_request_waits_for_its_disk_read_while_the_others_run(make_engine, tmp_path, monkeypatch):
    rng = random.Random(7)
    prompt = words(rng, 300)
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    turn(first, prompt, 4)
    first.shutdown(5)
    gate, reading = threading.Event(), threading.Event()
    read = PageReader._read_file

    def slow_disk(self, *args):  # a slow disk: the reader thread waits, the engine must not
        reading.set()
        assert gate.wait(60)
        return read(self, *args)

    monkeypatch.setattr(PageReader, "_read_file", slow_disk)
    turns = []
    restarted = make_engine(
        kv_cache_mb=32,
        prefix_cache_dir=str(tmp_path),
        prefix_cache_preload_gb=0,
        step_hook=lambda: turns.append(1),
    )
    again = prompt + words(rng, 5)
    waiting = restarted.submit(GenerationRequest(tuple(again), 4, GREEDY))
    assert reading.wait(30)
    # nothing else to do: the engine sleeps until the read is done (no turn spins)
    time.sleep(0.3)
    assert len(turns) < 20
    # another request is served meanwhile
    other, _ = turn(restarted, words(rng, 40), 6)
    assert len(other) == 6 and restarted.stats().waiting == 1
    gate.set()
    tokens, finish = waiting.collect(120)
    assert isinstance(finish, FinishEvent) and finish.usage.cached_tokens == 300 // BS * BS
    plain = make_engine(kv_cache_mb=32, prefix_caching=False)
    assert [t.token_id for t in tokens] == turn(plain, again, 4)[0]


def test_at_most_two_requests_hold_a_disk_read(make_engine, tmp_path, monkeypatch):
    """A read's KV is memory outside the pool until its request is admitted: four returning
    conversations start two reads, the others wait their turn (the engine sleeps meanwhile),
    and all four hit their pages."""
    from veloxquant_mlx.engine.loop import lookup

    rng = random.Random(8)
    prompts = [words(rng, 100) for _ in range(4)]
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    for p in prompts:
        turn(first, p, 4)
    first.shutdown(5)
    gate = threading.Event()
    read, start = PageReader._read_file, DiskTier.start_read
    started = []

    def slow_disk(self, *args):
        assert gate.wait(60)
        return read(self, *args)

    def counted(self, *args):
        future = start(self, *args)
        if future is not None:
            started.append(future)
        return future

    monkeypatch.setattr(PageReader, "_read_file", slow_disk)
    monkeypatch.setattr(DiskTier, "start_read", counted)
    turns = []
    restarted = make_engine(
        kv_cache_mb=32,
        prefix_cache_dir=str(tmp_path),
        prefix_cache_preload_gb=0,
        step_hook=lambda: turns.append(1),
    )
    again = [p + words(rng, 3) for p in prompts]
    handles = [restarted.submit(GenerationRequest(tuple(p), 4, GREEDY)) for p in again]
    try:
        time.sleep(0.3)
        assert len(started) == lookup.MAX_DISK_READS == 2
        assert len(turns) < 20  # the two waiting their turn do not make the engine spin
    finally:
        gate.set()
    for h in handles:
        _, finish = h.collect(120)
        assert isinstance(finish, FinishEvent) and finish.usage.cached_tokens == 96
    assert len(started) == 4


def test_bad_files_are_skipped_with_one_line_never_served(make_engine, tmp_path, caplog):
    rng = random.Random(5)
    prompt = words(rng, 80)  # 5 full pages; the last token is left to prefill
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    want, _ = turn(first, prompt)
    first.shutdown(5)
    pages = files(tmp_path)
    assert len(pages) == (80 + 12) // BS
    # which file is which page is not known from outside: break all but one
    pages[0].write_bytes(b"not a safetensors file")
    pages[1].write_bytes(pages[1].read_bytes()[:100])  # truncated
    data = pages[2].read_bytes()
    pages[2].write_bytes(data[:40] + b"{" + data[41:])  # its header broken
    with caplog.at_level(logging.WARNING, logger="veloxquant.engine"):
        restarted = make_engine(
            kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0
        )
        got, cached = turn(restarted, prompt)
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert restarted.stats().prefix_disk_skipped_total == len(skipped) >= 1
    assert all(str(tmp_path) not in r.getMessage() for r in skipped)
    assert cached < 80 // BS * BS  # the chain stops at the first bad page
    assert got == want
    wait_idle(restarted)


def test_another_geometry_never_matches(make_engine, tmp_path):
    rng = random.Random(6)
    prompt = words(rng, 64)
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    turn(first, prompt)
    first.shutdown(5)
    other = make_engine(
        kv_cache_mb=32, block_size=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0
    )
    assert turn(other, [*prompt, 5])[1] == 0
    assert other.stats().prefix_disk_hits_total == 0


def test_the_directory_stays_under_its_cap(make_engine, tmp_path):
    rng = random.Random(7)
    engine = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0,
                         prefix_cache_disk_gb=200_000 / 2**30)  # fmt: skip
    for _ in range(4):
        turn(engine, words(rng, 100), 4)
    engine.shutdown(5)
    total = sum(f.stat().st_size for f in files(tmp_path))
    assert 0 < total <= 200_000  # a page is ~64 KB here: 25 pages written, at most 3 kept


def test_a_page_whose_bytes_changed_is_skipped_never_served(make_engine, tmp_path, caplog):
    """A file whose header is intact but whose KV bytes changed (a bit flipped on disk) fails
    its checksum: skipped with one line, and the tokens are a cold prefill's."""
    rng = random.Random(8)
    prompt = words(rng, 40)  # 2 full pages; the last token is left to prefill
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    want, _ = turn(first, prompt)
    first.shutdown(5)
    pages = files(tmp_path)
    assert len(pages) == (40 + 12) // BS
    for page in pages:  # the last byte is KV data, past the header
        data = bytearray(page.read_bytes())
        data[-1] ^= 0x40
        page.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="veloxquant.engine"):
        restarted = make_engine(
            kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0
        )
        got, cached = turn(restarted, prompt)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "checksum" in skipped[0]
    assert cached == 0 and restarted.stats().prefix_disk_hits_total == 0
    assert got == want
    wait_idle(restarted)


def _page_index(path, prompt: list[int]) -> int:
    """Which page of ``prompt`` a file holds (its tokens, from its safetensors metadata)."""
    data = path.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    tokens = json.loads(header["__metadata__"]["tokens"])
    return next(i for i in range(len(prompt) // BS) if prompt[i * BS : (i + 1) * BS] == tokens)


def test_a_bad_file_mid_run_ends_the_chain_there(make_engine, tmp_path, caplog):
    """The pages before a bad file are served, it and those after are not (their chain runs
    through it), and the tokens are a cold prefill's."""
    rng = random.Random(9)
    prompt = words(rng, 8 * BS + 1)
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    want, _ = turn(first, prompt)
    first.shutdown(5)
    by_page = {_page_index(f, prompt): f for f in files(tmp_path) if _page_index(f, prompt) < 8}
    assert sorted(by_page) == list(range(8))
    data = bytearray(by_page[5].read_bytes())
    data[-1] ^= 0x40  # KV bytes past the header: its checksum fails
    by_page[5].write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="veloxquant.engine"):
        restarted = make_engine(
            kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0
        )
        got, cached = turn(restarted, prompt)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "checksum" in skipped[0]
    assert cached == 5 * BS and restarted.stats().prefix_disk_hits_total == 5
    assert got == want
    assert not by_page[5].exists() and by_page[6].exists()  # only the bad file is removed
    wait_idle(restarted)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_a_restarted_engine_starts_with_its_conversations_in_memory(
    make_engine, tmp_path, caplog, layout
):
    """``--prefix-cache-preload-gb`` (default: half the pool): before it is ready, the engine
    reads the disk tier's conversations into memory, so the next turn hits there and reads
    nothing from disk; the counters start at zero; the tokens are a cold prefill's."""
    rng = random.Random(21)
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), kv_layout=layout)
    a, b = words(rng, 70), words(rng, 40)
    answer, _ = turn(first, a, 30)
    turn(first, b, 8)
    first.shutdown(5)
    with caplog.at_level(logging.INFO, logger="veloxquant.engine"):
        restarted = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), kv_layout=layout)
    lines = [r.getMessage() for r in caplog.records if "into memory in" in r.getMessage()]
    want = (70 + 30) // BS + (40 + 8) // BS
    assert lines == [f"prefix cache: {want} pages of 2 conversations read from disk into "
                     f"memory in {lines[0].rsplit(' in ', 1)[1]}"]  # fmt: skip
    stats = restarted.stats()
    assert stats.cached_blocks > 0 and stats.prefix_disk_hits_total == 0
    assert stats.prefix_queries_total == 0 and stats.requests_finished_total == {}
    turn_two = a + answer + words(rng, 9)
    got, cached = turn(restarted, turn_two)
    assert cached == (70 + 30) // BS * BS
    assert restarted.stats().prefix_disk_hits_total == 0  # memory, not disk
    plain = make_engine(kv_cache_mb=32, prefix_caching=False)
    assert got == turn(plain, turn_two)[0]


def test_the_preload_takes_the_newest_conversations_up_to_its_budget(make_engine, tmp_path):
    rng = random.Random(22)
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path))
    old, new = words(rng, 64), words(rng, 64)
    turn(first, old, 4)
    time.sleep(0.05)  # the files' times order them
    turn(first, new, 4)
    first.shutdown(5)
    page = first.stats().kv_bytes_per_block * 2 * first.info.kv_layers
    restarted = make_engine(
        kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=4 * page / 2**30
    )
    assert turn(restarted, [*new, 1])[1] == 64  # the newest, whole: its 4 pages
    assert restarted.stats().prefix_disk_hits_total == 0
    assert turn(restarted, [*old, 1])[1] == 64  # the older one: from disk on its hit
    assert restarted.stats().prefix_disk_hits_total == 4


def test_a_bad_file_does_not_stop_the_preload(make_engine, tmp_path, caplog):
    rng = random.Random(23)
    first = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path))
    prompt = words(rng, 64)
    turn(first, prompt, 4)
    first.shutdown(5)
    by_page = {_page_index(f, prompt): f for f in files(tmp_path)}
    by_page[2].write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="veloxquant.engine"):
        restarted = make_engine(kv_cache_mb=32, prefix_cache_dir=str(tmp_path))
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and not by_page[2].exists()
    assert turn(restarted, [*prompt, 1])[1] == 2 * BS  # the pages before the bad one
    plain = make_engine(kv_cache_mb=32, prefix_caching=False)
    assert turn(restarted, [*prompt, 2])[0] == turn(plain, [*prompt, 2])[0]
