"""The elastic allocators of SGLang 0.5.16's allocator API, over a real (host) KV pool.

The stand-in classes below copy the methods of 0.5.16's `BaseTokenToKVPoolAllocator`,
`TokenToKVPoolAllocator` and `PagedTokenToKVPoolAllocator` that touch the free lists (the
free-group flag, `backup_state` / `restore_state`, `free`, the page-aligned `alloc`); the
elastic classes are built from them exactly as the build writes them. Every free must reach
the ledger (the pool's mapped pages follow it), never the stock free lists.
"""

from __future__ import annotations

import pytest
import torch

from kvcached_core.errors import StateConsistencyError
from kvcached_core.integration.sglang.allocators import (
    ElasticPagedAllocatorFreeGroupFlagMixin,
    ElasticTokenAllocatorFreeGroupFlagMixin,
)
from kvcached_core.pool import KVPool
from tests.unit.pool_factory import create_pool

PAGE = 4096
TOKEN_BYTES = 64  # one slot's bytes per layer per buffer: 64 slots a kvcached page
PAGE_SIZE = 4  # SGLang page of the paged allocator


class Base0516:
    """0.5.16's BaseTokenToKVPoolAllocator: its free-list methods, as released."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str,
                 kvcache: object, need_sort: bool) -> None:
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, device
        self._kvcache, self.need_sort = kvcache, need_sort
        self.free_pages: torch.Tensor | None = None
        self.release_pages: torch.Tensor | None = None
        self.is_not_in_free_group = True
        self.free_group: list[torch.Tensor] = []

    def available_size(self) -> int:
        assert self.free_pages is not None and self.release_pages is not None
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def restore_state(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.free_pages, self.release_pages = state

    def backup_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.free_pages, self.release_pages)

    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))

    def merge_and_sort_free(self) -> None:
        raise AssertionError("the elastic allocator has nothing to merge")

    def free(self, free_index: torch.Tensor) -> None:
        raise NotImplementedError


class Token0516(Base0516):
    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache: object,
                 need_sort: bool) -> None:
        super().__init__(size, 1, dtype, device, kvcache, need_sort)
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64)
        self.is_not_in_free_group = True
        self.free_group = []
        self.release_pages = torch.empty((0,), dtype=torch.int64)

    def free(self, free_index: torch.Tensor) -> None:
        raise AssertionError("the stock free writes the stock free lists")


class Paged0516(Base0516):
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str,
                 kvcache: object, need_sort: bool) -> None:
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        self.num_pages = size // page_size
        self.clear()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert self.free_pages is not None
        num_pages = need_size // self.page_size
        if num_pages > len(self.free_pages):
            return None
        out_pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return (out_pages[:, None] * self.page_size
                + torch.arange(self.page_size)).reshape(-1)

    def free(self, free_index: torch.Tensor) -> None:
        raise AssertionError("the stock free writes the stock free lists")

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self.is_not_in_free_group = True
        self.free_group = []
        self.release_pages = torch.empty((0,), dtype=torch.int64)


class ElasticToken(ElasticTokenAllocatorFreeGroupFlagMixin, Token0516):
    _kvcached_elastic_leaf = True


class ElasticPaged(ElasticPagedAllocatorFreeGroupFlagMixin, Paged0516):
    _kvcached_elastic_leaf = True


class ElasticKVCache:
    """What the allocator needs of an elastic SGLang pool: its `KVPool`."""

    def __init__(self, pool: KVPool) -> None:
        self.kvcached_pool = pool


def kv_cache(slots: int) -> ElasticKVCache:
    """A pool of `slots` token rows plus the padding row, one SGLang block a ledger block."""
    rows = slots + 64
    return ElasticKVCache(create_pool(
        "sglang-0516-test", num_layers=2, num_kv_buffers=2, block_bytes=TOKEN_BYTES,
        virtual_bytes_per_layer=2 * -(-rows * TOKEN_BYTES // PAGE) * PAGE, page_size=PAGE,
        min_reserve_pages=0, max_reserve_pages=0, prealloc=False, share_limits=False,
        export_metrics=False, set_aside_null_block=True))


def paged_kv_cache(slots: int) -> ElasticKVCache:
    rows = slots + 64
    return ElasticKVCache(create_pool(
        "sglang-0516-paged-test", num_layers=2, num_kv_buffers=2,
        block_bytes=TOKEN_BYTES * PAGE_SIZE,
        virtual_bytes_per_layer=2 * -(-rows * TOKEN_BYTES // PAGE) * PAGE, page_size=PAGE,
        min_reserve_pages=0, max_reserve_pages=0, prealloc=False, share_limits=False,
        export_metrics=False, set_aside_null_block=True))


def test_token_free_group_flag_holds_frees_until_the_group_ends() -> None:
    allocator = ElasticToken(1023, torch.bfloat16, "cpu", kv_cache(1023), False)
    slots = allocator.alloc(8)
    allocator.free_group_begin()
    allocator.free(slots[:4])
    allocator.free(slots[4:])
    assert allocator.available_size() == 1023 - 8
    allocator.free_group_end()
    assert allocator.available_size() == 1023
    assert allocator.free_pages is None  # the stock free list was never used
    with pytest.raises(StateConsistencyError):
        allocator.free(slots)  # the ledger saw the group's frees: a second one is a fault


@pytest.mark.parametrize("need_sort", [False, True])
def test_paged_free_gives_whole_pages_back_and_memory_follows(need_sort: bool) -> None:
    cache = paged_kv_cache(1020)
    pool = cache.kvcached_pool
    allocator = ElasticPaged(1020, PAGE_SIZE, torch.bfloat16, "cpu", cache, need_sort)
    pool.trim()
    idle = pool.mapped_pages
    run = allocator.alloc(64 * PAGE_SIZE)  # 64 SGLang pages: 4 kvcached pages
    assert run is not None and pool.mapped_pages >= idle + 4
    allocator.free_group_begin()
    allocator.free(run[1:2])  # any slot of a page frees the whole page
    assert allocator.available_size() == 1020 - 64 * PAGE_SIZE
    allocator.free_group_end()
    assert allocator.available_size() == 1020 - 63 * PAGE_SIZE
    allocator.free(run[PAGE_SIZE:])
    assert allocator.available_size() == 1020
    pool.trim()
    assert pool.mapped_pages == idle
    # Nothing staged behind the ledger's back, whatever need_sort says.
    assert allocator.release_pages is None
    assert allocator.free_pages is not None and allocator.free_pages.numel() == 0


def test_restore_state_gives_back_what_was_allocated_since_the_backup() -> None:
    allocator = ElasticToken(1023, torch.bfloat16, "cpu", kv_cache(1023), False)
    kept = allocator.alloc(5)
    state = allocator.backup_state()
    taken = allocator.alloc(7)
    allocator.free(taken[:2])  # freed since the backup: not given back a second time
    assert allocator.available_size() == 1023 - 10
    allocator.restore_state(state)
    assert allocator.available_size() == 1023 - 5
    allocator.free(kept)  # held before the backup, so still held after the restore
    assert allocator.available_size() == 1023


def test_paged_restore_state_gives_back_whole_pages() -> None:
    allocator = ElasticPaged(1020, PAGE_SIZE, torch.bfloat16, "cpu", paged_kv_cache(1020),
                             False)
    state = allocator.backup_state()
    assert allocator.alloc(3 * PAGE_SIZE) is not None
    allocator.restore_state(state)
    assert allocator.available_size() == 1020
    assert allocator.alloc(1020) is not None  # every page is back in the ledger


def test_a_backup_from_before_a_clear_or_a_later_backup_is_refused() -> None:
    allocator = ElasticToken(1023, torch.bfloat16, "cpu", kv_cache(1023), False)
    stale = allocator.backup_state()
    allocator.clear()
    with pytest.raises(StateConsistencyError, match="last backup_state"):
        allocator.restore_state(stale)
    older = allocator.backup_state()
    allocator.backup_state()
    with pytest.raises(StateConsistencyError, match="last backup_state"):
        allocator.restore_state(older)
