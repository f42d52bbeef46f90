"""The patched token and paged allocators: SGLang's allocator contract, on kvcached memory."""

from __future__ import annotations

import subprocess
import sys
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import HEADS, LAYERS, TOKENS_PER_PAGE, mapped_pages

from kvcached_core.errors import KVCachedConfigError, StateConsistencyError


def test_the_public_names_are_the_elastic_classes() -> None:
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
        swa,
    )

    assert TokenToKVPoolAllocator.__name__ == "ElasticTokenToKVPoolAllocator"
    assert PagedTokenToKVPoolAllocator.__name__ == "ElasticPagedTokenToKVPoolAllocator"
    # Modules that captured the names at import see the elastic classes too.
    assert kv_cache_configurator.TokenToKVPoolAllocator is TokenToKVPoolAllocator
    assert kv_cache_configurator.PagedTokenToKVPoolAllocator is PagedTokenToKVPoolAllocator
    assert swa.TokenToKVPoolAllocator is TokenToKVPoolAllocator


def test_token_alloc_free_and_available(token_setup) -> None:
    _, allocator = token_setup
    assert allocator.available_size() == 1023
    first = allocator.alloc(10)
    assert first.dtype == torch.int64 and first.device.type == "cpu"
    assert len(set(first.tolist())) == 10 and 0 not in first.tolist()
    assert allocator.available_size() == 1013
    second = allocator.alloc(5)
    assert not set(first.tolist()) & set(second.tolist())
    allocator.free(first)
    assert allocator.available_size() == 1018
    allocator.free(torch.empty((0,), dtype=torch.int64))
    assert allocator.alloc(1019) is None  # more than is free: refused, nothing changed
    assert allocator.available_size() == 1018
    everything = allocator.alloc(1018)
    assert everything is not None and allocator.available_size() == 0
    assert max(everything.tolist()) <= 1023  # only SGLang's slots 1..size
    assert allocator.alloc(1) is None


def test_token_free_group_defers_until_the_end(token_setup) -> None:
    _, allocator = token_setup
    slots = allocator.alloc(8)
    allocator.free_group_begin()
    allocator.free(slots[:4])
    allocator.free(slots[4:])
    assert allocator.available_size() == 1023 - 8  # held until the group ends
    allocator.free_group_end()
    assert allocator.available_size() == 1023


def test_token_clear_and_double_free(token_setup) -> None:
    pool, allocator = token_setup
    slots = allocator.alloc(100)
    allocator.clear()
    assert allocator.available_size() == 1023
    slots = allocator.alloc(3)
    allocator.free(slots)
    with pytest.raises(StateConsistencyError):
        allocator.free(slots)  # a double free is a fault, never silent corruption


def test_token_memory_follows_allocation(token_setup) -> None:
    pool, allocator = token_setup
    pool.kvcached_pool.trim()  # drop the warm reserve: count only what blocks hold
    idle = mapped_pages(pool)
    assert idle == 1  # the padding page
    slots = allocator.alloc(4 * TOKENS_PER_PAGE)
    assert mapped_pages(pool) >= idle + 4
    allocator.free(slots)
    pool.kvcached_pool.trim()
    assert mapped_pages(pool) == idle


def test_paged_alloc_extend_and_decode(paged_setup) -> None:
    _, allocator = paged_setup
    ps = 4
    assert allocator.available_size() == 1020
    prefix = allocator.alloc(2 * ps)
    assert prefix.tolist()[:ps] == list(range(prefix[0].item(), prefix[0].item() + ps))
    # Two requests: one extends a 6-token prefix (last slot mid-page) by 5, one starts fresh.
    prefix_lens = torch.tensor([6, 0])
    seq_lens = torch.tensor([11, 3])
    last_loc = torch.tensor([prefix[5].item(), -1])
    out = allocator.alloc_extend(prefix_lens, prefix_lens, seq_lens, seq_lens, last_loc, 8)
    assert out is not None and out.shape == (8,)
    first = out[:5].tolist()
    assert first[:2] == [prefix[6].item(), prefix[7].item()]  # fills the prefix's page
    assert first[2] % ps == 0 and first[3:] == [first[2] + 1, first[2] + 2]
    assert out[5].item() % ps == 0 and out[6:].tolist() == [out[5].item() + 1,
                                                            out[5].item() + 2]
    assert allocator.available_size() == 1020 - 4 * ps
    # Decode: request 0 is at 11 tokens (next slot inside its page), request 1 at 4 (page full).
    seq = torch.tensor([12, 5])
    dec = allocator.alloc_decode(seq, seq, torch.tensor([first[-1], out[-1].item()]))
    assert dec[0].item() == first[-1] + 1 and dec[1].item() % ps == 0
    assert allocator.available_size() == 1020 - 5 * ps


