"""Elastic token and paged allocators: SGLang slot and page ids drawn from a kvcached ledger.

The ledger block of a pool is one SGLang page (`page_size` slots; one slot when the page is a
token), so ledger block ids are SGLang page ids and token slot `t` lives in block
`t // page_size`. Block 0 is the ledger's null block: SGLang's padding page.

Two sizes, because SGLang asks two questions:

- `available_size()` is the logical free capacity, `(num_pages - pages held) * page_size`, what
  the stock free lists report. SGLang's idle leak check asserts `available + evictable +
  protected + session_held == max_total_num_tokens` and raises when it fails, so this number
  must not move with a physical limit.
- `kvcached_allocatable_size()` is what an allocation can take now under the pool's physical
  limit (`KVCACHED_PHYSICAL_LIMIT`, `kvctl limit`, a budget): free slots of mapped pages plus
  the pages the limit still allows, never more than the logical free capacity. SGLang lets the
  allocator own its capacity gates: the prefill admission budget (`create_prefill_budget`),
  eviction before an allocation (`evict_to_free_tokens`) and the decode check
  (`check_decode_capacity`, which retraction converges on) all use this size, so a lowered
  limit makes the scheduler wait, evict or retract instead of taking its out-of-memory path.
  Up to 0.5.20 the scheduler reads the capacity itself; its reads call `capacity.py`, which
  answers with this size.

A pool's physical region is whole pages, so its last page may hold blocks past SGLang's last
page id. The ledger hands those out only when nothing lower is free; they are parked (held,
never given to SGLang) and handed back as soon as SGLang holds no block at all.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, ClassVar

from kvcached_core.errors import KVCachedConfigError, PoolExhausted, StateConsistencyError
from kvcached_core.integration.sglang.capacity import evict_under_limit
from kvcached_core.integration.sglang.pools import kvcached_pool_of, refuse_unless_leaf
from kvcached_core.integration.sglang.prefix_cache import shares_prefixes
from kvcached_core.integration.sglang.ranks import RankAgreement, engine_rank_agreement

if TYPE_CHECKING:
    import torch

    from kvcached_core.pool import KVPool

#: How long an allocation SGLang admitted waits for a shared budget a neighbour spent, and how
#: often it looks again (`_ElasticLedger._wait_for_budget`).
BUDGET_WAIT_S = 10.0
BUDGET_POLL_S = 0.005


class _ElasticLedger:
    """SGLang page ids held by one allocator, on top of its pool's block ledger."""

    def __init__(self, pool: KVPool, num_pages: int,
                 agreement: RankAgreement | None = None) -> None:
        self.pool = pool
        #: The engine's other ranks, which must take the same decisions (`ranks.py`); None
        #: for an engine of one rank.
        self.agreement = agreement
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
        """`count` distinct page ids in 1..num_pages, or None (nothing changed): on an
        engine of several ranks, None on every rank when any rank could not take them."""
        if count <= 0:
            return []
        if count > self.num_pages - self.held:
            return None  # the same on every rank: their ledgers hold the same counts
        ids = self._take_here(count)
        if self.agreement is not None and not self.agreement.all_succeeded(ids is not None):
            if ids is not None:
                self.give_back(ids)
            return None
        return ids

    def _take_here(self, count: int) -> list[int] | None:
        """`take` on this rank alone."""
        pool = self.pool
        try:
            ids = pool.alloc(count)
        except PoolExhausted:
            found = self._wait_for_budget(count)
            if found is None:
                return None
            ids = found
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

    def _wait_for_budget(self, count: int) -> list[int] | None:
        """`count` blocks once a page can be mapped for them again, or None.

        SGLang admitted the work by `allocatable_pages()`, which counted the budget's free
        bytes; a neighbour charging the same budget (or filling the device) can take them
        before this allocation, in the same step. SGLang has no way back from a refused
        allocation (its out-of-memory error stops the engine), and the neighbour gives pages
        back as its requests finish or are preempted, so the allocation waits for them, up to
        BUDGET_WAIT_S. Nothing waits where the pool's limit refused: a limit does not move by
        itself, and SGLang's admission already kept within it."""
        pool = self.pool
        if pool.available_size() < count:
            return None
        deadline = time.monotonic() + BUDGET_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(BUDGET_POLL_S)
            if pool.available_under_budget() < count:
                continue
            try:
                return pool.alloc(count)
            except PoolExhausted:
                continue
        return None

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

    def allocatable_pages(self) -> int:
        """SGLang pages a `take` gets now under the pool's physical limit (O(1)).

        The least of: the logical free pages; what the pool can hand out now (free blocks of
        mapped pages, plus the pages the limit and the budget's free bytes still allow) less
        the ids past SGLang's last page, which SGLang never gets; and the blocks the limit
        allows less those held (the null block, SGLang's, the parked ones). Negative while the
        pool holds more than a lowered limit allows: that many pages must be freed before
        anything is allocatable. Without the budget's share, a neighbour that spent the budget
        would let SGLang admit work whose allocation is then refused: its out-of-memory path.

        The ids past SGLang's last page lie in the region's last ledger page, and the ledger
        maps pages lowest first: they can be among what the pool hands out now only while it
        holds that page or its limit lets it hold every page. Under a limit below that they
        are not counted against what is allocatable (a window model's second pool, under a
        limit of two pages, would otherwise have nothing allocatable at all).
        """
        pool = self.pool
        parked = len(self.parked)
        logical = self.num_pages - self.held
        under_budget = pool.available_under_budget()  # applies a limit kvctl published
        beyond = max(0, pool.capacity_blocks - self.limit - parked)
        if beyond:
            last_page = pool.capacity_blocks // pool.blocks_per_page - 1
            if not pool.holds_page(last_page) and pool.num_blocks < pool.capacity_blocks:
                beyond = 0
        now = min(under_budget, pool.available_size() - beyond)
        headroom = min(pool.num_blocks - parked, self.limit) - 1 - self.held
        pages = min(logical, now, headroom)
        if self.agreement is not None:
            return self.agreement.least(pages)
        return pages


