"""The patched token and paged allocators: SGLang's allocator contract, on kvcached memory."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    POOL_BUILDERS,
    SWA_ALLOCATOR_MODULES,
    TOKENS_PER_PAGE,
    make_token_allocator,
    mapped_pages,
    releases_module,
)

from kvcached_core.errors import KVCachedConfigError, StateConsistencyError


def test_the_public_names_are_the_elastic_classes() -> None:
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )

    assert TokenToKVPoolAllocator.__name__ == "ElasticTokenToKVPoolAllocator"
    assert PagedTokenToKVPoolAllocator.__name__ == "ElasticPagedTokenToKVPoolAllocator"
    # Modules that captured the names at import see the elastic classes too: the one that
    # builds the allocators, and the SWA allocator's.
    builder = releases_module(POOL_BUILDERS)
    assert builder.TokenToKVPoolAllocator is TokenToKVPoolAllocator
    assert builder.PagedTokenToKVPoolAllocator is PagedTokenToKVPoolAllocator
    swa = releases_module(SWA_ALLOCATOR_MODULES)
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


def test_an_allocator_over_a_stock_pool_is_refused() -> None:
    from unittest.mock import MagicMock

    with pytest.raises(KVCachedConfigError, match="needs an elastic KV pool"):
        make_token_allocator(64, MagicMock())
