"""Bound SGLang's prefix cache so that idle KV memory goes back to the pool.

A finished request leaves its KV in the radix tree (UnifiedRadixCache, SGLang's default tree,
or RadixCache); unbounded, that keeps every page mapped long after the burst. After each
release the tree's evictable part is cut down to `KVCACHED_MAX_CACHED_TOKENS` (< 0: no bound,
0: nothing is kept) through the tree's own `evict`, which frees through the elastic allocator.

Tokens alone do not bound memory. With SGLang's one-token pages every decode step hands one
slot to each running request, so the output of any request of a burst lies on every kvcached
page the burst used, and a few thousand cached tokens keep all of them mapped. So once no
request is running (the release of the last one: every row of the request pool is free), the
cache is also cut, least recently used first, until its slots lie on no more kvcached pages
than the bound's tokens fill, plus one for a page boundary. While requests run, their pages
are mapped anyway, and the cache is left to serve them. (A tree's protected size does not
tell: up to 0.5.5 a running request that matched no prefix holds no node of it.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcached_core.integration.sglang.switch import sglang_settings


def shares_prefixes(tree_cache: Any) -> bool:
    """Whether the tree keeps finished requests' prefixes (so evicting frees pages).

    SGLang asks the tree with `supports_prefix_sharing()` from 0.5.22; before, the one tree
    that keeps nothing is the chunk cache (`is_chunk_cache()`).
    """
    if tree_cache is None:
        return False
    asks = getattr(tree_cache, "supports_prefix_sharing", None)
    return bool(asks()) if asks is not None else not tree_cache.is_chunk_cache()


def bound_prefix_cache(tree_cache: Any) -> int:
    """Evict the tree's least recently used entries above the bound (in tokens, then in pages
    once idle); returns tokens evicted."""
    limit = sglang_settings().max_cached_tokens
    if limit < 0 or not shares_prefixes(tree_cache):
        return 0
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    def evict(tokens: int) -> None:
        tree_cache.evict(EvictParams(num_tokens=tokens))

    return _bound(tree_cache, limit, evict)


def bound_radix_tree(tree: Any) -> int:
    """`bound_prefix_cache` for a release whose radix tree calls it from its own
    `cache_finished_req` (up to 0.5.5) and evicts by token count (`evict(num_tokens)`,
    returning nothing, before 0.5.9's `EvictParams`); returns tokens evicted."""
    limit = sglang_settings().max_cached_tokens
    if limit < 0:
        return 0
    return _bound(tree, limit, tree.evict)


def evictable_tokens(tree: Any) -> int:
    """The tree's evictable tokens. A sliding-window model's `SWARadixCache` (up to 0.5.15)
    answers per side only (`evictable_size()` raises): its full side counts, since its entries
    are full-pool slots and evicting one frees its window slots too."""
    try:
        return int(tree.evictable_size())
    except NotImplementedError:
        return int(tree.full_evictable_size())


def protected_tokens(tree: Any) -> int:
    """The tree's tokens locked by running requests (the full side of a `SWARadixCache`)."""
    try:
        return int(tree.protected_size())
    except NotImplementedError:
        return int(tree.full_protected_size())


def _bound(tree: Any, limit: int, evict: Callable[[int], object]) -> int:
    before = evictable_tokens(tree)
    if before > limit:
        evict(before - limit)
    _bound_pages(tree, limit, evict)
    return before - evictable_tokens(tree)


def cached_pages(tree: Any, tokens_per_page: int) -> int:
    """How many kvcached pages the tree's slots lie on (slot s is on page s // tokens_per_page)."""
    import torch

    if evictable_tokens(tree) + protected_tokens(tree) == 0:
        return 0
    return int(torch.unique(tree.all_values_flatten() // tokens_per_page).numel())


def engine_idle(tree: Any) -> bool:
    """Whether no request is running: every running request holds a row of the request pool
    (freed before the release that calls the bound), so all rows are free once the last one
    finishes. A tree without a request pool (tests, tools) counts as idle when no request
    holds a node of it."""
    requests = getattr(tree, "req_to_token_pool", None)
    if requests is not None:
        return int(requests.available_size()) >= int(requests.size)
    return protected_tokens(tree) == 0


def _bound_pages(tree: Any, limit: int, evict: Callable[[int], object]) -> None:
    if limit <= 0 or not engine_idle(tree):
        return
    allocator = tree.token_to_kv_pool_allocator
    ledger = getattr(allocator, "_kvcached", None)
    if ledger is None:
        return  # not an elastic allocator: nothing is mapped on demand
    tokens_per_page = ledger.pool.blocks_per_page * int(allocator.page_size)
    allowed = -(-limit // tokens_per_page) + 1
    while evictable_tokens(tree) > 0 and cached_pages(tree, tokens_per_page) > allowed:
        # One token asks for the least recently used leaf alone: a prefix stays while the
        # leaves below it (used less recently) can go first.
        evict(1)
