"""Notebook 02: the page allocator, the request->token table, the KV byte count."""

from __future__ import annotations

import random

import adapters
import pytest
import torch


def test_bytes_per_token():
    assert adapters.kv_bytes_per_token(28, 8, 128, torch.bfloat16) == 114688
    assert adapters.kv_bytes_per_token(3, 2, 16, torch.float32) == 2 * 3 * 2 * 16 * 4


@pytest.mark.parametrize("seed", range(5))
def test_allocator_against_a_set(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 40)
    alloc = adapters.page_allocator(n)
    held: list[int] = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            k = rng.randint(1, len(held))
            rng.shuffle(held)
            alloc.free(held[:k])
            held = held[k:]
        else:
            k = rng.randint(0, 6)
            got = alloc.alloc(k)
            if k > (n - 1) - len(held):
                assert got is None, "alloc must fail (and take nothing) when too few pages are free"
            else:
                assert got is not None and len(got) == k and 0 not in got and not set(got) & set(held)
                held += got
        assert alloc.num_free == (n - 1) - len(held)
        assert alloc.capacity == n - 1


def test_allocator_rejects_bad_frees():
    alloc = adapters.page_allocator(5)
    pages = alloc.alloc(2)
    alloc.free(pages[:1])
    for bad in ([pages[0]], [0], [5], [-1], [pages[1], pages[1]]):
        with pytest.raises(RuntimeError):
            alloc.free(bad)


def test_table_writes_apply_on_flush():
    pool = adapters.req_to_token_pool(4, 16)
    rows = [pool.alloc() for _ in range(3)]
    expect = torch.zeros(4, 16, dtype=torch.int32)
    rng = random.Random(0)
    for _ in range(50):
        r, start = rng.choice(rows), rng.randint(0, 12)
        slots = [rng.randint(1, 999) for _ in range(rng.randint(0, 16 - start))]
        pool.write(r, start, slots)
        expect[r, start:start + len(slots)] = torch.tensor(slots, dtype=torch.int32)
        if rng.random() < 0.3:
            pool.flush()
            assert torch.equal(pool.table.cpu(), expect)
    pool.flush()
    assert torch.equal(pool.table.cpu(), expect)
