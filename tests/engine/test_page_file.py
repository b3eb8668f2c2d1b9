"""The disk tier's page files on their own: pages of every part layout (a float page; a
quantized page's codes, scales and biases) come back from a fresh tier bit for bit, through
MLX's memory or a NumPy copy; a file of another layout or without a checksum is skipped."""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import pytest

from veloxquant_mlx.engine.loop import page_file
from veloxquant_mlx.engine.loop.disk_tier import DiskTier
from veloxquant_mlx.engine.loop.prefix_cache import chain

BS = 4
FP = hashlib.sha256(b"test_page_file").hexdigest()


def page(layers: int, dtypes: tuple, seed: int) -> list[tuple[tuple, tuple]]:
    """One page's K and V per layer: a part per dtype (a float part's width 8; the codes of a
    quantized page width 2, its scales and biases 1, as ``kv.codec`` stores them)."""
    mx.random.seed(seed)

    def part(dt: mx.Dtype, j: int) -> mx.array:
        shape = (1, 2, BS, 8 if j == 0 and dt != mx.uint32 else 2 if j == 0 else 1)
        if dt == mx.uint32:
            return mx.random.randint(0, 2**31, shape).astype(mx.uint32)
        return mx.random.normal(shape).astype(dt)

    out = [(tuple(part(dt, j) for j, dt in enumerate(dtypes)),
            tuple(part(dt, j) for j, dt in enumerate(dtypes))) for _ in range(layers)]  # fmt: skip
    mx.eval(out)
    return out


def write(root, layers: int, dtypes: tuple, n: int) -> tuple[list[int], list]:
    tier = DiskTier(root, 1 << 30, FP, layers, dtypes)
    tokens = list(range(100, 100 + n * BS))
    parent, pages = tier.root_digest, []
    for i in range(n):
        parent = chain(parent, tokens[i * BS : (i + 1) * BS])
        pages.append(page(layers, dtypes, i))
        tier.save(parent, tokens[i * BS : (i + 1) * BS], pages[-1])
    tier.close(60)
    return tokens, pages


def read(root, layers: int, dtypes: tuple, tokens: list[int], n: int):
    tier = DiskTier(root, 1 << 30, FP, layers, dtypes)
    try:
        future = tier.start_read(tokens, 0, tier.root_digest, n, BS)
        run = future.result(60) if future is not None else None
        return run, (tier.run_kv(run, 0) if run is not None and run.n_pages else None), tier
    finally:
        tier.close()


@pytest.mark.parametrize("views", [True, False], ids=["into-mlx", "numpy-copy"])
@pytest.mark.parametrize(
    "dtypes", [(mx.float32,), (mx.bfloat16,), (mx.uint32, mx.bfloat16, mx.bfloat16)],
    ids=["float32", "bfloat16", "quantized"],
)  # fmt: skip
def test_pages_come_back_bit_for_bit(tmp_path, monkeypatch, views, dtypes):
    monkeypatch.setattr(page_file, "writable_views", lambda: views)
    layers, n = 3, 5
    tokens, pages = write(tmp_path, layers, dtypes, n)
    run, kv, tier = read(tmp_path, layers, dtypes, tokens, n)
    assert run is not None and run.n_pages == n and tier.skipped == 0
    for layer in range(layers):
        for s in range(2):
            for j, dt in enumerate(dtypes):
                want = mx.concatenate([p[layer][s][j] for p in pages], axis=2)
                got = kv[layer][s][j]
                assert got.dtype == dt and got.shape == want.shape
                assert mx.array_equal(got, want).item()
    # part of a run: the pages past the first two
    tier2 = DiskTier(tmp_path, 1 << 30, FP, layers, dtypes)
    try:
        run = tier2.start_read(tokens, 0, tier2.root_digest, n, BS).result(60)
        skipped = tier2.run_kv(run, 2)
        want = mx.concatenate([p[0][1][0] for p in pages[2:]], axis=2)
        assert mx.array_equal(skipped[0][1][0], want).item()
    finally:
        tier2.close()


