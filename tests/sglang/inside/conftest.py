"""Fixtures of the tests that run inside the patched SGLang venv (KVCACHED_ENABLE=1).

Sizes follow the tiny model of the end-to-end test: 2 layers, 2 KV heads of dim 16, bf16,
so one token is 64 bytes per layer per buffer, and KVCACHED_PAGE_SIZE=4K holds 64 tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("KVCACHED_ENABLE") == "1", "run by tests/sglang/test_l1_contract.py"

LAYERS, HEADS, DIM = 2, 2, 16
TOKENS_PER_PAGE = 4096 // (HEADS * DIM * 2)


def make_mha_pool(size: int, page_size: int = 1, cls: type | None = None) -> object:
    """An MHA pool (the elastic class unless ``cls`` names another)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return (cls or MHATokenToKVPool)(
        size=size, page_size=page_size, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False)


def make_mla_pool(size: int, page_size: int = 1, cls: type | None = None) -> object:
    """An MLA pool (the elastic class unless ``cls`` names another)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return (cls or MLATokenToKVPool)(
        size=size, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=16,
        qk_rope_head_dim=16, layer_num=LAYERS, device="cpu", enable_memory_saver=False)


@pytest.fixture
def token_setup() -> tuple[object, object]:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    pool = make_mha_pool(1023)
    allocator = TokenToKVPoolAllocator(1023, torch.bfloat16, "cpu", pool, False)
    return pool, allocator


@pytest.fixture
def paged_setup() -> tuple[object, object]:
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    pool = make_mha_pool(1020, page_size=4)
    allocator = PagedTokenToKVPoolAllocator(1020, 4, torch.bfloat16, "cpu", pool, False)
    return pool, allocator


def mapped_pages(pool: object) -> int:
    return pool.kvcached_pool.mapped_pages


# ---------------------------------------------------------------- a physical limit at run time
# The paged pool: 1020 slots, 4 a page, 16 SGLang pages a 4K kvcached page (2 layers, K and V);
# SGLang page 0 is the padding page. A limit of one kvcached page leaves 15 pages: 60 slots.

LIMITED_SLOTS = 15 * 4


def paged_tree(allocator: object) -> object:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                      token_to_kv_pool_allocator=allocator, page_size=4))