class AllocationsSinceBackup:
    """What `backup_state()` returns: the page ids taken since, that are still held."""

    def __init__(self) -> None:
        self.page_ids: set[int] = set()


class _JournaledLedger(_ElasticLedger):
    """A ledger that can undo what was taken since the last backup (the allocators'
    `backup_state` / `restore_state`, which SGLang has up to 0.5.16)."""

    def __init__(self, pool: KVPool, num_pages: int,
                 agreement: RankAgreement | None = None) -> None:
        super().__init__(pool, num_pages, agreement)
        self.journal: AllocationsSinceBackup | None = None

    def take(self, count: int) -> list[int] | None:
        ids = super().take(count)
        if ids and self.journal is not None:
            self.journal.page_ids.update(ids)
        return ids

    def give_back(self, ids: list[int]) -> None:
        if self.journal is not None:
            self.journal.page_ids.difference_update(ids)
        super().give_back(ids)

    def reset(self) -> None:
        super().reset()
        self.journal = None

    def open_journal(self) -> AllocationsSinceBackup:
        self.journal = AllocationsSinceBackup()
        return self.journal

    def undo(self, state: object) -> None:
        """Give back what was taken since the backup `state` (frees made since stand)."""
        if state is not self.journal or self.journal is None:
            raise StateConsistencyError(
                "kvcached: restore_state() of a state that is not the allocator's last "
                "backup_state() (a clear() or a later backup came between)"
            )
        self.give_back(sorted(self.journal.page_ids))


@functools.cache
def _limited_prefill_budget() -> type:
    """SGLang's PrefillBudget whose free capacity leaves out what the physical limit withholds
    (its `_available_and_evictable` is the hook SGLang's own SWA budget overrides)."""
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    class ElasticPrefillBudget(PrefillBudget):
        def _available_and_evictable(self) -> int:
            return int(super()._available_and_evictable()
                       - self.allocator.kvcached_withheld_size())

    return ElasticPrefillBudget


