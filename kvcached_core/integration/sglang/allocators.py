"""Elastic token and paged allocators: SGLang slot and page ids drawn from a kvcached ledger.

The ledger block of a pool is one SGLang page (`page_size` slots; one slot when the page is a
token), so ledger block ids are SGLang page ids and token slot `t` lives in block
`t // page_size`. Block 0 is the ledger's null block: SGLang's padding page.

`available_size()` reports the logical free capacity, `(num_pages - pages held) * page_size`.
That keeps SGLang's scheduler invariant `available + evictable + protected + session_held ==
max_total_num_tokens` exactly true (see the registry entry of the allocator transforms): the
pool's capacity is sized from the kvcached budget, so every admitted allocation can be backed.

A pool's physical region is whole pages, so its last page may hold blocks past SGLang's last
page id. The ledger hands those out only when nothing lower is free; they are parked (held,
never given to SGLang) and handed back as soon as SGLang holds no block at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcached_core.errors import KVCachedConfigError, PoolExhausted
from kvcached_core.integration.sglang.pools import kvcached_pool_of, refuse_unless_leaf

if TYPE_CHECKING:
    import torch

    from kvcached_core.pool import KVPool


class _ElasticLedger:
    """SGLang page ids held by one allocator, on top of its pool's block ledger."""

    def __init__(self, pool: KVPool, num_pages: int) -> None:
        self.pool = pool
        if pool.null_block_id != 0:
            raise KVCachedConfigError("kvcached: the SGLang pool must set block 0 aside")
        ledger_blocks = pool.num_blocks
        if num_pages + 1 > ledger_blocks:
            raise KVCachedConfigError(
                f"kvcached: the allocator wants {num_pages} pages but its KV pool holds "
                f"{ledger_blocks - 1}; the pool and the allocator were sized differently"
            )
        self.num_pages = num_pages
        self.limit = num_pages + 1  # ids 1..num_pages are SGLang's; 0 is padding
        self.held = 0
        self.parked: list[int] = []

    def take(self, count: int) -> list[int] | None:
        """`count` distinct page ids in 1..num_pages, or None (nothing changed)."""
        if count <= 0:
            return []
        if count > self.num_pages - self.held:
            return None
        pool = self.pool
        try:
            ids = pool.alloc(count)
        except PoolExhausted:
            return None
        limit = self.limit
        while ids and max(ids) >= limit:
            usable = [i for i in ids if i < limit]
            self.parked += [i for i in ids if i >= limit]
            try:
                more = pool.alloc(count - len(usable))
            except PoolExhausted:
                pool.free(usable)
                return None
            ids = usable + more
        self.held += count
        return ids

    def give_back(self, ids: list[int]) -> None:
        if not ids:
            return
        self.pool.free(ids)
        self.held -= len(ids)
        if self.held == 0 and self.parked:
            parked, self.parked = self.parked, []
            self.pool.free(parked)

    def reset(self) -> None:
        self.pool.clear()
        self.held = 0
        self.parked = []

    def available_tokens(self, page_size: int) -> int:
        return (self.num_pages - self.held) * page_size


def _ids_tensor(ids: list[int], device: Any) -> torch.Tensor:
    import torch

    return torch.tensor(ids, dtype=torch.int64, device=device)


class _ElasticAllocatorCommon:
    """What the token and paged elastic allocators share (stock attributes kept)."""

    _kvcached: _ElasticLedger | None = None

    def _attach_ledger(self) -> _ElasticLedger:
        allocator: Any = self
        ledger = self._kvcached
        num_pages = allocator.size // allocator.page_size
        if ledger is None:
            refuse_unless_leaf(self, "token allocator")
            ledger = _ElasticLedger(kvcached_pool_of(allocator._kvcache), num_pages)
            self._kvcached = ledger
        else:
            if num_pages + 1 > ledger.pool.num_blocks:
                raise KVCachedConfigError(
                    f"kvcached: cannot resize the allocator to {num_pages} pages; its KV "
                    f"pool holds {ledger.pool.num_blocks - 1}"
                )
            ledger.num_pages = num_pages
            ledger.limit = num_pages + 1
        ledger.reset()
        return ledger

    @property
    def kvcached_pool(self) -> KVPool:
        assert self._kvcached is not None
        return self._kvcached.pool

    def available_size(self) -> int:
        assert self._kvcached is not None
        return self._kvcached.available_tokens(self.page_size)  # type: ignore[attr-defined]

    def merge_and_sort_free(self) -> None:
        # Frees go straight back to the ledger: nothing is ever staged.
        return None

    def get_all_free_pages(self) -> None:
        # No page free list (SGLang's invariant census skips allocators without one).
        return None


class ElasticTokenAllocatorMixin(_ElasticAllocatorCommon):
    """TokenToKVPoolAllocator (page_size 1) whose slots come from the kvcached ledger."""

    def clear(self) -> None:
        allocator: Any = self
        self._attach_ledger()
        allocator.free_pages = None
        allocator.release_pages = None
        allocator.free_group = None

    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert self._kvcached is not None
        ids = self._kvcached.take(need_size)
        if ids is None:
            return None
        return _ids_tensor(ids, self.device)  # type: ignore[attr-defined]

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        allocator: Any = self
        if allocator.free_group is None:
            assert self._kvcached is not None
            self._kvcached.give_back(free_index.tolist())
        else:
            allocator.free_group.append(allocator._copy_for_free_group(free_index))


class ElasticPagedAllocatorMixin(_ElasticAllocatorCommon):
    """PagedTokenToKVPoolAllocator whose pages come from the kvcached ledger.

    Extend and decode keep SGLang's own location kernels: the new pages of the batch are
    taken from the ledger first and handed to the stock method as its free-page list.
    """

    def clear(self) -> None:
        import torch

        allocator: Any = self
        self._attach_ledger()
        allocator.free_pages = torch.empty((0,), dtype=torch.int64, device=allocator.device)
        allocator.release_pages = None
        allocator.free_group = None
        allocator.free_page_ids_group = []
        allocator.staged_pages = []
        allocator.num_staged_pages = 0

    def _stage_new_pages(self, count: int) -> bool:
        assert self._kvcached is not None
        ids = self._kvcached.take(count)
        if ids is None:
            return False
        allocator: Any = self
        allocator.free_pages = _ids_tensor(ids, allocator.device)
        return True

    def alloc(self, need_size: int) -> torch.Tensor | None:
        allocator: Any = self
        if not self._stage_new_pages(need_size // allocator.page_size):
            return None
        return super().alloc(need_size)  # type: ignore[misc]

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        from sglang.srt.utils import get_num_new_pages

        allocator: Any = self
        if num_new_pages is None:
            num_new_pages = int(get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=allocator.page_size, prefix_lens=prefix_lens_cpu
            ))
        if not self._stage_new_pages(num_new_pages):
            return None
        return super().alloc_extend(  # type: ignore[misc]
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
            num_new_pages=num_new_pages,
        )

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        from sglang.srt.utils import get_num_new_pages

        allocator: Any = self
        num_new_pages = int(get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=allocator.page_size, decode=True
        ))
        if not self._stage_new_pages(num_new_pages):
            return None
        return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)  # type: ignore[misc]

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        # Every paged free path (free, free_segment, free_page_ids, free_group_end) ends here.
        assert self._kvcached is not None
        ids: list[int] = []
        for chunk in page_ids:
            ids += chunk.tolist()
        self._kvcached.give_back(ids)
