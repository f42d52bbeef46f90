"""Fixtures of the tests that run inside the patched SGLang venv (KVCACHED_ENABLE=1).

Sizes follow the tiny model of the end-to-end test: 2 layers, 2 KV heads of dim 16, bf16,
so one token is 64 bytes per layer per buffer, and KVCACHED_PAGE_SIZE=4K holds 64 tokens.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from types import ModuleType

import pytest
import torch

assert os.environ.get("KVCACHED_ENABLE") == "1", "run by tests/sglang/test_l1_contract.py"

LAYERS, HEADS, DIM = 2, 2, 16
TOKENS_PER_PAGE = 4096 // (HEADS * DIM * 2)

#: The module that builds the pools and allocators: the KV-cache configurator from 0.5.16,
#: the model runner's KV mixin from 0.5.7, the model runner itself before.
POOL_BUILDERS = ("sglang.srt.mem_cache.kv_cache_configurator",
                 "sglang.srt.model_executor.model_runner_kv_cache_mixin",
                 "sglang.srt.model_executor.model_runner")
#: The SWA allocator's module: in the allocator package from 0.5.13, in swa_memory_pool from
#: 0.5.8, beside the other allocators (mem_cache/allocator.py) before.
SWA_ALLOCATOR_MODULES = ("sglang.srt.mem_cache.allocator.swa",
                         "sglang.srt.mem_cache.swa_memory_pool",
                         "sglang.srt.mem_cache.allocator")


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a plain module, not a package
        return False


def releases_module(candidates: tuple[str, ...]) -> ModuleType:
    """The first of ``candidates`` (where a role's module lived, newest first) that the
    release has."""
    return importlib.import_module(next(name for name in candidates if _has_module(name)))


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


def allocators_sort() -> bool:
    """Whether the release's allocators take ``need_sort`` (from 0.5.1)."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    return "need_sort" in inspect.signature(TokenToKVPoolAllocator.__init__).parameters


def make_token_allocator(size: int, kvcache: object, need_sort: bool = False) -> object:
    """The release's token allocator over ``kvcache`` (``need_sort`` where it has one)."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    sort = (need_sort,) if allocators_sort() else ()
    return TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", kvcache, *sort)


def make_paged_allocator(size: int, page_size: int, kvcache: object,
                         need_sort: bool = False) -> object:
    """The release's paged allocator over ``kvcache`` (``need_sort`` where it has one)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    sort = (need_sort,) if allocators_sort() else ()
    return PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cpu", kvcache, *sort)


@pytest.fixture
def token_setup() -> tuple[object, object]:
    pool = make_mha_pool(1023)
    return pool, make_token_allocator(1023, pool)


@pytest.fixture
def paged_setup() -> tuple[object, object]:
    pool = make_mha_pool(1020, page_size=4)
    return pool, make_paged_allocator(1020, 4, pool)


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