def test_the_file_is_safetensors_part_by_part(tmp_path):
    """Any safetensors reader reads a page file; each part's arrays lie back to back."""
    dtypes = (mx.uint32, mx.bfloat16, mx.bfloat16)
    write(tmp_path, 2, dtypes, 1)
    (f,) = tmp_path.rglob("*.safetensors")
    loaded = mx.load(str(f))
    assert sorted(loaded) == sorted(page_file.part_name(i, s, j) for i in range(2)
                                    for s in "kv" for j in range(3))  # fmt: skip
    data = f.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    meta = header.pop("__metadata__")
    assert len(meta["xxh3"]) == 16 and json.loads(meta["tokens"]) == [100, 101, 102, 103]
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    assert order == page_file.layout_order(header)
    assert order[:4] == ["0.k", "0.v", "1.k", "1.v"]


def test_a_file_of_another_writer_is_skipped(tmp_path, caplog):
    """A page file without this tier's checksum (an older writer's: MLX's safetensors writer
    with its own order) is a miss: skipped with one line and removed."""
    dtypes = (mx.float32,)
    tokens, pages = write(tmp_path, 2, dtypes, 2)
    files = sorted(tmp_path.rglob("*.safetensors"))
    first = min(files, key=lambda f: json.loads(
        json.loads(f.read_bytes()[8:][: int.from_bytes(f.read_bytes()[:8], "little")])
        ["__metadata__"]["tokens"])[0])  # fmt: skip
    data = first.read_bytes()
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    del meta["xxh3"]
    arrays = {page_file.part_name(i, s, 0): pages[0][i][k][0] for i in range(2)
              for k, s in enumerate("kv")}  # fmt: skip
    mx.save_safetensors(str(first), arrays, meta)
    run, _, tier = read(tmp_path, 2, dtypes, tokens, 2)
    assert (run is None or run.n_pages == 0) and tier.skipped == 1
    assert not first.exists()
    assert any("no checksum" in r.getMessage() for r in caplog.records)
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1  # the second page's file stays


def test_chains_are_the_conversations_newest_first_within_their_bounds(tmp_path):
    """``DiskTier.chains``: each conversation once, from its first page to a page no other
    continues, newest first; a shared first page counts once; the bounds cut the list."""
    import os
    import time

    dtypes = (mx.float32,)
    tier = DiskTier(tmp_path, 1 << 30, FP, 1, dtypes)
    shared = list(range(BS))
    convs = [shared + [50 + i] * BS + [80 + i] * BS for i in range(3)]
    for n, tokens in enumerate(convs):
        parent = tier.root_digest
        for i in range(3):
            page_tokens = tokens[i * BS : (i + 1) * BS]
            digest = chain(parent, page_tokens)
            tier.save(digest, page_tokens, page(1, dtypes, n * 3 + i), parent)
            parent = digest
    tier.close(60)
    files = sorted(tmp_path.rglob("*.safetensors"), key=lambda f: f.stat().st_mtime)
    for k, f in enumerate(files):  # a time each, in writing order
        os.utime(f, (time.time() + k, time.time() + k))
    tier = DiskTier(tmp_path, 1 << 30, FP, 1, dtypes)
    try:
        assert tier.chains(100) == convs[::-1]
        assert tier.chains(100, max_runs=2) == convs[:0:-1]
        assert tier.chains(4) == [convs[2], convs[1][: 2 * BS]]  # the shared page once
    finally:
        tier.close()


def test_conversations_survive_headers_that_name_a_cycle():
    """Parents named by broken headers (a cycle, a missing page) leave their runs out; the
    walk ends."""
    from veloxquant_mlx.engine.loop.disk_read import conversations

    nodes = {
        "c": ("b", [3]),
        "b": ("a", [2]),
        "a": ("root", [1]),
        "y": ("x", [9]),
        "x": ("z", [8]),
        "z": ("x", [7]),  # x -> z -> x
        "q": ("gone", [5]),
    }
    assert conversations(nodes, "root", 100, 10) == [[1, 2, 3]]


def test_a_header_whose_tokens_are_not_ids_is_skipped_at_start(tmp_path):
    dtypes = (mx.float32,)
    write(tmp_path, 1, dtypes, 2)
    files = sorted(tmp_path.rglob("*.safetensors"))
    data = files[0].read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["tokens"] = json.dumps({"a": 1})
    raw = json.dumps(header).encode()
    files[0].write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    tier = DiskTier(tmp_path, 1 << 30, FP, 1, dtypes)
    try:
        runs = tier.chains(100)
        assert all(type(t) is int for run in runs for t in run)
        assert tier.skipped == 1 and not files[0].exists()
    finally:
        tier.close()
