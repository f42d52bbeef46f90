"""Bound SGLang's prefix cache so that idle KV memory goes back to the pool.

A finished request leaves its KV in the radix tree (UnifiedRadixCache, SGLang's default tree,
or RadixCache); unbounded, that keeps every page mapped long after the burst. After each
release the tree's evictable part is cut down to `KVCACHED_MAX_CACHED_TOKENS` (< 0: no bound,
0: nothing is kept) through the tree's own `evict`, which frees through the elastic allocator.
"""

from __future__ import annotations

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
    """Evict the tree's least recently used entries above the bound; returns tokens evicted."""
    limit = sglang_settings().max_cached_tokens
    if limit < 0 or not shares_prefixes(tree_cache):
        return 0
    excess = int(tree_cache.evictable_size()) - limit
    if excess <= 0:
        return 0
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    result = tree_cache.evict(EvictParams(num_tokens=excess))
    return int(result.num_tokens_evicted)


def bound_radix_tree(tree: Any) -> int:
    """`bound_prefix_cache` for a release whose radix tree calls it from its own
    `cache_finished_req` (up to 0.5.5) and evicts by token count (`evict(num_tokens)`,
    returning nothing, before 0.5.9's `EvictParams`); returns tokens evicted."""
    limit = sglang_settings().max_cached_tokens
    if limit < 0:
        return 0
    before = int(tree.evictable_size())
    if before <= limit:
        return 0
    tree.evict(before - limit)
    return before - int(tree.evictable_size())
