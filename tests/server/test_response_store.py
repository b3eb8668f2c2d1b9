"""The Responses API's store (``server.response_store``): chains of turns, LRU eviction and
the message when a chain's older part was dropped."""

from __future__ import annotations

import pytest

from veloxquant_mlx.server.response_store import ResponseStore


def turn(n: int) -> list[dict]:
    return [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": f"a{n}"}]


def test_a_chain_gives_its_turns_oldest_first_and_stays_the_newest():
    store = ResponseStore(3)
    store.put({"id": "r1"}, turn(1), None)
    store.put({"id": "r2"}, turn(2), "r1")
    store.put({"id": "other"}, turn(9), None)
    assert [m["content"] for m in store.conversation("r2")] == ["q1", "a1", "q2", "a2"]
    store.put({"id": "r3"}, turn(3), "r2")  # over capacity: "other" goes, not the chain
    assert store.get("other") is None and len(store) == 3
    assert [m["content"] for m in store.conversation("r3")][-2:] == ["q3", "a3"]
    messages = store.conversation("r3")
    messages[0]["content"] = "changed"  # callers get copies
    assert store.conversation("r3")[0]["content"] == "q1"


def test_a_chain_whose_older_part_was_dropped_says_so():
    store = ResponseStore(2)
    store.put({"id": "r1"}, turn(1), None)
    store.put({"id": "r2"}, turn(2), "r1")
    store.put({"id": "r3"}, turn(3), "r2")  # r1 is dropped
    with pytest.raises(KeyError, match="continues 'r1', which is no longer stored"):
        store.conversation("r3")
    with pytest.raises(KeyError, match="'nope' is not stored"):
        store.conversation("nope")
    assert store.delete("r3") and not store.delete("r3")


def test_capacity_zero_stores_nothing():
    store = ResponseStore(0)
    store.put({"id": "r1"}, turn(1), None)
    assert len(store) == 0 and store.get("r1") is None


def test_the_store_holds_at_most_its_bytes_of_text():
    store = ResponseStore(100, max_bytes=1000)
    big = [{"role": "user", "content": "x" * 400}]
    for i in range(4):
        store.put({"id": f"r{i}"}, big, None)
    assert len(store) == 2 and store.bytes <= 1000  # the oldest two went
    assert store.get("r0") is None and store.get("r3") is not None
    store.put({"id": "huge"}, [{"role": "user", "content": "x" * 2000}], None)
    assert store.get("huge") is None and len(store) == 2  # larger than the store: not kept
    assert store.delete("r3") and store.bytes == store._items["r2"].size
