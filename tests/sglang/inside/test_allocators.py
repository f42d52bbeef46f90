"""The patched token and paged allocators: SGLang's allocator contract, on kvcached memory."""

from __future__ import annotations

import pytest
import torch
from conftest import TOKENS_PER_PAGE, mapped_pages

from kvcached_core.errors import KVCachedConfigError, StateConsistencyError


def test_the_public_names_are_the_elastic_classes() -> None:
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
        swa,
    )

    assert TokenToKVPoolAllocator.__name__ == "ElasticTokenToKVPoolAllocator"
    assert PagedTokenToKVPoolAllocator.__name__ == "ElasticPagedTokenToKVPoolAllocator"
    # Modules that captured the names at import see the elastic classes too.
    assert kv_cache_configurator.TokenToKVPoolAllocator is TokenToKVPoolAllocator
    assert kv_cache_configurator.PagedTokenToKVPoolAllocator is PagedTokenToKVPoolAllocator
    assert swa.TokenToKVPoolAllocator is TokenToKVPoolAllocator


def test_token_alloc_free_and_available(token_setup) -> None:
    _, allocator = token_setup
    assert allocator.available_size() == 1023
    first = allocator.alloc(10)
    assert first.dtype == torch.int64 and first.device.type == "cpu"
    assert len(set(first.tolist())) == 10 and 0 not in first.tolist()
    assert allocator.available_size() == 1013
    second = allocator.alloc(5)
    assert not set(first.tolist()) & set(second.tolist())
    allocator.free(first)
    assert allocator.available_size() == 1018
    allocator.free(torch.empty((0,), dtype=torch.int64))
    assert allocator.alloc(1019) is None  # more than is free: refused, nothing changed
    assert allocator.available_size() == 1018
    everything = allocator.alloc(1018)
    assert everything is not None and allocator.available_size() == 0
    assert max(everything.tolist()) <= 1023  # only SGLang's slots 1..size
    assert allocator.alloc(1) is None


def test_token_free_group_defers_until_the_end(token_setup) -> None:
    _, allocator = token_setup
    slots = allocator.alloc(8)
    allocator.free_group_begin()
    allocator.free(slots[:4])
    allocator.free(slots[4:])
    assert allocator.available_size() == 1023 - 8  # held until the group ends
    allocator.free_group_end()
    assert allocator.available_size() == 1023


def test_token_clear_and_double_free(token_setup) -> None:
    pool, allocator = token_setup
    slots = allocator.alloc(100)
    allocator.clear()
    assert allocator.available_size() == 1023
    slots = allocator.alloc(3)
    allocator.free(slots)
    with pytest.raises(StateConsistencyError):
        allocator.free(slots)  # a double free is a fault, never silent corruption


def test_token_memory_follows_allocation(token_setup) -> None:
    pool, allocator = token_setup
    pool.kvcached_pool.trim()  # drop the warm reserve: count only what blocks hold
    idle = mapped_pages(pool)
    assert idle == 1  # the padding page
    slots = allocator.alloc(4 * TOKENS_PER_PAGE)
    assert mapped_pages(pool) >= idle + 4
    allocator.free(slots)
    pool.kvcached_pool.trim()
    assert mapped_pages(pool) == idle


def test_paged_alloc_extend_and_decode(paged_setup) -> None:
    _, allocator = paged_setup
    ps = 4
    assert allocator.available_size() == 1020
    prefix = allocator.alloc(2 * ps)
    assert prefix.tolist()[:ps] == list(range(prefix[0].item(), prefix[0].item() + ps))
    # Two requests: one extends a 6-token prefix (last slot mid-page) by 5, one starts fresh.
    prefix_lens = torch.tensor([6, 0])
    seq_lens = torch.tensor([11, 3])
    last_loc = torch.tensor([prefix[5].item(), -1])
    out = allocator.alloc_extend(prefix_lens, prefix_lens, seq_lens, seq_lens, last_loc, 8)
    assert out is not None and out.shape == (8,)
    first = out[:5].tolist()
    assert first[:2] == [prefix[6].item(), prefix[7].item()]  # fills the prefix's page
    assert first[2] % ps == 0 and first[3:] == [first[2] + 1, first[2] + 2]
    assert out[5].item() % ps == 0 and out[6:].tolist() == [out[5].item() + 1,
                                                            out[5].item() + 2]
    assert allocator.available_size() == 1020 - 4 * ps
    # Decode: request 0 is at 11 tokens (next slot inside its page), request 1 at 4 (page full).
    seq = torch.tensor([12, 5])
    dec = allocator.alloc_decode(seq, seq, torch.tensor([first[-1], out[-1].item()]))
    assert dec[0].item() == first[-1] + 1 and dec[1].item() % ps == 0
    assert allocator.available_size() == 1020 - 5 * ps


def test_paged_free_segment_page_ids_and_groups(paged_setup) -> None:
    _, allocator = paged_setup
    ps = 4
    run = allocator.alloc(3 * ps)
    allocator.free_segment(run[: 2 * ps], start_pos=0)
    assert allocator.available_size() == 1020 - ps
    allocator.free_group_begin()
    allocator.free_page_ids(run[2 * ps:: ps] // ps)
    assert allocator.available_size() == 1020 - ps
    allocator.free_group_end()
    assert allocator.available_size() == 1020
    again = allocator.alloc(2 * ps)
    allocator.free(again[1:3])  # any slot of a page frees the whole page
    assert allocator.available_size() == 1020 - ps


def test_an_allocator_over_a_stock_pool_is_refused() -> None:
    from unittest.mock import MagicMock

    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    with pytest.raises(KVCachedConfigError, match="needs an elastic KV pool"):
        TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", MagicMock(), False)
