"""The elastic sliding-window allocator: SGLang's hybrid SWA allocator over two elastic sides.

A hybrid sliding-window model (some layers attend to the whole sequence, the others to the last
`window` tokens) keeps two pools in SGLang: the full-attention layers' and the window layers'
(`SWAKVPool`), each an MHA pool, and one composite allocator (`SWATokenToKVPoolAllocator`)
over two sub-allocators, one per pool, joined by `full_to_swa_index_mapping`. The build makes
the two pools and the two sub-allocators elastic (the MHA pool and token / paged allocator
seams rebind the names this allocator's module imports), so each side maps pages only for the
slots it holds and gives them back when they empty, and the window side frees slots that left
the window as SGLang evicts them (its mapped memory stays O(window) per request, not
O(length)).

What the composite itself must do, and this mixin does:

- **Capacity gates under the physical limit.** SGLang's scheduler asks the allocator (admission
  budget, eviction before an allocation, the decode check that retraction converges on); the
  stock composite answers from the logical sizes of both sides. Here each gate uses what each
  side can allocate now under its pool's limit and budget (`kvcached_allocatable_size` of the
  sub-allocators), so a lowered limit on either pool makes requests wait, evict or retract.
  The logical sizes (`available_size`, `full_available_size`, `swa_available_size`) stay
  stock: SGLang's leak invariant conserves them.
- **Both sides or neither.** The stock composite allocates the full side, then the window
  side, and asserts both succeeded (a refused second side stops the engine and leaks the
  first). Here the pages of both sides are taken from their ledgers first, the second refusal
  gives the first back, and only then do the stock methods run on exactly those pages
  (`_kvcached_pretaken` of each sub-allocator).

Shapes this mixin does not serve are refused when the allocator is built: a subclass (the
unified-memory and NPU allocators), a per-request SWA ring, and sub-allocators that are not
elastic.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.sglang.allocators import _ElasticAllocatorCommon
from kvcached_core.integration.sglang.capacity import evict_for_allocation
from kvcached_core.integration.sglang.pools import refuse_unless_leaf
from kvcached_core.integration.sglang.prefix_cache import shares_prefixes

if TYPE_CHECKING:
    import torch


@functools.cache
def _limited_swa_prefill_budget() -> type:
    """SGLang's SWAPrefillBudget short of what each side's physical limit withholds."""
    from sglang.srt.mem_cache.prefill_budget import SWAPrefillBudget

    class ElasticSWAPrefillBudget(SWAPrefillBudget):
        def _available_and_evictable(self) -> int:
            allocator = self.allocator
            withheld = (allocator.swa_attn_allocator if self.all_swa
                        else allocator.full_attn_allocator).kvcached_withheld_size()
            return int(super()._available_and_evictable() - withheld)

        @property
        def remaining_swa(self) -> int:
            withheld = self.allocator.swa_attn_allocator.kvcached_withheld_size()
            return int(super().remaining_swa - withheld)

    return ElasticSWAPrefillBudget


def _pages_for(seq_lens_cpu: torch.Tensor, page_size: int, *, prefix_lens_cpu: Any = None,
               decode: bool = False) -> int:
    from sglang.srt.utils.common import get_num_new_pages

    if decode:
        return int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=page_size, decode=True))
    return int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=page_size,
                                 prefix_lens=prefix_lens_cpu))


class ElasticSWAAllocatorMixin:
    """SWATokenToKVPoolAllocator whose capacity gates and allocations respect both sides'
    physical limits (see the module's docstring)."""

    full_attn_allocator: Any
    swa_attn_allocator: Any
    page_size: int

    # ------------------------------------------------------------------ set-up

    def clear(self) -> None:
        refuse_unless_leaf(self, "sliding-window allocator")
        if getattr(self, "_swa_req_ring", False):
            raise KVCachedConfigError(
                "kvcached: a per-request sliding-window ring (its window rows belong to request "
                "slots, not to pages) is not supported with KVCACHED_ENABLE=1; set "
                "KVCACHED_ENABLE=0 for this model")
        for side in (self.full_attn_allocator, self.swa_attn_allocator):
            if not isinstance(side, _ElasticAllocatorCommon):
                raise KVCachedConfigError(
                    f"kvcached: the sliding-window allocator's {type(side).__qualname__} is "
                    "not elastic (a platform allocator this build does not cover); set "
                    "KVCACHED_ENABLE=0 for this model")
        super().clear()  # type: ignore[misc]

    def resize(self, config: Any) -> None:
        # Only post-capture KV sizing resizes, and the configuration guard refuses it.
        raise KVCachedConfigError(
            "kvcached: resizing the sliding-window pools after start is not supported with "
            "KVCACHED_ENABLE=1 (post-capture KV sizing); set KVCACHED_ENABLE=0")

    # ------------------------------------------------------------------ sizes

    def kvcached_allocatable_size(self) -> int:
        """Slots both sides can allocate now under their physical limits."""
        return min(self.full_attn_allocator.kvcached_allocatable_size(),
                   self.swa_attn_allocator.kvcached_allocatable_size())

    # ------------------------------------------------------------------ capacity gates

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0
                              ) -> Any:
        return _limited_swa_prefill_budget()(self, tree_cache,
                                             num_mixed_decode_tokens=num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        """SGLang's eviction before an allocation, with each side's shortfall counted against
        what that side can allocate under its limit."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if not shares_prefixes(tree_cache):
            return
        full_shortfall = max(0, num_tokens - self.full_attn_allocator.kvcached_allocatable_size())
        swa_shortfall = max(0, num_tokens - self.swa_attn_allocator.kvcached_allocatable_size())
        if full_shortfall or swa_shortfall:
            evict_for_allocation(
                tree_cache, EvictParams(num_tokens=full_shortfall, swa_num_tokens=swa_shortfall))

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                              spec_algorithm: Any = None) -> bool:
        """Whether the next decode step fits on both sides after eviction, under their
        limits; when it does not, SGLang retracts requests until it does."""
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.kvcached_allocatable_size() >= num_tokens

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        if self.full_attn_allocator._kvcached_pretaken is not None:
            return True  # the stock method's own check, after `_take_both` took the pages
        page = self.page_size
        return (num_full_pages <= self.full_attn_allocator.kvcached_allocatable_size() // page
                and num_swa_pages <= self.swa_attn_allocator.kvcached_allocatable_size() // page)

    def reclaim_for_prealloc(self, tree_cache: Any, full_tokens: int, swa_tokens: int
                             ) -> str | None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        available = self.swa_attn_allocator.kvcached_allocatable_size()
        if available < swa_tokens:
            evict_for_allocation(tree_cache, EvictParams(swa_num_tokens=swa_tokens - available))
            available = self.swa_attn_allocator.kvcached_allocatable_size()
        if available < swa_tokens:
            return (f"SWA eviction insufficient under the kvcached limit: needed={swa_tokens}, "
                    f"available={available}")
        return None

    # ------------------------------------------------------------------ allocation

    def _take_both(self, full_pages: int, swa_pages: int) -> bool:
        """Take both sides' pages for the allocation that follows, or neither."""
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        full_ids = full._kvcached.take(full_pages)
        if full_ids is None:
            return False
        swa_ids = swa._kvcached.take(swa_pages)
        if swa_ids is None:
            full._kvcached.give_back(full_ids)
            return False
        full._kvcached_pretaken = full_ids
        swa._kvcached_pretaken = swa_ids
        return True

    def _drop_pretaken(self) -> None:
        """Give back pages taken for an allocation the stock method did not make."""
        for side in (self.full_attn_allocator, self.swa_attn_allocator):
            ids, side._kvcached_pretaken = side._kvcached_pretaken, None
            if ids:
                side._kvcached.give_back(ids)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Page size 1: the stock method's two allocations and mapping, on slots taken from
        both sides first (its own checks read the logical sizes, which the taking lowered)."""
        if need_size > self.kvcached_allocatable_size() or not self._take_both(need_size,
                                                                                need_size):
            return None
        try:
            full = self.full_attn_allocator.alloc(need_size)
            swa = self.swa_attn_allocator.alloc(need_size)
            self.set_full_to_swa_mapping(full, swa)  # type: ignore[attr-defined]
            return full
        finally:
            self._drop_pretaken()

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                     seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor, extend_num_tokens: int) -> torch.Tensor | None:
        pages = _pages_for(seq_lens_cpu, self.page_size, prefix_lens_cpu=prefix_lens_cpu)
        if not self.new_pages_available(pages, pages) or not self._take_both(pages, pages):
            return None
        try:
            return super().alloc_extend(  # type: ignore[misc]
                prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                extend_num_tokens)
        finally:
            self._drop_pretaken()

    def alloc_extend_swa_tail(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                              seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                              last_loc: torch.Tensor, extend_num_tokens: int,
                              swa_tail_len: int) -> torch.Tensor | None:
        full_pages = _pages_for(seq_lens_cpu, self.page_size, prefix_lens_cpu=prefix_lens_cpu)
        swa_pages = -(-swa_tail_len // self.page_size)
        if (not self.new_pages_available(full_pages, swa_pages)
                or not self._take_both(full_pages, swa_pages)):
            return None
        try:
            return super().alloc_extend_swa_tail(  # type: ignore[misc]
                prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                extend_num_tokens, swa_tail_len)
        finally:
            self._drop_pretaken()

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        pages = _pages_for(seq_lens_cpu, self.page_size, decode=True)
        if not self.new_pages_available(pages, pages) or not self._take_both(pages, pages):
            return None
        try:
            return super().alloc_decode(  # type: ignore[misc]
                seq_lens, seq_lens_cpu, last_loc)
        finally:
            self._drop_pretaken()


class RefusePureSWAAllocatorMixin:
    """PureSWATokenToKVPoolAllocator (every layer sliding-window): its capacity gates are the
    stock composite's, so it is refused with elastic KV memory rather than run half-elastic
    (when it is built: its constructor never calls its own `clear`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise KVCachedConfigError(
            "kvcached: a model whose every layer uses a sliding window (SGLang's pure SWA "
            "allocator) is not supported with KVCACHED_ENABLE=1; set KVCACHED_ENABLE=0 for "
            "this model")