def _ids_tensor(ids: list[int], device: Any) -> torch.Tensor:
    import torch

    return torch.tensor(ids, dtype=torch.int64, device=device)


class _ElasticAllocatorCommon:
    """What the token and paged elastic allocators share (stock attributes kept)."""

    _kvcached: _ElasticLedger | None = None
    _kvcached_ledger_type: ClassVar[type[_ElasticLedger]] = _ElasticLedger
    #: Page ids an owner took for this allocator's next allocation (the sliding-window
    #: allocator takes both of its sides' pages first, so that one side's refusal leaves the
    #: other untouched); None: the allocation takes its own.
    _kvcached_pretaken: list[int] | None = None

    def _take_pages(self, count: int) -> list[int] | None:
        """`count` page ids for the allocation under way: those an owner took for it, or
        new ones from the ledger (None: refused, nothing changed)."""
        pretaken = self._kvcached_pretaken
        if pretaken is not None:
            self._kvcached_pretaken = None
            if len(pretaken) != count:
                raise StateConsistencyError(
                    f"kvcached: {len(pretaken)} pages were taken for an allocation of {count}")
            return pretaken
        assert self._kvcached is not None
        return self._kvcached.take(count)

    def _attach_ledger(self) -> _ElasticLedger:
        allocator: Any = self
        ledger = self._kvcached
        num_pages = allocator.size // allocator.page_size
        if ledger is None:
            refuse_unless_leaf(self, "token allocator")
            ledger = self._kvcached_ledger_type(kvcached_pool_of(allocator._kvcache), num_pages,
                                                engine_rank_agreement())
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

    def kvcached_allocatable_size(self) -> int:
        """Slots an allocation can take now under the physical limit (negative: over it)."""
        assert self._kvcached is not None
        return self._kvcached.allocatable_pages() * self.page_size  # type: ignore[attr-defined]

    def kvcached_withheld_size(self) -> int:
        """Logically free slots the physical limit does not let an allocation take now."""
        return self.available_size() - self.kvcached_allocatable_size()

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0
                              ) -> Any:
        """SGLang's prefill admission budget, short of the slots the physical limit withholds
        (PrefillAdder takes it from the allocator)."""
        return _limited_prefill_budget()(self, tree_cache,
                                         num_mixed_decode_tokens=num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> bool | None:
        """SGLang's eviction before an allocation, then more until `num_tokens` are
        allocatable under the physical limit (evicting frees pages the limit counts)."""
        result = super().evict_to_free_tokens(tree_cache, num_tokens)  # type: ignore[misc]
        if shares_prefixes(tree_cache):
            evict_under_limit(tree_cache, num_tokens)
        return result

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                              spec_algorithm: Any = None) -> bool:
        """Whether the next decode step's allocation fits, after eviction, under the
        physical limit; when it does not, SGLang retracts requests until it does."""
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.kvcached_allocatable_size() >= num_tokens

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
        ids = self._take_pages(need_size)
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

    #: Whether the stock ``alloc_extend`` takes the batch's new-page count (from 0.5.12);
    #: before, it counts them itself from the CPU lengths, to the same number.
    _kvcached_stock_takes_page_count = True

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
        ids = self._take_pages(count)
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
        stock = super().alloc_extend  # type: ignore[misc]
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                extend_num_tokens)
        if self._kvcached_stock_takes_page_count:
            return stock(*args, num_new_pages=num_new_pages)
        return stock(*args)

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


# ---------------------------------------------------------------- releases up to 0.5.16
# Their allocators mark a free group with the `is_not_in_free_group` flag (the base class's
# free_group_begin / free_group_end set it; `free_group` stays a list), have neither
# free_segment nor free_page_ids (every free is `free`), keep backup_state / restore_state on
# the base class, and the paged allocator stages freed pages in `release_pages`. Each of those
# stock methods reads or writes the free lists directly, so the elastic classes route them
# through the ledger instead.


