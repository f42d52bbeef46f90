"""The kvcached bound inside RadixCache.cache_finished_req, for releases whose tree evicts by
token count and frees the request's row itself (up to 0.5.8; built from positional arguments
up to 0.5.5, from CacheInitParams from 0.5.6): a finished request handed to the release's own
method leaves at most KVCACHED_MAX_CACHED_TOKENS evictable, and the pages of what it evicted
are unmapped."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from conftest import TOKENS_PER_PAGE, make_mha_pool, make_token_allocator, mapped_pages

LIMIT = 64  # KVCACHED_MAX_CACHED_TOKENS in these runs


def make_tree() -> tuple[object, object, object, object]:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    pool = make_mha_pool(1023)
    allocator = make_token_allocator(1023, pool)
    requests = ReqToTokenPool(size=4, max_context_len=512, device="cpu",
                              enable_memory_saver=False)
    try:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    except ImportError:  # up to 0.5.5
        return pool, allocator, requests, RadixCache(requests, allocator, page_size=1)
    return pool, allocator, requests, RadixCache(CacheInitParams(
        disable=False, req_to_token_pool=requests, token_to_kv_pool_allocator=allocator,
        page_size=1))


def key(tokens: list[int]) -> object:
    """A tree key: RadixKey from 0.5.5, the token list itself before."""
    try:
        from sglang.srt.mem_cache.radix_cache import RadixKey
    except ImportError:
        return tokens
    return RadixKey(tokens)


def lookup(tree_key: object) -> object:
    """What match_prefix takes: MatchPrefixParams from 0.5.8, the key itself before."""
    try:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    except ImportError:
        return tree_key
    return MatchPrefixParams(key=tree_key)


def finish(tree: object, allocator: object, requests: object, tokens: list[int]) -> None:
    """What the scheduler hands the tree when a request that prefilled ``tokens`` and generated
    one token is done: that token has no KV yet, so the request holds a slot per prompt token
    (what ``Req.pop_committed_kv_cache`` answers where the release asks it: 0.5.5.post3)."""
    (index,) = requests.alloc(1)
    slots = allocator.alloc(len(tokens))
    requests.write((index, slice(0, len(tokens))), slots)
    # From 0.5.6 the tree also reads the committed length, the keys and the protected prefix.
    request = SimpleNamespace(origin_input_ids=tokens, output_ids=[9], req_pool_idx=index,
                              prefix_indices=[], last_node=tree.root_node, extra_key=None,
                              last_matched_prefix_len=0, fill_ids=tokens, cache_protected_len=0,
                              pop_committed_kv_cache=lambda: len(tokens))
    tree.cache_finished_req(request)


def test_a_finished_request_leaves_the_tree_within_the_bound() -> None:
    def matched(tokens: list[int]) -> int:
        return len(tree.match_prefix(lookup(key(tokens))).device_indices)

    pool, allocator, requests, tree = make_tree()
    first, second = list(range(1, LIMIT + 1)), list(range(1000, 1000 + LIMIT))
    finish(tree, allocator, requests, first)
    assert tree.evictable_size() == LIMIT  # at the bound: kept, and matched by a follower
    assert matched([*first, 5000]) == LIMIT
    finish(tree, allocator, requests, second)
    # Over the bound: the least recently used request's prefix went, the newest stays.
    assert tree.evictable_size() == LIMIT
    assert (matched(first), matched(second)) == (0, LIMIT)
    assert requests.available_size() == 4
    # Every slot is the tree's or free: the evicted ones went back through the ledger.
    assert allocator.available_size() == 1023 - LIMIT


def test_memory_returns_when_the_tree_evicts() -> None:
    pool, allocator, requests, tree = make_tree()
    pool.kvcached_pool.trim()
    idle = mapped_pages(pool)
    # Six pages of prefixes the tree took over without a bound (inserted directly).
    for start in range(0, 6 * TOKENS_PER_PAGE, 64):
        tree.insert(key(list(range(start + 1, start + 65))), allocator.alloc(64))
    grown = mapped_pages(pool)
    assert grown > idle and tree.evictable_size() == 6 * TOKENS_PER_PAGE
    # The next finished request brings the tree down to the bound.
    finish(tree, allocator, requests, [7000, 7001])
    assert tree.evictable_size() <= LIMIT  # whole least recently used prefixes went
    pool.kvcached_pool.trim()
    assert mapped_pages(pool) < grown


def test_an_idle_cache_spread_over_pages_is_cut_to_the_pages_the_bound_fills() -> None:
    pool, allocator, requests, tree = make_tree()
    pool.kvcached_pool.trim()
    idle = mapped_pages(pool)
    # Sixteen requests decoded together over four pages; four of them, 15 tokens each, are
    # cached: each holds every sixteenth slot, so their 60 tokens lie on all four pages.
    slots = allocator.alloc(4 * TOKENS_PER_PAGE)
    allocator.free(torch.cat([slots[i::16] for i in range(4, 16)]))
    for i in range(4):
        tree.insert(key(list(range(1000 * i + 1, 1000 * i + 16))), slots[i::16][:15])
        allocator.free(slots[i::16][15:])
    # The next finished request (4 tokens: 64 cached, within the bound) finds the engine idle.
    finish(tree, allocator, requests, [7000, 7001, 7002, 7003])
    assert tree.evictable_size() <= 4  # at most the newest request is kept
    pool.kvcached_pool.trim()
    assert mapped_pages(pool) <= idle + 1
