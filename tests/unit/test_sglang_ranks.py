"""The ranks of a tensor-parallel SGLang engine take the same decisions from their elastic
pools (`kvcached_core/integration/sglang/ranks.py`).

Two real processes, each a rank with its own host-backed KV pool and ledger, talk over a gloo
process group on 127.0.0.1 as SGLang's TP CPU group does. Every gate reads the agreed figure,
so a limit lowered on one rank's pool binds both, and an allocation one rank cannot map is
refused on both with nothing left held.
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import time
import types
from typing import Any

import pytest

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.sglang import ranks
from kvcached_core.router.engines import free_port
from tests.unit.pool_factory import create_pool

PAGE = 4096
TOKEN_BYTES = 64  # one slot per ledger block: 64 blocks a page per layer and buffer
PAGE_BYTES_ALL_LAYERS = PAGE * 2 * 2  # 2 layers x K and V
SLOTS = 1023


def _rank(rank: int, port: int, shm_dir: str, results: Any) -> None:
    import torch.distributed as dist

    from kvcached_core.integration.sglang.allocators import _ElasticLedger
    from kvcached_core.integration.sglang.ranks import RankAgreement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    pool = create_pool(
        f"sglang-ranks-test-{rank}", num_layers=2, num_kv_buffers=2, block_bytes=TOKEN_BYTES,
        virtual_bytes_per_layer=2 * -(-(SLOTS + 64) * TOKEN_BYTES // PAGE) * PAGE,
        page_size=PAGE, min_reserve_pages=0, max_reserve_pages=0, prealloc=False,
        share_limits=False, export_metrics=False, set_aside_null_block=True, shm_dir=shm_dir)
    ledger = _ElasticLedger(pool, SLOTS, RankAgreement(dist.group.WORLD, 2))
    seen: dict[str, Any] = {"rank": rank}
    try:
        seen["free"] = ledger.allocatable_pages()
        if rank == 1:  # as `kvctl limit` on this rank's pool alone: three pages
            pool.set_limit(3 * PAGE_BYTES_ALL_LAYERS)
        seen["limited"] = ledger.allocatable_pages()
        first = ledger.take(seen["limited"])
        seen["took"] = None if first is None else len(first)
        seen["held_after_take"] = ledger.held
        seen["over"] = ledger.take(1)  # rank 0 could map it, rank 1 cannot
        seen["held_after_refusal"] = ledger.held
        seen["blocks_in_use_after_refusal"] = pool.snapshot().num_used_blocks
        if rank == 1:
            pool.set_limit(8 * PAGE_BYTES_ALL_LAYERS)
        again = ledger.take(1)
        seen["after_raise"] = None if again is None else len(again)
        dist.barrier()
    finally:
        pool.close()
        dist.destroy_process_group()
    results.put(seen)


def test_ranks_agree_on_what_fits_and_refuse_together(tmp_path: Any) -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(rank, port, str(tmp_path), results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    seen: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 120
    while len(seen) < len(processes):
        try:
            got = results.get(timeout=0.5)
            seen[got["rank"]] = got
        except queue.Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            assert not failed and time.monotonic() < deadline, f"ranks ended {failed}"
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    zero, one = seen[0], seen[1]
    assert zero["free"] == one["free"] == SLOTS
    # Rank 1's three pages (192 blocks, less its null block) bind rank 0 too.
    assert zero["limited"] == one["limited"] == 3 * 64 - 1
    assert zero["took"] == one["took"] == 3 * 64 - 1
    assert zero["over"] is None and one["over"] is None
    assert zero["held_after_refusal"] == one["held_after_refusal"] == 3 * 64 - 1
    assert zero["blocks_in_use_after_refusal"] == one["blocks_in_use_after_refusal"]
    assert zero["after_raise"] == one["after_raise"] == 1


class _Group:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.cpu_group = object()


def _release(monkeypatch: pytest.MonkeyPatch, *, tp: int, pp: int = 1,
             dp_attention: bool | None = False, context: int | None = None) -> None:
    """Stand-ins for the two SGLang modules the agreement reads, shaped as in the releases:
    `is_dp_attention_enabled` from 0.5.5 (None: 0.4.10's `get_attention_dp_size`) and
    `get_attn_cp_group` from 0.5.16 (None: absent)."""
    state = types.ModuleType("sglang.srt.distributed.parallel_state")
    state.get_tp_group = lambda: _Group(tp)  # type: ignore[attr-defined]
    state.get_pp_group = lambda: _Group(pp)  # type: ignore[attr-defined]
    if context is not None:
        state.get_attn_cp_group = lambda: _Group(context)  # type: ignore[attr-defined]
    attention = types.ModuleType("sglang.srt.layers.dp_attention")
    if dp_attention is None:
        attention.get_attention_dp_size = lambda: 1  # type: ignore[attr-defined]
    else:
        attention.is_dp_attention_enabled = lambda: dp_attention  # type: ignore[attr-defined]
    distributed = types.ModuleType("sglang.srt.distributed")
    distributed.parallel_state = state  # type: ignore[attr-defined]
    layers = types.ModuleType("sglang.srt.layers")
    layers.dp_attention = attention  # type: ignore[attr-defined]
    for name, module in {"sglang": types.ModuleType("sglang"),
                         "sglang.srt": types.ModuleType("sglang.srt"),
                         "sglang.srt.distributed": distributed,
                         "sglang.srt.distributed.parallel_state": state,
                         "sglang.srt.layers": layers,
                         "sglang.srt.layers.dp_attention": attention}.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_one_tensor_parallel_group_gets_an_agreement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranks, "distributed_world_size", lambda: 4)
    _release(monkeypatch, tp=4)
    agreement = ranks.engine_rank_agreement()
    assert agreement is not None and agreement.ranks == 4
    _release(monkeypatch, tp=4, dp_attention=None, context=1)
    assert ranks.engine_rank_agreement() is not None


def test_an_engine_of_one_rank_needs_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranks, "distributed_world_size", lambda: 1)
    assert ranks.engine_rank_agreement() is None


@pytest.mark.parametrize(("shape", "named"), [
    (dict(tp=2, pp=2), "pipeline parallelism"),
    (dict(tp=2), "ranks outside tensor parallelism"),
    (dict(tp=4, dp_attention=True), "data-parallel attention"),
    (dict(tp=4, context=2), "attention context parallelism"),
])
def test_ranks_that_schedule_different_batches_are_refused_in_one_line(
        monkeypatch: pytest.MonkeyPatch, shape: dict[str, Any], named: str) -> None:
    monkeypatch.setattr(ranks, "distributed_world_size", lambda: 4)
    _release(monkeypatch, **shape)
    with pytest.raises(KVCachedConfigError) as refused:
        ranks.engine_rank_agreement()
    message = str(refused.value)
    assert f"over 4 ranks only as one tensor-parallel group, not with {named}" in message
    assert "KVCACHED_ENABLE=0" in message and "\n" not in message
