"""What SGLang's scheduler reads for capacity, in releases whose scheduler does not ask the
allocator (0.4.10 - 0.5.20).

From 0.5.21 the scheduler asks the allocator for its admission budget, for eviction before an
allocation and for the decode check, and the elastic allocators answer with what an allocation
can take now under the pool's physical limit and its budget (`allocators.py`). Before, the
scheduler reads `available_size()` itself, which stays the logical free capacity because
SGLang's idle leak check asserts it adds up to the pool's size. Without the limit in those
reads, SGLang admits a request the limit cannot hold, and the refused allocation takes SGLang's
out-of-memory path, which stops the engine.

The seam `sglang-scheduler-capacity` (`codemods/sglang/scheduler_capacity.py`) therefore
rewrites exactly the reads that decide admission, retraction and the decode check to
`allocatable_size` (and, for a hybrid sliding-window model's two sides from 0.5.13,
`side_allocatable_size`: `codemods/sglang/scheduler_capacity_sides.py`), and calls
`evict_under_limit` at the start of the release's eviction before an allocation. The leak check
and the metrics keep reading the logical size.
"""

from __future__ import annotations

from typing import Any


def allocatable_size(allocator: Any) -> int:
    """Slots an allocation can take now: under the physical limit and the budget for an
    elastic allocator (negative while it holds more than a lowered limit allows), the stock
    free capacity otherwise."""
    ask = getattr(allocator, "kvcached_allocatable_size", None)
    if ask is None:
        return int(allocator.available_size())
    return int(ask())


def side_allocatable_size(allocator: Any, side: str) -> int:
    """What one side ("full" or "swa") of a hybrid sliding-window allocator can allocate now:
    under that side's pool limit and the budget when the side is elastic, the stock figure
    (`full_available_size()` / `swa_available_size()`) otherwise."""
    ask = getattr(getattr(allocator, f"{side}_attn_allocator", None),
                  "kvcached_allocatable_size", None)
    if ask is None:
        return int(getattr(allocator, f"{side}_available_size")())
    return int(ask())


def evict_under_limit(tree_cache: Any, num_tokens: int) -> None:
    """Evict the prefix cache's least recently used entries until `num_tokens` slots are
    allocatable under the physical limit, or nothing evictable is left.

    SGLang's own eviction that follows compares `num_tokens` with the logical free capacity:
    under a lowered limit it would evict nothing, or (before 0.5.19) only `num_tokens`
    where the pool holds more than the limit allows.
    """
    if tree_cache is None:
        return
    allocator = getattr(tree_cache, "token_to_kv_pool_allocator", None)
    ask = getattr(allocator, "kvcached_allocatable_size", None)
    if allocator is None or ask is None:
        return  # not an elastic allocator: the stock eviction is exact
    if getattr(allocator, "swa_attn_allocator", None) is not None:
        # The elastic sliding-window composite (swa.py): each side's shortfall under its
        # own limit, the window side's as window tokens.
        allocator.evict_to_free_tokens(tree_cache, num_tokens)
        return
    shortfall = int(num_tokens) - int(ask())
    if shortfall <= 0 or int(tree_cache.evictable_size()) <= 0:
        return  # enough, or a tree that keeps nothing (the chunk cache)
    try:  # how the tree is asked: EvictParams from 0.5.9, a token count before
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    except ImportError:
        tree_cache.evict(shortfall)
        return
    evict_for_allocation(tree_cache, EvictParams(num_tokens=shortfall))


def evict_for_allocation(tree_cache: Any, params: Any) -> None:
    """Evict the tree's least recently used entries for an allocation: `evict_for_alloc` from
    0.5.19, the trees' `evict` (the same `EvictParams`, from 0.5.9) before."""
    getattr(tree_cache, "evict_for_alloc", tree_cache.evict)(params)
