"""The hybrid sliding-window allocator at a page size above 1 (SGLang's GPU backends page their
KV): extend and decode through SGLang's own location kernels on both sides.

On this CPU host those kernels run only where the release has a torch path besides its Triton
one (SGLang 0.5.22 and later), as for tests/sglang/inside/test_paged_kernels.py: a cell lists
this file in its proof.l1_tests only then.
"""

from __future__ import annotations

import inspect

import torch
from conftest import DIM, HEADS, SWA_ALLOCATOR_MODULES, releases_module

SWA = releases_module(SWA_ALLOCATOR_MODULES)


def test_paged_extend_and_decode_take_both_sides_pages_or_neither() -> None:
    """Page size 4 (SGLang's GPU backends page their KV): extend and decode place each side's
    tokens in pages taken from both ledgers first, joined by the mapping; under a window-side
    limit an extend that does not fit there leaves the full side as it was."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    ps, full_size, window_size = 4, 1020, 508
    pool = SWAKVPool(size=full_size, size_swa=window_size, page_size=ps, dtype=torch.bfloat16,
                     head_num=HEADS, head_dim=DIM, swa_attention_layer_ids=[0],
                     full_attention_layer_ids=[1], device="cpu", enable_memory_saver=False)
    cls = SWA.SWATokenToKVPoolAllocator
    kwargs = {"need_sort": False}
    if "req_to_token_pool" in inspect.signature(cls.__init__).parameters:
        kwargs["req_to_token_pool"] = None
    allocator = cls(full_size, window_size, ps, torch.bfloat16, "cpu", pool, **kwargs)
    full, window = allocator.full_attn_allocator, allocator.swa_attn_allocator
    # Two new requests of 5 and 3 tokens: 2 + 1 pages on each side.
    prefix_lens, seq_lens = torch.tensor([0, 0]), torch.tensor([5, 3])
    out = allocator.alloc_extend(prefix_lens, prefix_lens, seq_lens, seq_lens,
                                 torch.tensor([-1, -1]), 8)
    assert out is not None and out.shape == (8,)
    peers = allocator.full_to_swa_index_mapping[out]
    assert bool((peers > 0).all()) and len(set(peers.tolist())) == 8
    assert (full.available_size(), window.available_size()) == (full_size - 3 * ps,
                                                                window_size - 3 * ps)
    # Decode: request 0 goes on inside its second page, request 1 opens a page on each side.
    seq = torch.tensor([6, 4])
    dec = allocator.alloc_decode(seq, seq, torch.tensor([out[4].item(), out[7].item()]))
    assert dec is not None and dec[0].item() == out[4].item() + 1
    assert (full.available_size(), window.available_size()) == (full_size - 3 * ps,
                                                                window_size - 3 * ps)
    # A window side limited to the pages it holds: a request needing a new page is refused
    # on both sides, and the full side keeps what it had.
    kv = window.kvcached_pool
    kv.set_limit(kv.geometry.page_bytes_all_layers)
    taken = window_size // ps - window.available_size() // ps
    allowed = window.kvcached_allocatable_size() // ps
    before = (full.available_size(), full.kvcached_pool.mapped_pages)
    need = (allowed + 1) * ps
    lens = torch.tensor([need])
    assert allocator.alloc_extend(torch.tensor([0]), torch.tensor([0]), lens, lens,
                                  torch.tensor([-1]), need) is None
    assert (full.available_size(), full.kvcached_pool.mapped_pages) == before
    assert window.available_size() // ps == window_size // ps - taken