class _ElasticBackupStateMixin(_ElasticAllocatorCommon):
    """`backup_state` / `restore_state` over the ledger: a restore gives back what was
    allocated since its backup."""

    _kvcached_ledger_type = _JournaledLedger

    def backup_state(self) -> AllocationsSinceBackup:
        ledger = self._kvcached
        assert isinstance(ledger, _JournaledLedger)
        return ledger.open_journal()

    def restore_state(self, state: object) -> None:
        ledger = self._kvcached
        assert isinstance(ledger, _JournaledLedger)
        ledger.undo(state)


class _ElasticFreeGroupFlagMixin(_ElasticBackupStateMixin):
    """A clear() that leaves the allocator outside any free group, as the stock one does.
    Mixed in before the token or paged mixin, whose clear() its super() reaches."""

    def clear(self) -> None:
        super().clear()  # type: ignore[misc]  # the token / paged mixin next in the MRO
        allocator: Any = self
        allocator.is_not_in_free_group = True
        allocator.free_group = []


class ElasticTokenAllocatorFreeGroupFlagMixin(_ElasticFreeGroupFlagMixin,
                                              ElasticTokenAllocatorMixin):
    """TokenToKVPoolAllocator of a release whose free group is the `is_not_in_free_group`
    flag and which has backup_state / restore_state (0.5.16)."""

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        allocator: Any = self
        if allocator.is_not_in_free_group:
            assert self._kvcached is not None
            self._kvcached.give_back(free_index.tolist())
        else:
            allocator.free_group.append(free_index)


class ElasticPagedAllocatorFreeGroupFlagMixin(_ElasticFreeGroupFlagMixin,
                                              ElasticPagedAllocatorMixin):
    """PagedTokenToKVPoolAllocator of a release whose free group is the
    `is_not_in_free_group` flag, whose only free path is `free` (pages staged in
    `release_pages`) and which has backup_state / restore_state (0.5.16)."""

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        import torch

        allocator: Any = self
        if allocator.is_not_in_free_group:
            # Any slot of a page frees the whole page, as in the stock free.
            self._release_page_ids(torch.unique(free_index // allocator.page_size))
        else:
            allocator.free_group.append(free_index)


class ElasticPagedAllocatorCountsItsPagesMixin(ElasticPagedAllocatorFreeGroupFlagMixin):
    """PagedTokenToKVPoolAllocator of a release whose ``alloc_extend`` has no
    ``num_new_pages`` parameter (up to 0.5.11), otherwise the free-group-flag API."""

    _kvcached_stock_takes_page_count = False


class ElasticPagedAllocatorDeviceLengthsMixin(ElasticPagedAllocatorFreeGroupFlagMixin):
    """PagedTokenToKVPoolAllocator of a release whose extend and decode take the batch's
    lengths on the device only (up to 0.5.2: ``alloc_extend(prefix_lens, seq_lens, last_loc,
    extend_num_tokens)``, ``alloc_decode(seq_lens, last_loc)``; their kernels count the new
    pages and read the count back). The count is taken here from the same tensors, with the
    same rule, to stage that many ledger pages first."""

    def alloc_extend(  # type: ignore[override]
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        allocator: Any = self
        page = allocator.page_size
        count = int(((seq_lens + page - 1) // page - (prefix_lens + page - 1) // page).sum())
        if not self._stage_new_pages(count):
            return None
        # The stock method, past the later releases' override in ElasticPagedAllocatorMixin.
        stock = super(ElasticPagedAllocatorMixin, self).alloc_extend  # type: ignore[misc]
        return stock(prefix_lens, seq_lens, last_loc, extend_num_tokens)

    def alloc_decode(  # type: ignore[override]
        self, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        allocator: Any = self
        # A decode token opens a page when it is the first of one (seq_lens counts it).
        if not self._stage_new_pages(int((seq_lens % allocator.page_size == 1).sum())):
            return None
        stock = super(ElasticPagedAllocatorMixin, self).alloc_decode  # type: ignore[misc]
        return stock(seq_lens, last_loc)
