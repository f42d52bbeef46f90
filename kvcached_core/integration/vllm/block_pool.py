"""The elastic block pool: vLLM's BlockPool whose blocks are backed page by page by kvcached.

vLLM's own free queue keeps deciding which block is handed out and which cached block is
evicted (so prefix caching behaves exactly as stock); kvcached decides which *pages* are
physically backed. A ledger page holds consecutive vLLM blocks (`k` of them when blocks tile
pages; when they do not, as MLA's 36,864-byte blocks on 2 MiB pages, a block that straddles two
pages belongs to neither and is never handed out: `layout.BlockTiling`). The pool:

- hands out only blocks whose page is held, in vLLM's queue order, and asks kvcached for new
  pages only when the held pages have too few free blocks (`PoolExhausted` if it cannot map);
- reports as free only what it could hand out now (held free blocks + mappable pages);
- at each engine step end returns pages whose blocks are all free and uncached, and, while the
  free-but-mapped blocks exceed `KVCACHED_MAX_CACHED_TOKENS`, evicts whole pages of cached
  blocks, oldest first, so idle memory really goes back.

It uses only BlockPool interfaces present in every supported vLLM: `blocks`, `num_gpu_blocks`,
`enable_caching`, `free_block_queue` (`num_free_blocks`, `popleft`, `append`, `remove`,
construction from a block list), `get_new_blocks`, `free_blocks`,
`reset_prefix_cache`, `get_num_free_blocks`, `_maybe_evict_cached_block`, and per block
`block_id`, `ref_cnt`, `block_hash`. `unpin_blocks` (newer vLLMs only) is followed where the
engine calls it: an override no older engine ever reaches.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvcached_core.errors import KVCachedConfigError, PoolExhausted
from kvcached_core.integration.vllm import pools, workers
from kvcached_core.integration.vllm.config import engine_settings, pool_name
from kvcached_core.ledger import LedgerSnapshot


class _ChosenBlocks:
    """Stands in for vLLM's free queue inside its own `get_new_blocks`, which takes blocks
    only with `popleft_n` (vLLM >= 0.10) or `popleft` (0.9) and reads `num_free_blocks`: it
    hands out exactly the blocks the elastic pool chose, in order. A new FreeKVCacheBlockQueue
    of them would build and link two sentinel blocks on every allocation."""

    __slots__ = ("_blocks", "num_free_blocks")

    def __init__(self, blocks: list[Any]) -> None:
        self._blocks = blocks
        self.num_free_blocks = len(blocks)

    def popleft_n(self, count: int) -> list[Any]:
        if count > self.num_free_blocks:
            raise ValueError(f"{count} blocks asked of {self.num_free_blocks} chosen")
        taken, self._blocks = self._blocks[:count], self._blocks[count:]
        self.num_free_blocks -= count
        return taken

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]


class ElasticBlockPoolMixin:
    """Placed before vLLM's BlockPool in the MRO of the class `elastic_block_pool_class` makes."""

    # Attributes of vLLM's BlockPool this mixin relies on (set by its __init__).
    blocks: list[Any]
    num_gpu_blocks: int
    enable_caching: bool
    free_block_queue: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = engine_settings()
        name = pool_name()
        # A scheduler-only process has no engine KV buffers by its own declaration: a pool
        # registered in it (a test's standalone KV allocation) is never this scheduler's.
        engine_pool = None if settings.scheduler_only else workers.scheduler_pool(name)
        if engine_pool is None and settings.scheduler_only:
            engine_pool = pools.private_pool(self.num_gpu_blocks, settings)
        elif engine_pool is None:
            raise KVCachedConfigError(
                f"kvcached: elastic KV cache is on (KVCACHED_ENABLE=1) but no VMM-backed KV "
                f"pool {name!r} exists for this scheduler: the model runner's KV buffers were "
                "not allocated by kvcached (a model runner or KV layout this build does not "
                "cover). Set KVCACHED_ENABLE=0 for the stock KV cache; a process that runs a "
                "scheduler with no KV buffers at all (planning, scheduler tests) sets "
                "KVCACHED_SCHEDULER_ONLY=1."
            )
        elif engine_pool.attached:
            raise KVCachedConfigError(
                f"kvcached: KV pool {name!r} already backs another block pool in this "
                "process; set KVCACHED_POOL_NAME per engine or KVCACHED_ENABLE=0"
            )
        elif engine_pool.num_blocks < self.num_gpu_blocks:
            raise ValueError(
                f"kvcached pool {engine_pool.name!r} backs {engine_pool.num_blocks} blocks, "
                f"the scheduler wants {self.num_gpu_blocks}"
            )
        engine_pool.attached = True
        self._kv = engine_pool
        # What the pool could still map, read once per engine step (None: read it again).
        # The scheduler checks capacity once per request and step (hundreds of times a
        # step); the figure changes within a step only by this pool's own maps, which reset
        # it, or by a neighbour or a limit, which the next step sees. A check that ran on a
        # stale figure is safe: the allocation itself is authoritative (PoolExhausted).
        self._kv_available_size = engine_pool.pool.available_size
        self._kv_mappable_now: int | None = None
        tiling = engine_pool.tiling
        self._kv_tiling = tiling
        # Blocks a newly held page surely adds (all pages hold exactly this many when blocks
        # tile pages; one fewer at some pages when blocks straddle page boundaries).
        self._kv_k = tiling.min_blocks_per_page
        num_pages = tiling.pages_for(self.num_gpu_blocks)
        self._kv_num_pages = num_pages
        self._kv_held: set[int] = set()  # the pages whose blocks may be handed out
        # When each page last had a block freed (a tick per free_blocks call): trimming evicts
        # the least recently freed pages first without walking vLLM's free queue, which holds
        # every block of the virtual KV space (hundreds of thousands on a large GPU).
        self._kv_page_freed_at = [0] * num_pages
        self._kv_free_tick = 0
        self._kv_unheld_blocks = self.num_gpu_blocks
        # Blocks that straddle two pages: counted as unheld for ever, parked when met.
        self._kv_unusable = self.num_gpu_blocks - sum(
            self._page_blocks(page) for page in range(num_pages))
        # Free blocks of pages not held wait here, out of vLLM's free queue, until their page
        # is held: those an allocation meets at the head of the queue (the queue starts with
        # every block of the virtual KV space), those of a page given back (`_drop_page`),
        # and at the first idle step end all the rest (`_park_queued_unheld_blocks`). Each is
        # passed over at most once instead of on every allocation. (Key None: blocks that
        # straddle two pages, parked for good.)
        self._kv_parked: dict[int | None, list[Any]] = {}
        self._kv_parked_count = 0
        self._kv_dirty: set[int] = set()
        self._kv_logical_view = False
        self._kv_max_cached_tokens = settings.max_cached_tokens
        # True while the last trim left the free-but-mapped blocks over the cap with no held
        # page idle: only a block freed since can make a page evictable again.
        self._kv_trim_exhausted = False
        # Release markers of the engine steps whose batches may still read retired pages.
        self._kv_release_markers: deque[int] = deque()
        # Tokens per vLLM block, learnt at the first step end (0 until then).
        self._kv_block_tokens = 0
        # The engine's "no request left and no batch in flight" check, handed over at each
        # step end: a prefix-cache reset between steps asks it before it unmaps anything.
        self._kv_is_drained: Callable[[], bool] | None = None
        null_page = engine_pool.pool.null_block_id
        if null_page != 0:
            raise ValueError(f"kvcached pool must hold the null block on page 0, got {null_page}")
        self._hold_page(0)

    # ------------------------------------------------------------------ accounting

    def _page_range(self, page: int) -> range:
        """The vLLM blocks of ledger page `page` (the last page may be cut by num_gpu_blocks)."""
        blocks = self._kv_tiling.blocks_of(page)
        return range(blocks.start, min(blocks.stop, self.num_gpu_blocks))

    def _page_blocks(self, page: int) -> int:
        return len(self._page_range(page))

    def _hold_page(self, page: int) -> None:
        self._kv_held.add(page)
        self._kv_unheld_blocks -= self._page_blocks(page)
        parked = self._kv_parked.pop(page, None)
        if parked:
            self._kv_parked_count -= len(parked)
            queue = self.free_block_queue
            for block in parked:
                queue.append(block)

    def _drop_page(self, page: int) -> None:
        """Page `page` is given back: its blocks, all free and queued then, leave vLLM's queue
        and wait parked until the page is held again. Left queued, they would sit at its tail
        and the next burst, which gets the same low pages back, would pass over every one of
        them on its first allocations (about ten thousand blocks a burst on a GPU)."""
        self._kv_held.discard(page)
        span = self._page_range(page)
        self._kv_unheld_blocks += len(span)
        blocks = self.blocks[span.start:span.stop]
        queue = self.free_block_queue
        for block in blocks:
            queue.remove(block)
        self._kv_parked.setdefault(page, []).extend(blocks)
        self._kv_parked_count += len(blocks)

    def _park_queued_unheld_blocks(self) -> None:
        """Take every block of a page not held out of vLLM's queue, once the engine is idle.

        At start the queue holds every block of the virtual KV space; allocations park those
        they meet, and pages given back park their own (`_drop_page`), but the blocks of pages
        never used stay queued ahead of the freed ones. The first allocation after an idle
        spell, which gets the same low pages back, would pass over all of them (hundreds of
        thousands on a large GPU). This moves that walk to the first idle step end, once per
        engine: afterwards the queue holds only blocks of held pages, and get_new_blocks is
        vLLM's own whenever they suffice.
        """
        queue, parked, held = self.free_block_queue, self._kv_parked, self._kv_held
        page_of = self._kv_tiling.page_of
        already = {block.block_id for blocks in parked.values() for block in blocks}
        for block in self.blocks:
            if block.block_id in already:
                continue
            page = page_of(block.block_id)  # None: it straddles two pages
            if page in held:
                continue  # handed out, or queued in a held page
            queue.remove(block)  # free: no block of a page not held is ever in use
            parked.setdefault(page, []).append(block)
            self._kv_parked_count += 1

    def _held_free_blocks(self) -> int:
        queued_unheld = self._kv_unheld_blocks - self._kv_parked_count
        return int(self.free_block_queue.num_free_blocks) - queued_unheld

    def _logical_free_blocks(self) -> int:
        return int(self.free_block_queue.num_free_blocks) + self._kv_parked_count

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free in held pages, plus mappable pages.

        The scheduler asks once or twice per request and step: the arithmetic is inlined
        (`_held_free_blocks`, `_logical_free_blocks`) and the pool is read once per step.
        """
        free = self.free_block_queue.num_free_blocks + self._kv_parked_count
        if self._kv_logical_view:
            return free
        unheld = self._kv_unheld_blocks
        if unheld == 0:
            return free
        mappable = self._kv_mappable_now
        if mappable is None:
            mappable = self._mappable_pages()
        usable = unheld - self._kv_unusable
        if mappable < self._kv_num_pages - len(self._kv_held):
            # Not every page can be mapped: count the fewest blocks a page surely adds.
            usable = min(usable, mappable * self._kv_k)
        return free - unheld + usable

    def _mappable_pages(self) -> int:
        mappable = self._kv_mappable_now
        if mappable is None:
            mappable = self._kv_mappable_now = int(self._kv_available_size())
        return mappable

    def make_room_in_held_pages(self, tokens: int, groups: int) -> bool:
        """Whether adding at most `tokens` tokens to one request in each of `groups` KV cache
        groups surely needs no block beyond the free blocks of held pages, after holding one
        more page when that is all they lack and the pool has it now. Such an allocation maps
        nothing, so it cannot lose a page race to another engine (the caller then skips the
        snapshot that undoes a lost race).

        A request holding the blocks of its c computed tokens needs at most
        ceil((c + t) / b) - ceil(c / b) <= ceil(t / b) new blocks for t more tokens (one more
        is allowed for slack). False until the block size is known. Asked once per request
        and step, so `_held_free_blocks` is inlined. Decode steps run short of held blocks
        every few steps (a page holds a few hundred blocks at most, a step of 64 requests in
        7 groups takes about 28): the page a later call would have mapped mid-allocation is
        mapped here, before any group took a block. Only within one page of what is held
        and within what the pool can map: a long prompt's bound (every group as if it kept
        every token) would map pages that sliding-window groups never fill, and a request
        that cannot be admitted maps nothing. A page held here and not used is not idle
        for `release_idle_pages` (no block of it was freed), so it is not mapped and dropped
        step after step.
        """
        block_tokens = self._kv_block_tokens
        if block_tokens <= 0:
            return False
        need = groups * (-(-tokens // block_tokens) + 1)
        missing = need - (self.free_block_queue.num_free_blocks - self._kv_unheld_blocks
                          + self._kv_parked_count)
        if missing <= 0:
            return True
        if missing > self._kv_k or need > self.get_num_free_blocks():
            return False
        try:
            self._map_pages_for(missing)
        except PoolExhausted:  # a neighbour took the page: the caller's snapshot path decides
            return False
        return True

    # ------------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        queue = self.free_block_queue
        # Free blocks of held pages still in vLLM's queue (`_held_free_blocks`, inlined: this
        # runs for every group of every request that needs a block). When they suffice, as
        # they do on most calls, the checks below cannot fail and nothing is mapped.
        held_free = queue.num_free_blocks - self._kv_unheld_blocks + self._kv_parked_count
        if not 0 < num_blocks <= held_free:
            if num_blocks > self._logical_free_blocks():
                raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
            available = self.get_num_free_blocks()
            if num_blocks > available:
                # Physical pressure (another engine took pages since the caller's check).
                raise PoolExhausted(
                    f"requested {num_blocks} blocks, {available} backed or mappable")
            if num_blocks <= 0:
                return super().get_new_blocks(num_blocks)  # type: ignore[misc]
            self._map_pages_for(num_blocks - held_free)
        if self._kv_unheld_blocks == self._kv_parked_count:
            # Every queued block lies in a held page (the usual case once the engine has
            # been idle once: `_park_queued_unheld_blocks`): vLLM's own method takes them.
            return super().get_new_blocks(num_blocks)  # type: ignore[misc]
        chosen: list[Any] = []
        held, page_of = self._kv_held, self._kv_tiling.page_of
        # vLLM >= 0.10 takes several blocks in one call; 0.9's queue has popleft only.
        take_n = getattr(queue, "popleft_n", None)
        missing = num_blocks
        while missing:
            for block in (take_n(missing) if take_n is not None
                          else [queue.popleft() for _ in range(missing)]):
                page = page_of(block.block_id)  # None: it straddles two pages
                if page in held:
                    chosen.append(block)
                else:
                    # A block of an unbacked page carries no data: it waits for its page
                    # (a straddling block, for ever).
                    self._kv_parked.setdefault(page, []).append(block)
                    self._kv_parked_count += 1
            missing = num_blocks - len(chosen)
        # vLLM's own get_new_blocks does the per-block work (cache eviction, KV events,
        # ref counts, metrics) on exactly the chosen blocks, in queue order.
        self.free_block_queue = _ChosenBlocks(chosen)
        parked_count, self._kv_parked_count = self._kv_parked_count, 0
        self._kv_logical_view = True
        try:
            return super().get_new_blocks(num_blocks)  # type: ignore[misc]
        finally:
            self.free_block_queue = queue
            self._kv_parked_count = parked_count
            self._kv_logical_view = False

    def _map_pages_for(self, missing_blocks: int) -> None:
        """Hold enough new pages for `missing_blocks` more blocks; PoolExhausted changes nothing."""
        if missing_blocks <= 0:
            return
        # As many pages as the blocks need if each page holds the most blocks a page can
        # (all hold that many when blocks tile pages); a short count is topped up below.
        k = self._kv_tiling.ledger_bytes // self._kv_tiling.unit_bytes
        self._kv_mappable_now = None  # mapping (or failing to) changes what is left
        pages = self._kv.pool.alloc(-(-missing_blocks // k))
        self._kv_trim_exhausted = False  # the held pages changed: the next trim looks again
        for page in pages:
            self._hold_page(page)
        short = missing_blocks - sum(self._page_blocks(p) for p in pages)
        if short > 0:  # a partial last page came back; ask for the rest
            try:
                self._map_pages_for(short)
            except BaseException:
                for page in pages:
                    self._drop_page(page)
                self._kv.pool.free(pages)
                raise

    def free_blocks(self, ordered_blocks: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        # The release's own options pass through (0.23's `prepend`, LIFO reuse of blocks
        # without a hash).
        blocks = list(ordered_blocks)
        super().free_blocks(blocks, *args, **kwargs)  # type: ignore[misc]
        page_of = self._kv_tiling.page_of
        # A straddling block (no page) is never handed out, so never freed; None is dropped
        # all the same rather than trusted.
        pages = {page for block in blocks if (page := page_of(block.block_id)) is not None}
        self._kv_dirty.update(pages)
        self._kv_free_tick += 1
        freed_at, tick = self._kv_page_freed_at, self._kv_free_tick
        for page in pages:
            freed_at[page] = tick

    def unpin_blocks(self, blocks: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        """Where the engine has it: unpinned blocks rejoin the free queue, so a page may have
        become evictable; the blocks stay readable, so their pages are not marked dirty."""
        super().unpin_blocks(blocks, *args, **kwargs)  # type: ignore[misc]
        self._kv_trim_exhausted = False

    def reset_prefix_cache(self) -> bool:
        self._kv_logical_view = True
        try:
            reset = bool(super().reset_prefix_cache())  # type: ignore[misc]
        finally:
            self._kv_logical_view = False
        if reset:
            self._kv_dirty.update(self._kv_held)
            self._release_after_reset()
        return reset

    def _release_after_reset(self) -> None:
        """A reset succeeds only when no request holds a block, and it comes between steps
        (an operator's call, or the router putting an idle engine to sleep): an idle engine
        takes no further step whose end would give the uncached pages back, so they are given
        back now, once the engine says no batch is in flight that could still read them.
        Before the first step end nothing was ever handed out, so there is nothing to give."""
        is_drained = self._kv_is_drained
        if is_drained is None or not is_drained():
            return  # the next step end releases them
        self.release_idle_pages(self._kv_block_tokens)
        pool = self._kv.pool
        pool.release_retired_through(pool.capture_release_marker())
        self._kv_release_markers.clear()
        pool.trim()

    # ------------------------------------------------------------------ release

    def _page_is_idle(self, page: int, *, cached_ok: bool) -> bool:
        blocks = self._page_range(page)
        for block in self.blocks[blocks.start:blocks.stop]:
            if block.ref_cnt != 0 or (block.block_hash is not None and not cached_ok):
                return False
        return True

    def release_idle_pages(self, block_tokens: int) -> int:
        """Give back idle pages; called at engine step end. Returns the pages given back."""
        released: list[int] = []
        dirty = self._kv_dirty
        if dirty:
            held = self._kv_held
            for page in sorted(dirty):
                if page != 0 and page in held and self._page_is_idle(page, cached_ok=False):
                    released.append(page)
            for page in released:
                self._drop_page(page)
        cap = self._kv_max_cached_tokens
        if cap >= 0 and self._held_free_blocks() * block_tokens > cap:
            if not self._kv_trim_exhausted or any(
                page != 0 and page in self._kv_held and self._page_is_idle(page, cached_ok=True)
                for page in dirty
            ):
                released += self._trim_cached_pages(cap, block_tokens)
        else:
            self._kv_trim_exhausted = False
        dirty.clear()
        if released:
            self._kv.pool.free(released)
        return len(released)

    def _trim_cached_pages(self, cap_tokens: int, block_tokens: int) -> list[int]:
        """Evict whole pages of cached free blocks, least recently freed first, down to the cap."""
        candidates = sorted(
            (p for p in self._kv_held if p != 0 and self._page_is_idle(p, cached_ok=True)),
            key=self._kv_page_freed_at.__getitem__,
        )
        trimmed: list[int] = []
        for page in candidates:
            if self._held_free_blocks() * block_tokens <= cap_tokens:
                break
            blocks = self._page_range(page)
            for block in self.blocks[blocks.start:blocks.stop]:
                if block.block_hash is not None:
                    self._maybe_evict_cached_block(block)  # type: ignore[attr-defined]
            self._drop_page(page)
            trimmed.append(page)
        self._kv_trim_exhausted = self._held_free_blocks() * block_tokens > cap_tokens
        return trimmed

    def end_step(self, *, block_tokens: int, lag: int, is_drained: Callable[[], bool]) -> int:
        """The engine finished a step: give idle pages back. Returns the pages given back.

        Pages freed during this step are retired now and unmapped once `lag` more steps have
        ended (0: at once; the batches still in flight might read them until then, see
        `engine.released_after_step`). When the engine has drained (`is_drained()`: no request
        left and no batch in flight; asked only while retired or reserve pages are held, or blocks
        of pages not held are still queued), every
        retired page is unmapped at once, since no batch is left to read it and an idle engine
        takes no further step that would release it, and the reserve is unmapped too: reserve
        pages hold no block, and the next allocation refills it.
        """
        self._kv_block_tokens = block_tokens
        self._kv_is_drained = is_drained
        self._kv_mappable_now = None  # a new step: read what the pool can map again
        released = self.release_idle_pages(block_tokens)
        pool = self._kv.pool
        markers = self._kv_release_markers
        markers.append(pool.capture_release_marker())
        while len(markers) > lag:
            pool.release_retired_through(markers.popleft())
        queued_unheld = self._kv_unheld_blocks != self._kv_parked_count
        # is_drained may wait for the batches in flight: asked once, and only when needed.
        if (queued_unheld or markers or pool.reserve_pages) and is_drained():
            if queued_unheld:
                self._park_queued_unheld_blocks()
            if markers:
                pool.release_retired_through(markers[-1])  # the newest covers every older one
                markers.clear()
            pool.trim()
        return released

    def kv_snapshot(self) -> LedgerSnapshot:
        """The ledger's figures (pages in use, reserve, limit, counters) for reporting."""
        return self._kv.pool.snapshot()


@functools.cache
def elastic_block_pool_class(block_pool_cls: type) -> type:
    """The elastic subclass of the BlockPool class the call site passes in."""
    return type(
        f"Elastic{block_pool_cls.__name__}",
        (ElasticBlockPoolMixin, block_pool_cls),
        {"__module__": __name__, "__doc__": ElasticBlockPoolMixin.__doc__},
    )


def make_block_pool(block_pool_cls: type, *args: Any, **kwargs: Any) -> Any:
    """What `KVCacheCoordinator.__init__` builds: stock BlockPool, or its elastic subclass."""
    if not engine_settings().enabled:
        return block_pool_cls(*args, **kwargs)
    return elastic_block_pool_class(block_pool_cls)(*args, **kwargs)
