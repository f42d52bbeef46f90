"""The paged allocators' extend and decode of the releases before 0.5.12, over a real (host) KV
pool: how many new pages a batch needs is counted before the stock method runs, and exactly that
many ledger pages are what the stock method finds on its free list.

The stand-ins copy what the released methods do with the free list, in plain torch instead of
their Triton kernels: each request takes its new pages from the front of ``free_pages`` in
batch order, the count is checked against the list, and the list is cut by it. 0.5.3 - 0.5.11
count from the CPU copies of the lengths (``alloc_extend(prefix_lens, prefix_lens_cpu,
seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)``); up to 0.5.2 the kernel counts from the
device lengths alone (``alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens)``).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvcached_core.integration.sglang.allocators import (
    ElasticPagedAllocatorCountsItsPagesMixin,
    ElasticPagedAllocatorDeviceLengthsMixin,
)
from tests.unit.test_sglang_free_group_flag_allocators import PAGE_SIZE, Paged0516, paged_kv_cache


def _pages(lengths: torch.Tensor) -> torch.Tensor:
    return (lengths + PAGE_SIZE - 1) // PAGE_SIZE


def _place(free_pages: torch.Tensor, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
           last_loc: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The extend kernel's placement: a request's tokens continue its last page, then fill new
    pages taken from the free list in batch order. Returns the slots and the pages taken."""
    out, taken = [], 0
    for prefix, seq, last in zip(prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist(),
                                 strict=True):
        for position in range(prefix, seq):
            if position % PAGE_SIZE == 0:
                page = int(free_pages[taken])
                taken += 1
                last = page * PAGE_SIZE - 1
            last += 1
            out.append(last)
    return torch.tensor(out, dtype=torch.int64), taken


class CpuLengths0510(Paged0516):
    """0.5.10's PagedTokenToKVPoolAllocator: extend and decode with CPU lengths, no count."""

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                     seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor, extend_num_tokens: int) -> torch.Tensor | None:
        assert self.free_pages is not None
        out, _ = _place(self.free_pages, prefix_lens, seq_lens, last_loc)
        num_new_pages = int((_pages(seq_lens_cpu) - _pages(prefix_lens_cpu)).sum())
        if num_new_pages > len(self.free_pages):
            return None
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        # Its own extend with the decode token as the extension (not an override of it).
        return CpuLengths0510.alloc_extend(self, seq_lens - 1, seq_lens_cpu - 1, seq_lens,
                                           seq_lens_cpu, last_loc, len(seq_lens))


class DeviceLengths051(Paged0516):
    """0.5.1's PagedTokenToKVPoolAllocator: the kernel counts the new pages itself."""

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                     last_loc: torch.Tensor, extend_num_tokens: int) -> torch.Tensor | None:
        assert self.free_pages is not None
        out, num_new_pages = _place(self.free_pages, prefix_lens, seq_lens, last_loc)
        if num_new_pages > len(self.free_pages):
            return None
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor
                     ) -> torch.Tensor | None:
        return DeviceLengths051.alloc_extend(self, seq_lens - 1, seq_lens, last_loc,
                                             len(seq_lens))


class ElasticCpuLengths(ElasticPagedAllocatorCountsItsPagesMixin, CpuLengths0510):
    _kvcached_elastic_leaf = True


class ElasticDeviceLengths(ElasticPagedAllocatorDeviceLengthsMixin, DeviceLengths051):
    _kvcached_elastic_leaf = True


def _extend_then_decode(allocator: object, *, cpu_lengths: bool) -> None:
    pool = allocator._kvcache.kvcached_pool  # type: ignore[attr-defined]
    prefix = torch.tensor([0, 0, 0])
    seq = torch.tensor([5, 8, 1])  # 2 + 2 + 1 new SGLang pages
    last = torch.tensor([-1, -1, -1])
    args = (prefix, prefix, seq, seq, last, 14) if cpu_lengths else (prefix, seq, last, 14)
    out = allocator.alloc_extend(*args)  # type: ignore[attr-defined]
    assert out is not None and len(out) == 14
    pages = sorted({int(slot) // PAGE_SIZE for slot in out})
    assert len(pages) == 5 and 0 not in pages  # five pages, none of them the padding page
    assert allocator.available_size() == 1020 - 5 * PAGE_SIZE  # type: ignore[attr-defined]
    assert allocator.free_pages.numel() == 0  # type: ignore[attr-defined]  # all 5 used

    # Decode: request 0 continues page 2 (no page), request 1 opens a page, request 2 continues.
    seq = torch.tensor([6, 9, 2])
    last = torch.tensor([int(out[4]), int(out[12]), int(out[13])])
    args = (seq, seq, last) if cpu_lengths else (seq, last)
    step = allocator.alloc_decode(*args)  # type: ignore[attr-defined]
    assert step is not None
    assert int(step[0]) == int(out[4]) + 1 and int(step[2]) == int(out[13]) + 1
    assert int(step[1]) // PAGE_SIZE not in pages  # the one new page
    assert allocator.available_size() == 1020 - 6 * PAGE_SIZE  # type: ignore[attr-defined]

    allocator.free(torch.cat([out, step]))  # type: ignore[attr-defined]
    assert allocator.available_size() == 1020  # type: ignore[attr-defined]
    pool.trim()


def get_num_new_pages(seq_lens: torch.Tensor, page_size: int,
                      prefix_lens: torch.Tensor | None = None, decode: bool = False) -> int:
    """0.5.10's `sglang.srt.utils.get_num_new_pages`, which the mixin of those releases calls."""
    if prefix_lens is None or decode:
        return int((seq_lens % page_size == 1).int().sum().item())
    return int(torch.sum(_pages(seq_lens) - _pages(prefix_lens)).item())


def test_cpu_length_extend_stages_exactly_the_pages_the_stock_method_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    utils = types.ModuleType("sglang.srt.utils")
    utils.get_num_new_pages = get_num_new_pages  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)
    allocator = ElasticCpuLengths(1020, PAGE_SIZE, torch.bfloat16, "cpu", paged_kv_cache(1020),
                                  False)
    _extend_then_decode(allocator, cpu_lengths=True)


def test_device_length_extend_stages_exactly_the_pages_its_kernel_counts() -> None:
    allocator = ElasticDeviceLengths(1020, PAGE_SIZE, torch.bfloat16, "cpu",
                                     paged_kv_cache(1020), False)
    _extend_then_decode(allocator, cpu_lengths=False)


def test_an_extend_the_ledger_cannot_back_is_refused_before_the_stock_method_runs() -> None:
    allocator = ElasticDeviceLengths(16, PAGE_SIZE, torch.bfloat16, "cpu", paged_kv_cache(16),
                                     False)
    prefix, seq, last = torch.tensor([0]), torch.tensor([20]), torch.tensor([-1])
    assert allocator.alloc_extend(prefix, seq, last, 20) is None  # 5 pages of 4
    assert allocator.available_size() == 16  # nothing taken