def test_paged_free_segment_page_ids_and_groups(paged_setup) -> None:
    _, allocator = paged_setup
    ps = 4
    run = allocator.alloc(3 * ps)
    allocator.free_segment(run[: 2 * ps], start_pos=0)
    assert allocator.available_size() == 1020 - ps
    allocator.free_group_begin()
    allocator.free_page_ids(run[2 * ps:: ps] // ps)
    assert allocator.available_size() == 1020 - ps
    allocator.free_group_end()
    assert allocator.available_size() == 1020
    again = allocator.alloc(2 * ps)
    allocator.free(again[1:3])  # any slot of a page frees the whole page
    assert allocator.available_size() == 1020 - ps


def test_an_allocator_over_a_stock_pool_is_refused() -> None:
    from unittest.mock import MagicMock

    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    with pytest.raises(KVCachedConfigError, match="needs an elastic KV pool"):
        TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", MagicMock(), False)


# ---------------------------------------------------------------- a physical limit at run time
# The paged pool: 1020 slots, 4 a page, 16 SGLang pages a 4K kvcached page (2 layers, K and V);
# SGLang page 0 is the padding page. A limit of one kvcached page leaves 15 pages: 60 slots.

LIMITED_SLOTS = 15 * 4


@pytest.fixture
def scheduler_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The runtime configuration SGLang's scheduler publishes before it admits anything
    (server arguments for a tiny local model config; nothing is loaded or downloaded)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=HEADS,
                max_position_embeddings=512,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    server_args = ServerArgs(model_path=str(tmp_path), device="cpu", skip_tokenizer_init=True)
    context = runtime_context.create_context(server_args, role="scheduler")
    with runtime_context.use_context(context):
        yield


def paged_tree(allocator: object) -> object:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                      token_to_kv_pool_allocator=allocator, page_size=4))


def admit(allocator: object, tree: object, prompt_tokens: int) -> object:
    """SGLang's admission of one waiting request, as the scheduler's prefill pass runs it."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.sampling.sampling_params import SamplingParams

    request = Req(f"r{prompt_tokens}", "", array("q", range(1, prompt_tokens + 1)),
                  SamplingParams(max_new_tokens=16))
    request.init_next_round_input(tree)
    adder = PrefillAdder(4, tree, allocator, None, 0.5, 4096, None)
    return adder.add_one_req(request, has_chunked_req=False, truncation_align_size=None)


def kvctl_limit(pool_name: str, size: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvcached_core.kvctl", "limit", pool_name, size],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def wait_for_allocatable(allocator: object, slots: int) -> None:
    deadline = time.monotonic() + 5  # the pool's watcher polls its record every 0.1 s
    while allocator.kvcached_allocatable_size() != slots:
        assert time.monotonic() < deadline, allocator.kvcached_allocatable_size()
        time.sleep(0.02)


def test_a_limit_lowered_with_kvctl_makes_admission_wait_and_a_raised_one_admits(
        paged_setup, scheduler_context) -> None:
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.managers.scheduler_components.invariant_checker import (
        SchedulerInvariantChecker,
    )

    pool, allocator = paged_setup
    tree = paged_tree(allocator)
    kv = pool.kvcached_pool
    assert allocator.kvcached_allocatable_size() == 1020
    assert admit(allocator, tree, 100) is AddReqResult.CONTINUE

    kvctl_limit(kv.name, str(kv.geometry.page_bytes_all_layers))
    wait_for_allocatable(allocator, LIMITED_SLOTS)
    mapped = mapped_pages(pool)
    # 100 prompt tokens + 16 new ones do not fit in 60 slots: SGLang's admission refuses
    # and the request waits; nothing was allocated, so nothing takes the out-of-memory path.
    assert admit(allocator, tree, 100) is AddReqResult.NO_TOKEN
    assert admit(allocator, tree, 36) is AddReqResult.CONTINUE
    assert allocator.alloc(100) is None  # what admitting it would have run into
    assert mapped_pages(pool) == mapped
    # The logical free capacity is unchanged, so SGLang's idle leak check still holds.
    assert allocator.available_size() == 1020
    leak, message = SchedulerInvariantChecker._check_pool_invariant(
        "full", allocator.available_size(), tree.evictable_size(), 0, 0, 1020)
    assert not leak, message

    # Raised again: the next admission sees it, though nothing was allocated in between.
    kvctl_limit(kv.name, "1G")
    wait_for_allocatable(allocator, 1020)
    assert admit(allocator, tree, 100) is AddReqResult.CONTINUE


def test_under_a_lowered_limit_the_decode_check_evicts_the_tree_then_asks_to_retract(
        paged_setup) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    pool, allocator = paged_setup
    tree = paged_tree(allocator)
    kv = pool.kvcached_pool
    cached = allocator.alloc(40)
    tree.insert(InsertParams(key=RadixKey(array("q", range(1, 41))), value=cached))
    assert tree.evictable_size() == 40
    kv.set_limit(kv.geometry.page_bytes_all_layers)
    assert allocator.kvcached_allocatable_size() == LIMITED_SLOTS - 40
    # The step needs 48 slots: the logical free space (980) would not evict, but under the
    # limit only 20 are allocatable, so the check evicts the cached prefix first.
    assert allocator.check_decode_capacity(num_tokens=48, tree_cache=tree)
    assert tree.evictable_size() == 0
    running = allocator.alloc(48)
    assert running is not None
    # Nothing is left to evict: the check fails and SGLang retracts requests instead of
    # allocating (which would fail).
    assert not allocator.check_decode_capacity(num_tokens=16, tree_cache=tree)
    assert allocator.alloc(16) is None
    allocator.free(running)
    assert allocator.check_decode_capacity(num_tokens=16, tree_cache=tree)
