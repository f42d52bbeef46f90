"""RadixCache over the patched allocator: insert, match, evict, and the kvcached bound."""

from __future__ import annotations

from array import array

import torch
from conftest import TOKENS_PER_PAGE, make_mha_pool, make_token_allocator, mapped_pages

from kvcached_core.integration.sglang.prefix_cache import bound_prefix_cache


def make_tree() -> tuple[object, object, object]:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    pool = make_mha_pool(1023)
    allocator = make_token_allocator(1023, pool)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                      token_to_kv_pool_allocator=allocator, page_size=1))
    return pool, allocator, tree


def insert(tree: object, allocator: object, tokens: list[int]) -> torch.Tensor:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots = allocator.alloc(len(tokens))
    tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    return slots


def match(tree: object, tokens: list[int]) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    result = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    # The matched length is a field from 0.5.22; before, the matched slots are all there is.
    if hasattr(result, "device_prefix_len"):
        return int(result.device_prefix_len)
    return len(result.device_indices)


def test_insert_match_and_evict_free_through_the_ledger() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    pool, allocator, tree = make_tree()
    insert(tree, allocator, list(range(1, 9)))
    insert(tree, allocator, [1, 2, 3, 4, 50, 51])  # the shared part is a duplicate
    assert match(tree, [1, 2, 3, 4, 50, 51, 52]) == 6
    assert match(tree, [1, 2, 3, 9]) == 3
    assert tree.evictable_size() == 10
    evicted = tree.evict(EvictParams(num_tokens=10)).num_tokens_evicted
    assert evicted == 10 and tree.evictable_size() == 0
    assert match(tree, [1, 2, 3]) == 0
    # The tree freed its 10 slots; the duplicate 4 were the caller's to free.
    assert allocator.available_size() == 1023 - 4


def test_the_bound_evicts_down_to_the_limit_and_memory_returns() -> None:
    pool, allocator, tree = make_tree()
    pool.kvcached_pool.trim()
    idle = mapped_pages(pool)
    for start in range(0, 6 * TOKENS_PER_PAGE, 64):
        insert(tree, allocator, list(range(start + 1, start + 65)))
    grown = mapped_pages(pool)
    assert grown > idle and tree.evictable_size() == 6 * TOKENS_PER_PAGE
    evicted = bound_prefix_cache(tree)  # KVCACHED_MAX_CACHED_TOKENS=64 in these runs
    assert evicted == 6 * TOKENS_PER_PAGE - 64 and tree.evictable_size() == 64
    pool.kvcached_pool.trim()
    assert mapped_pages(pool) < grown


def insert_slots(tree: object, tokens: list[int], slots: torch.Tensor) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))


def test_an_idle_cache_spread_over_pages_is_cut_to_the_pages_the_bound_fills() -> None:
    pool, allocator, tree = make_tree()
    pool.kvcached_pool.trim()
    idle = mapped_pages(pool)
    # Sixteen requests decoded together over four pages; four of them, 16 tokens each, are
    # cached: each holds every sixteenth slot, so 64 tokens (within the bound) lie on all four.
    slots = allocator.alloc(4 * TOKENS_PER_PAGE)
    cached = [slots[i::16] for i in range(4)]
    allocator.free(torch.cat([slots[i::16] for i in range(4, 16)]))
    for i, held in enumerate(cached):
        insert_slots(tree, list(range(1000 * i + 1, 1000 * i + 17)), held)
    assert mapped_pages(pool) > idle and tree.evictable_size() == 64
    bound_prefix_cache(tree)  # idle: no request holds the tree
    assert tree.evictable_size() == 0
    pool.kvcached_pool.trim()
    assert mapped_pages(pool) == idle


def test_an_idle_cache_on_few_pages_keeps_what_the_bound_allows() -> None:
    pool, allocator, tree = make_tree()
    for i in range(4):  # four requests prefilled one after another: each on its own slots
        insert_slots(tree, list(range(1000 * i + 1, 1000 * i + 17)), allocator.alloc(16))
    bound_prefix_cache(tree)
    assert tree.evictable_size() == 64  # 64 tokens on at most two pages: kept
