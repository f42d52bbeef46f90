"""The hybrid sliding-window allocator: two elastic sides, gated and allocated together.

A window model's pools are an SWAKVPool of two MHA pools (full-attention layers, window
layers) and one composite allocator over a sub-allocator per pool. From sglang 0.5.13 the
composite is elastic (`kvcached_core/integration/sglang/swa.py`): the cells from there list
this file in their L1 tests. Before, the configuration guard refuses window models. From
0.5.21 the scheduler asks the composite for its admission budget; 0.5.13 - 0.5.20 read its
full and window sizes in `PrefillAdder` themselves, rewritten to each side's limit.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import DIM, HEADS, POOL_BUILDERS, SWA_ALLOCATOR_MODULES, releases_module

from kvcached_core.errors import KVCachedConfigError

SWA = releases_module(SWA_ALLOCATOR_MODULES)
#: Full-attention slots, window slots (SGLang's default window share is about 0.8).
FULL, WINDOW = 1023, 511
#: A 4K kvcached page holds 64 tokens of one layer's K or V (2 heads of 16, bf16).
TOKENS_PER_PAGE = 4096 // (HEADS * DIM * 2)

def test_the_public_names_are_the_elastic_window_classes() -> None:
    """What the module that builds the pools (the configurator from 0.5.16, the model runner's
    KV mixin before) reaches by name is the elastic composite; the all-window allocator
    (from 0.5.15) is its refusing subclass."""
    assert SWA.SWATokenToKVPoolAllocator.__name__ == "ElasticSWATokenToKVPoolAllocator"
    builder = releases_module(POOL_BUILDERS)
    assert builder.SWATokenToKVPoolAllocator is SWA.SWATokenToKVPoolAllocator
    if hasattr(SWA, "PureSWATokenToKVPoolAllocator"):
        assert SWA.PureSWATokenToKVPoolAllocator.__name__ == (
            "ElasticPureSWATokenToKVPoolAllocator")
        assert builder.PureSWATokenToKVPoolAllocator is SWA.PureSWATokenToKVPoolAllocator


def make_window_pool() -> object:
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    kwargs = {}
    if "enable_kvcache_transpose" in inspect.signature(SWAKVPool.__init__).parameters:
        kwargs["enable_kvcache_transpose"] = False  # a required flag up to 0.5.14
    return SWAKVPool(size=FULL, size_swa=WINDOW, page_size=1, dtype=torch.bfloat16,
                     head_num=HEADS, head_dim=DIM, swa_attention_layer_ids=[0],
                     full_attention_layer_ids=[1], device="cpu", enable_memory_saver=False,
                     **kwargs)


def make_window_allocator(pool: object) -> object:
    cls = SWA.SWATokenToKVPoolAllocator
    kwargs = {"need_sort": False}
    if "req_to_token_pool" in inspect.signature(cls.__init__).parameters:
        kwargs["req_to_token_pool"] = None
    return cls(FULL, WINDOW, 1, torch.bfloat16, "cpu", pool, **kwargs)


@pytest.fixture
def window_setup() -> tuple[object, object]:
    pool = make_window_pool()
    return pool, make_window_allocator(pool)


def sides(allocator: object) -> tuple[object, object]:
    return allocator.full_attn_allocator, allocator.swa_attn_allocator


def mapped(side: object) -> int:
    return side.kvcached_pool.mapped_pages


def test_each_side_is_its_own_elastic_pool(window_setup) -> None:
    pool, allocator = window_setup
    full, window = sides(allocator)
    assert type(full).__name__ == type(window).__name__ == "ElasticTokenToKVPoolAllocator"
    assert full.kvcached_pool is not window.kvcached_pool
    # Each pool's record says which side it is (for kvctl, kvtop and a limit per pool), also
    # where the release does not label them (before 0.5.17).
    assert full.kvcached_pool.name.startswith("sglang-mha-full-"), full.kvcached_pool.name
    assert window.kvcached_pool.name.startswith("sglang-mha-swa-"), window.kvcached_pool.name
    assert type(pool.full_kv_pool).__name__ == type(pool.swa_kv_pool).__name__
    assert (allocator.available_size(), allocator.full_available_size(),
            allocator.swa_available_size()) == (WINDOW, FULL, WINDOW)


def test_both_sides_map_on_demand_and_the_mapping_joins_them(window_setup) -> None:
    _, allocator = window_setup
    full, window = sides(allocator)
    for side in (full, window):
        side.kvcached_pool.trim()
    before = (mapped(full), mapped(window))
    slots = allocator.alloc(3 * TOKENS_PER_PAGE)
    assert slots is not None and len(set(slots.tolist())) == 3 * TOKENS_PER_PAGE
    window_slots = allocator.full_to_swa_index_mapping[slots]
    assert bool((window_slots > 0).all()) and len(set(window_slots.tolist())) == len(slots)
    assert mapped(full) >= before[0] + 3 and mapped(window) >= before[1] + 3
    allocator.free(slots)
    assert bool((allocator.full_to_swa_index_mapping[slots] == 0).all())
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (FULL, WINDOW)
    for side in (full, window):
        side.kvcached_pool.trim()
    assert (mapped(full), mapped(window)) == before


def test_a_window_freed_early_gives_its_pages_back_while_the_full_side_keeps_its_own(
        window_setup) -> None:
    _, allocator = window_setup
    full, window = sides(allocator)
    slots = allocator.alloc(4 * TOKENS_PER_PAGE)
    for side in (full, window):
        side.kvcached_pool.trim()
    held_full, held_window = mapped(full), mapped(window)
    # The scheduler frees the window side of the slots that left the window.
    # Slot 0 is the null block's: the first three pages' worth of slots leave pages 1 and 2
    # empty (page 0 keeps the null block, page 3 the slots still in the window).
    allocator.free_swa(slots[:3 * TOKENS_PER_PAGE])
    window.kvcached_pool.trim()
    assert mapped(window) <= held_window - 2 and mapped(full) == held_full
    assert allocator.swa_available_size() == WINDOW - TOKENS_PER_PAGE
    allocator.free_swa(slots[3 * TOKENS_PER_PAGE:])
    # The full side alone: free_full from 0.5.19, the sub-allocator's own free before.
    getattr(allocator, "free_full", full.free)(slots)
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (FULL, WINDOW)


def test_a_limit_on_one_side_refuses_both_and_leaves_the_other_untouched(window_setup) -> None:
    _, allocator = window_setup
    full, window = sides(allocator)
    kv = window.kvcached_pool
    kv.set_limit(kv.geometry.page_bytes_all_layers)  # one page: 63 slots past the null one
    allowed = TOKENS_PER_PAGE - 1
    assert allocator.kvcached_allocatable_size() == allowed
    assert allocator.available_size() == WINDOW  # the logical sizes stay SGLang's
    full_mapped, full_free = mapped(full), full.available_size()
    assert allocator.alloc(allowed + 1) is None
    assert (mapped(full), full.available_size()) == (full_mapped, full_free)
    assert not allocator.check_decode_capacity(num_tokens=allowed + 1, tree_cache=None)
    assert allocator.check_decode_capacity(num_tokens=allowed, tree_cache=None)
    slots = allocator.alloc(allowed)
    assert slots is not None
    assert allocator.kvcached_allocatable_size() == 0
    kv.set_limit(1 << 30)
    assert allocator.kvcached_allocatable_size() >= WINDOW - allowed - TOKENS_PER_PAGE
    allocator.free(slots)
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (FULL, WINDOW)


def test_the_admission_budget_counts_what_each_side_withholds(window_setup) -> None:
    _, allocator = window_setup
    _, window = sides(allocator)
    kv = window.kvcached_pool
    if not hasattr(SWA.BaseTokenToKVPoolAllocator, "create_prefill_budget"):
        admission_reads_of_the_release_see_each_side(allocator)
        return

    class NoTree:
        def full_evictable_size(self) -> int:
            return 0

        def swa_evictable_size(self) -> int:
            return 0

        def supports_prefix_sharing(self) -> bool:
            return False

        sliding_window_size = 32

    budget = allocator.create_prefill_budget(NoTree())
    assert type(budget).__name__ == "ElasticSWAPrefillBudget"
    assert budget.remaining_swa == WINDOW
    kv.set_limit(kv.geometry.page_bytes_all_layers)
    assert allocator.create_prefill_budget(NoTree()).remaining_swa == TOKENS_PER_PAGE - 1


def test_the_all_window_allocator_is_refused(window_setup) -> None:
    """From 0.5.15 an all-window model gets its own allocator, refused when elastic. Before,
    no release builds one (such a model gets the elastic composite): nothing stock is left
    reachable from the module that builds the pools."""
    if not hasattr(SWA, "PureSWATokenToKVPoolAllocator"):
        assert not hasattr(releases_module(POOL_BUILDERS), "PureSWATokenToKVPoolAllocator")
        return
    pool, _ = window_setup
    cls = SWA.PureSWATokenToKVPoolAllocator
    with pytest.raises(KVCachedConfigError, match="every layer uses a sliding window"):
        cls(WINDOW, 1, torch.bfloat16, "cpu", pool, False)


def admission_reads_of_the_release_see_each_side(allocator: object) -> None:
    """0.5.13 - 0.5.20: the release's own PrefillAdder reads the composite's sides (the build
    rewrote those reads, sglang-scheduler-capacity); each sees its side's limit."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    class NoTree:
        def full_evictable_size(self) -> int:
            return 0

        def swa_evictable_size(self) -> int:
            return 0

    adder = object.__new__(PrefillAdder)  # only the fields the capacity reads use
    fields = {"token_to_kv_pool_allocator": allocator, "tree_cache": NoTree(),
              "is_all_swa": False, "is_hybrid_swa": True, "is_hybrid_ssm_cache": False,
              "rem_total_token_offset": 0, "cur_rem_token_offset": 0,
              "rem_swa_token_offset": 0, "_swa_req_ring": False}
    for name, value in fields.items():
        setattr(adder, name, value)
    assert (adder.rem_total_tokens, adder.cur_rem_tokens, adder.rem_swa_tokens) == (
        FULL, FULL, WINDOW)
    full, window = sides(allocator)
    kv = window.kvcached_pool
    kv.set_limit(kv.geometry.page_bytes_all_layers)
    assert adder.rem_swa_tokens == TOKENS_PER_PAGE - 1
    assert (adder.rem_total_tokens, adder.cur_rem_tokens) == (FULL, FULL)
    full.kvcached_pool.set_limit(full.kvcached_pool.geometry.page_bytes_all_layers)
    assert adder.rem_total_tokens == adder.cur_rem_tokens == TOKENS_PER_PAGE - 1
    assert allocator.swa_available_size() == WINDOW  # the logical sizes stay SGLang's
