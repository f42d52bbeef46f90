"""The block ledger: engine block ids on top of the native page allocator's logical pages.

Block `b` lives in ledger page `b // blocks_per_page`. A ledger page is one page of the page
allocator. When blocks tile pages (`page_size % block_bytes == 0`) that is simply the page;
when one block spans `k` pages (`block_bytes % page_size == 0`) the page allocator must count
in units of `k` pages (its FTensorAllocator built with `layout.PageGeometry.ledger_page_bytes`,
as `KVPool` does), so that the `k` pages of a block are always mapped and released together.

The ledger is called from one scheduler thread. Its hot path (alloc / free / available_size)
touches only Python containers and counters; the native allocator is called only when whole
pages change hands.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn, Protocol

from kvcached_core.errors import MapQuarantinedError, PoolExhausted, StateConsistencyError
from kvcached_core.layout import check_page_geometry


class PageAllocatorLike(Protocol):
    """What the ledger uses of `kvcached_core._C.PageAllocator`."""

    num_free: int
    num_reserved: int
    num_in_use: int
    num_quarantined: int
    capacity: int
    num_total: int
    reserve_hits: int
    reserve_misses: int
    map_calls: int
    map_ns_total: int
    unmap_calls: int
    unmap_ns_total: int
    state: str
    failure_reason: str

    def allocatable_pages(self, limit: int) -> int: ...
    def alloc_pages(self, n: int) -> list[int]: ...
    def free_pages(self, ids: list[int]) -> None: ...
    def set_capacity(self, pages: int) -> bool: ...
    def trim(self) -> None: ...
    def physical_free_pages(self) -> int: ...
    def stop(self) -> None: ...


@dataclass(frozen=True)
class LedgerSnapshot:
    """Every counter of one pool at one moment (blocks unless named pages)."""

    num_blocks: int
    num_used_blocks: int
    num_set_aside_blocks: int
    available_blocks: int
    blocks_per_page: int
    block_bytes: int
    page_size: int
    in_use_pages: int
    partial_pages: int
    retired_pages: int
    reserve_pool_pages: int
    free_pages: int
    quarantined_pages: int
    capacity_pages: int
    total_pages: int
    mapped_pages: int
    target_pages: int
    in_shrink: bool
    reserve_hits: int
    reserve_misses: int
    map_calls: int
    map_ns_total: int
    unmap_calls: int
    unmap_ns_total: int
    state: str
    failure_reason: str


class BlockLedger:
    """Page-affine block ledger with set-aside blocks and deferred page release."""

    def __init__(
        self,
        page_allocator: PageAllocatorLike,
        block_bytes: int,
        page_size: int,
        *,
        set_aside_null_block: bool = True,
        defer_physical_release: bool = False,
        on_pages_changed: Callable[[], None] | None = None,
    ) -> None:
        geometry = check_page_geometry(block_bytes, page_size)
        self._allocator = page_allocator
        self.block_bytes = block_bytes
        self.page_size = page_size
        self.geometry = geometry
        self.blocks_per_page = geometry.blocks_per_page
        self.defer_physical_release = defer_physical_release
        self._on_pages_changed = on_pages_changed

        total_pages = int(page_allocator.num_total)
        self._total_pages = total_pages
        self._total_blocks = total_pages * self.blocks_per_page
        # Blocks handed out to the engine. Set operations keep the per-block work of alloc and
        # free in C (membership, double-free and foreign-id checks included).
        self._used: set[int] = set()
        # Ledger pages the ledger holds: page -> its free block ids, ascending.
        self._page_free: dict[int, list[int]] = {}
        # Pages with 1..blocks_per_page free blocks, bucketed by free count; bit f of
        # _bucket_mask is set when bucket f is non-empty, so best fit is two int operations.
        self._buckets: list[dict[int, None]] = [{} for _ in range(self.blocks_per_page + 1)]
        self._bucket_mask = 0
        self._partial_free = 0  # free blocks in held pages (partial and retired)
        self._num_used = 0
        self._set_aside: list[int] = []  # set-aside blocks, ascending; alloc takes them first
        self._retired: dict[int, int] = {}  # page -> epoch, in retirement order
        self._epoch = 0
        self._target_pages = int(page_allocator.capacity)  # the ledger's own limit
        self._pending_resize: int | None = None  # written by the limit watcher thread
        self._failure: str | None = None
        self._lock = threading.Lock()  # guards only _pending_resize hand-over
        self._closed = False
        self.null_block_id: int | None = None
        if set_aside_null_block:
            self.null_block_id = self._set_aside_null_block()

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        """Blocks the pool may hold at its current limit."""
        return self._target_pages * self.blocks_per_page

    @property
    def capacity_blocks(self) -> int:
        """Blocks of the whole address range, whatever the limit."""
        return self._total_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_set_aside_blocks(self) -> int:
        return len(self._set_aside) + (1 if self.null_block_id is not None else 0)

    @property
    def mapped_pages(self) -> int:
        """Pages with physical memory behind them (held by the ledger or warm in reserve)."""
        return int(self._allocator.num_in_use) + int(self._allocator.num_reserved)

    @property
    def in_shrink(self) -> bool:
        return int(self._allocator.num_in_use) > self._target_pages

    def available_size(self) -> int:
        """Blocks the next `alloc` accepts (O(1)).

        Scheduler thread only: a limit the watcher published is applied first, as `alloc`
        would apply it. A scheduler checks capacity before it allocates, so a raised limit
        must be seen by the check, or a scheduler that refuses everything never allocates.
        """
        if self._pending_resize is not None and self._failure is None:
            self._apply_pending_resize()
        return self._available_blocks()

    def mapped_free_blocks(self) -> int:
        """Blocks an `alloc` can take without mapping a page: free blocks of held pages,
        set-aside blocks and the warm reserve's pages (no new physical memory, so no budget
        charge)."""
        return (self._partial_free + len(self._set_aside)
                + int(self._allocator.num_reserved) * self.blocks_per_page)

    def _available_blocks(self) -> int:
        return (
            self._partial_free
            + len(self._set_aside)
            + self._allocatable_pages() * self.blocks_per_page
        )

    def _allocatable_pages(self) -> int:
        # One native call under one lock: pages a refill or unmap holds for a moment count,
        # since alloc_pages waits for them rather than refusing.
        return int(self._allocator.allocatable_pages(self._target_pages))

    # ------------------------------------------------------------------ alloc

    def alloc(self, n: int) -> list[int]:
        """Exactly `n` distinct block ids, or PoolExhausted with nothing changed."""
        if self._failure is not None:
            self._refuse()
        if self._pending_resize is not None:
            self._apply_pending_resize()
        if n <= 0:
            if n < 0:
                raise ValueError(f"cannot allocate {n} blocks")
            return []
        set_aside = self._set_aside
        from_set_aside = min(n, len(set_aside))
        remaining = n - from_set_aside
        new_pages: list[int] = []
        if remaining > self._partial_free:
            # Partial pages cannot hold the run: all of them are consumed and new pages
            # supply the rest. Ask the allocator first so that a refusal changes nothing.
            available = self.available_size()
            if n > available:
                raise PoolExhausted(f"requested {n} blocks, {available} available")
            bpp = self.blocks_per_page
            new_pages = self._alloc_pages(-(-(remaining - self._partial_free) // bpp))
        if from_set_aside:
            result = set_aside[:from_set_aside]
            del set_aside[:from_set_aside]
            self._used.update(result)
        else:
            result = []
        while remaining and self._bucket_mask:
            taken = self._take_from_best_page(remaining)
            result += taken
            remaining -= len(taken)
        for page in new_pages:
            self._adopt_page(page)
            if remaining:
                taken = self._take_from_page(page, remaining)
                result += taken
                remaining -= len(taken)
        self._num_used += n
        return result

    def _alloc_pages(self, count: int) -> list[int]:
        try:
            pages = sorted(self._allocator.alloc_pages(count))
        except MapQuarantinedError:
            # The allocator rolled back what it could and set the uncertain pages aside; the
            # ledger is untouched, so the pool carries on (degraded) and the caller decides.
            raise
        except StateConsistencyError as exc:
            self._fail(f"page allocator: {exc}")
            raise
        except RuntimeError as exc:
            # A driver call failed and was cleanly rolled back: nothing changed anywhere.
            raise PoolExhausted(
                f"mapping {count} page(s) failed and was rolled back: {exc}"
            ) from exc
        self._pages_changed()
        return pages

    def _take_from_best_page(self, remaining: int) -> list[int]:
        mask = self._bucket_mask
        fitting = mask >> remaining
        if fitting:
            # Smallest page that holds the whole run.
            free_count = remaining + (fitting & -fitting).bit_length() - 1
        else:
            free_count = mask.bit_length() - 1  # the emptiest page
        page = next(iter(self._buckets[free_count]))
        return self._take_from_page(page, remaining)

    def _take_from_page(self, page: int, want: int) -> list[int]:
        free = self._page_free[page]
        before = len(free)
        count = min(want, before)
        taken = free[:count]
        del free[:count]
        self._move_bucket(page, before, before - count)
        self._partial_free -= count
        self._used.update(taken)
        if before == self.blocks_per_page and page in self._retired:
            del self._retired[page]  # reuse cancels the pending release
        return taken

    def _move_bucket(self, page: int, old: int, new: int) -> None:
        buckets = self._buckets
        if old:
            bucket = buckets[old]
            del bucket[page]
            if not bucket:
                self._bucket_mask &= ~(1 << old)
        if new:
            bucket = buckets[new]
            if not bucket:
                self._bucket_mask |= 1 << new
            bucket[page] = None

    def _adopt_page(self, page: int) -> None:
        bpp = self.blocks_per_page
        if page in self._page_free or not 0 <= page < self._total_pages:
            self._fail(f"page allocator handed out page {page}, which the ledger already holds")
            self._refuse()
        first = page * bpp
        self._page_free[page] = list(range(first, first + bpp))
        self._move_bucket(page, 0, bpp)
        self._partial_free += bpp

    # ------------------------------------------------------------------ free

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks; a page that becomes empty goes back (or retires, when deferred)."""
        if self._failure is not None:
            self._refuse()
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        count = len(ids)
        if not count:
            return
        used = self._used
        if not used.issuperset(ids):
            self._reject_free(ids)
        before_used = len(used)
        used.difference_update(ids)
        if before_used - len(used) != count:
            used.update(ids)  # every id was in use: putting them back restores the ledger
            self._reject_free(ids)
        bpp = self.blocks_per_page
        first_page = min(ids) // bpp
        if first_page == max(ids) // bpp:
            groups: Iterable[tuple[int, list[int]]] = ((first_page, ids),)
        else:
            groups = self._group_by_page(ids)
        emptied: list[int] = []
        page_free = self._page_free
        for page, blocks in groups:
            free = page_free[page]
            before = len(free)
            free += blocks
            free.sort()
            after = before + len(blocks)
            self._move_bucket(page, before, after)
            if after == bpp:
                emptied.append(page)
        self._partial_free += count
        self._num_used -= count
        if emptied:
            self._release_or_retire(emptied)

    def _group_by_page(self, ids: list[int]) -> list[tuple[int, list[int]]]:
        ordered = sorted(ids)
        bpp = self.blocks_per_page
        groups = []
        start, end = 0, len(ordered)
        while start < end:
            page = ordered[start] // bpp
            stop = bisect_left(ordered, (page + 1) * bpp, start, end)
            groups.append((page, ordered[start:stop]))
            start = stop
        return groups

    def _reject_free(self, ids: list[int]) -> NoReturn:
        # Called before any change (or after undoing it): the ledger is unchanged.
        seen: set[int] = set()
        reason = "free rejected"
        for block in ids:
            if block in seen:
                reason = f"free of block {block!r}: listed twice in one free"
                break
            seen.add(block)
            if block in self._used:
                continue
            if not isinstance(block, int) or not 0 <= block < self._total_blocks:
                what = "not a block of this pool"
            elif block == self.null_block_id or block in self._set_aside:
                what = "set aside (by try_to_set_aside, or the null block), not allocated"
            else:
                what = "not allocated (double free)"
            reason = f"free of block {block!r}: {what}"
            break
        self._fail(reason)
        raise StateConsistencyError(reason)

    def _release_or_retire(self, pages: list[int]) -> None:
        if self.defer_physical_release:
            epoch = self._epoch
            for page in pages:
                self._retired[page] = epoch
            return
        self._drop_pages(pages)

    def _drop_pages(self, pages: list[int]) -> None:
        bpp = self.blocks_per_page
        for page in pages:
            del self._page_free[page]
            self._move_bucket(page, bpp, 0)
            self._retired.pop(page, None)
        self._partial_free -= bpp * len(pages)
        try:
            self._allocator.free_pages(pages)
        except StateConsistencyError as exc:
            self._fail(f"page allocator: {exc}")
            raise
        self._pages_changed()

    # ------------------------------------------------------------------ release epochs

    def capture_release_marker(self) -> int:
        """Call after submitting a batch; pass the value to `release_retired_through` later."""
        marker = self._epoch
        self._epoch += 1
        return marker

    def release_retired_through(self, marker: int) -> int:
        """Release pages retired up to `marker`; every batch submitted by then has finished.

        Returns the number of pages released.
        """
        if self._failure is not None:
            self._refuse()
        ready = [page for page, epoch in self._retired.items() if epoch <= marker]
        if ready:
            self._drop_pages(ready)
        return len(ready)

    @property
    def num_retired_pages(self) -> int:
        return len(self._retired)

    # ------------------------------------------------------------------ set-aside blocks

    def try_to_set_aside(self, n: int) -> bool:
        """Set aside `n` blocks that later `alloc` calls use first; False if they do not fit."""
        if self._failure is not None:
            self._refuse()
        if n <= 0:
            return n == 0
        if n > self.available_size() - len(self._set_aside):
            return False
        try:
            blocks = self._alloc_fresh(n)
        except PoolExhausted:
            return False
        self._num_used -= n
        self._used.difference_update(blocks)
        self._set_aside = sorted(self._set_aside + blocks)
        return True

    def _alloc_fresh(self, n: int) -> list[int]:
        """alloc() without touching the set-aside blocks."""
        saved, self._set_aside = self._set_aside, []
        try:
            return self.alloc(n)
        finally:
            self._set_aside = saved

    def free_set_aside(self) -> None:
        """Give the set-aside blocks back (the null block stays)."""
        if self._failure is not None:
            self._refuse()
        blocks, self._set_aside = self._set_aside, []
        if not blocks:
            return
        self._used.update(blocks)
        self._num_used += len(blocks)
        self.free(blocks)

    def _set_aside_null_block(self) -> int:
        blocks = self._alloc_fresh(1)
        block = blocks[0]
        if block != 0:
            self.free(blocks)
            raise StateConsistencyError(
                f"null block must be block 0, the allocator handed out block {block} first"
            )
        self._used.discard(block)
        self._num_used -= 1
        return block

    # ------------------------------------------------------------------ limits

    def request_resize(self, num_blocks: int) -> None:
        """Thread-safe: publish a target that the next `alloc` applies (scheduler thread)."""
        with self._lock:
            self._pending_resize = num_blocks

    def _apply_pending_resize(self) -> None:
        with self._lock:
            target, self._pending_resize = self._pending_resize, None
        if target is not None:
            self.resize(target)

    def resize(self, num_blocks: int) -> bool:
        """Set the pool's limit in blocks (whole pages). Never revokes live blocks.

        Returns True when applied at once, False when a shrink is pending: new allocations
        respect the new limit at once and it completes as blocks drain.
        """
        if self._failure is not None:
            self._refuse()
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        pages = min(num_blocks // self.blocks_per_page, self._total_pages)
        self._target_pages = pages
        # The allocator unmaps warm reserve pages beyond the new limit at once; pages in use
        # stay until their blocks drain (each page release retries the limit).
        applied = bool(self._allocator.set_capacity(pages))
        self._pages_changed()
        return applied

    # ------------------------------------------------------------------ lifecycle

    def trim(self) -> None:
        """Unmap the allocator's warm reserve pool."""
        self._allocator.trim()
        self._pages_changed()

    def clear(self) -> None:
        """Free every block (including set-aside ones), trim, and set the null block aside again.

        The null block's page stays mapped throughout. It is the pool's floor: no limit or
        budget takes it back (a resize never revokes live blocks), so a clear under a limit of
        zero or a spent budget (SGLang's `flush_cache` on an engine the router put to sleep)
        must not have to map it again, where the limit or the budget would refuse it.
        """
        if self._failure is not None:
            self._refuse()
        keep = 0 if self.null_block_id is not None and 0 in self._page_free else None
        pages = sorted(page for page in self._page_free if page != keep)
        for page, free in self._page_free.items():
            self._move_bucket(page, len(free), 0)
        self._page_free.clear()
        self._retired.clear()
        self._set_aside = []
        self._used = set()
        self._partial_free = 0
        self._num_used = 0
        if pages:
            try:
                self._allocator.free_pages(pages)
            except StateConsistencyError as exc:
                self._fail(f"page allocator: {exc}")
                raise
        self._allocator.trim()
        if keep is not None:
            self._adopt_page(keep)
            taken = self._take_from_page(keep, 1)
            if taken != [0]:
                self._fail(f"null block must be block 0, page 0 gave {taken}")
                self._refuse()
            self._used.discard(0)
            self.null_block_id = 0
        elif self.null_block_id is not None:
            self.null_block_id = self._set_aside_null_block()
        self._pages_changed()

    def shutdown(self) -> None:
        """Stop the allocator's background work. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._allocator.stop()

    def snapshot(self) -> LedgerSnapshot:
        allocator = self._allocator
        in_use = int(allocator.num_in_use)
        reserve_pool = int(allocator.num_reserved)
        return LedgerSnapshot(
            num_blocks=self.num_blocks,
            num_used_blocks=self._num_used,
            num_set_aside_blocks=self.num_set_aside_blocks,
            available_blocks=self._available_blocks(),
            blocks_per_page=self.blocks_per_page,
            block_bytes=self.block_bytes,
            page_size=self.page_size,
            in_use_pages=in_use,
            partial_pages=len(self._page_free) - len(self._retired),
            retired_pages=len(self._retired),
            reserve_pool_pages=reserve_pool,
            free_pages=int(allocator.num_free),
            quarantined_pages=int(allocator.num_quarantined),
            capacity_pages=int(allocator.capacity),
            total_pages=self._total_pages,
            mapped_pages=in_use + reserve_pool,
            target_pages=self._target_pages,
            in_shrink=in_use > self._target_pages,
            reserve_hits=int(allocator.reserve_hits),
            reserve_misses=int(allocator.reserve_misses),
            map_calls=int(allocator.map_calls),
            map_ns_total=int(allocator.map_ns_total),
            unmap_calls=int(allocator.unmap_calls),
            unmap_ns_total=int(allocator.unmap_ns_total),
            state="failed" if self._failure is not None else str(allocator.state),
            failure_reason=self._failure or str(allocator.failure_reason),
        )

    def block_pages(self, block_ids: Iterable[int]) -> list[int]:
        """Ledger pages holding the given blocks (for diagnostics)."""
        bpp = self.blocks_per_page
        return sorted({block // bpp for block in block_ids})

    def holds_page(self, page: int) -> bool:
        """Whether ledger page `page` is held (its blocks in use, free to hand out or retired)."""
        return page in self._page_free

    def page_occupancy(self) -> dict[int, int]:
        """Used blocks per held page (for diagnostics and tests)."""
        bpp = self.blocks_per_page
        return {page: bpp - len(free) for page, free in self._page_free.items()}

    # ------------------------------------------------------------------ failure

    @property
    def failure_reason(self) -> str | None:
        return self._failure

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason

    def _refuse(self) -> NoReturn:
        raise StateConsistencyError(f"pool refuses work: {self._failure}")

    def set_pages_changed_callback(self, callback: Callable[[], None] | None) -> None:
        """Called (on the scheduler thread) whenever pages are mapped or released."""
        self._on_pages_changed = callback

    def _pages_changed(self) -> None:
        if self._on_pages_changed is not None:
            self._on_pages_changed()
