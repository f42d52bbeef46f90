"""The allocator methods SGLang has from 0.5.20 (0.5.17 for free_segment): freeing by segment
and by page id, and the scheduler's decode capacity check under a physical limit."""

from __future__ import annotations

from array import array

from conftest import LIMITED_SLOTS, paged_tree


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


# ---------------------------------------------------------------- a physical limit at run time
# The paged pool: 1020 slots, 4 a page, 16 SGLang pages a 4K kvcached page (2 layers, K and V);
# SGLang page 0 is the padding page. A limit of one kvcached page leaves 15 pages: 60 slots.


def test_under_a_lowered_limit_the_decode_check_evicts_the_tree_then_asks_to_retract(
        paged_setup) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    pool, allocator = paged_setup
    tree = paged_tree(allocator)
    kv = pool.kvcached_pool
    cached = allocator.alloc(40)
    tree.insert(InsertParams(key=RadixKey(array("q", range(1, 41))), value=cached))
    assert tree.evictable_size() == 40
    kv.set_limit(kv.geometry.page_bytes_all_layers)
    assert allocator.kvcached_allocatable_size() == LIMITED_SLOTS - 40
    # The step needs 48 slots: the logical free space (980) would not evict, but under the
    # limit only 20 are allocatable, so the check evicts the cached prefix first.
    assert allocator.check_decode_capacity(num_tokens=48, tree_cache=tree)
    assert tree.evictable_size() == 0
    running = allocator.alloc(48)
    assert running is not None
    # Nothing is left to evict: the check fails and SGLang retracts requests instead of
    # allocating (which would fail).
    assert not allocator.check_decode_capacity(num_tokens=16, tree_cache=tree)
    assert allocator.alloc(16) is None
    allocator.free(running)
    assert allocator.check_decode_capacity(num_tokens=16, tree_cache=tree)
