"""Admission under a physical limit lowered at run time (`kvctl limit`): SGLang's prefill
admission takes its budget from the allocator (`create_prefill_budget`), so a request that does
not fit under the limit waits instead of taking the out-of-memory path.

The scheduler's runtime context is published with `runtime_context.create_context` (SGLang
0.5.22 and later); a cell lists this file in its proof.l1_tests only then.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    HEADS,
    LAYERS,
    LIMITED_SLOTS,
    make_mha_pool,
    make_paged_allocator,
    mapped_pages,
    paged_tree,
)


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


def test_a_budget_a_neighbour_spent_makes_admission_wait_and_admits_once_it_is_back(
        scheduler_context, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget shared with another engine: the neighbour's pages leave SGLang's pool only
    the free slots of the page it has mapped, so a request that needs more waits instead of
    being admitted and then refused its pages (SGLang's out-of-memory stop)."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from kvcached_core.budget import delete_budget, set_budget
    from kvcached_core.errors import PoolExhausted
    from kvcached_core.integration.sglang import allocators as elastic
    from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec

    page_all = 4096 * LAYERS * 2  # one kvcached page of the SGLang pool: 2 layers, K and V
    set_budget("admission", 8 * page_all)
    monkeypatch.setenv("KVCACHED_BUDGET", "admission")
    pool = make_mha_pool(1020, page_size=4)
    allocator = make_paged_allocator(1020, 4, pool)
    tree = paged_tree(allocator)
    neighbour = KVPool.create(
        "admission-neighbour",
        PoolSpec(num_layers=LAYERS, num_kv_buffers=2, block_bytes=4096, page_size=4096,
                 virtual_bytes_per_layer=2 * 16 * 4096),
        PoolPolicy(min_reserve_pages=0, max_reserve_pages=0, budget="admission"),
        export_metrics=False)
    try:
        held: list[int] = []
        while True:  # the neighbour takes every page the budget still pays for
            try:
                held += neighbour.alloc(1)
            except PoolExhausted:
                break
        assert held
        # Left to SGLang: the 15 free pages of the kvcached page holding its padding page.
        assert allocator.kvcached_allocatable_size() == LIMITED_SLOTS
        mapped = mapped_pages(pool)
        assert admit(allocator, tree, 100) is AddReqResult.NO_TOKEN
        assert admit(allocator, tree, 36) is AddReqResult.CONTINUE
        # Had it been admitted, its allocation would wait for the neighbour's pages (the
        # neighbour may have taken them in the same step), and fail once the wait ran out.
        monkeypatch.setattr(elastic, "BUDGET_WAIT_S", 0.2)
        assert allocator.alloc(100) is None
        assert mapped_pages(pool) == mapped
        monkeypatch.setattr(elastic, "BUDGET_WAIT_S", 10.0)
        freeing = threading.Timer(0.3, neighbour.free, args=(held,))
        freeing.start()  # no reserve: its pages, and their charge, go at once
        started = time.monotonic()
        got = allocator.alloc(100)
        assert got is not None and len(got) == 100 and time.monotonic() - started >= 0.25
        freeing.join()
        allocator.free(got)
        # The budget's 8 pages less SGLang's padding page and the neighbour's null block page:
        # 6 pages of 16 SGLang pages of 4 slots, beside the 15 free pages of the mapped one.
        assert allocator.kvcached_allocatable_size() == LIMITED_SLOTS + 6 * 16 * 4
        assert admit(allocator, tree, 100) is AddReqResult.CONTINUE
    finally:
        neighbour.close()
        pool.kvcached_pool.close()
        delete_budget("admission", force=True)
