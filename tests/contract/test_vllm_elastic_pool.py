"""The elastic block pool on real vLLM BlockPool classes (patched sdist tree, contract venv)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from forge.matrix import Cell
from tests.contract.vllm_contract import ROOT, contract_venv, unpacked_sdist
from tests.proof_cells import proof_of

pytestmark = pytest.mark.slow

# BlockPool(num_blocks, <proof.block_pool_args>) of the cell's release: matrix.toml.

SCRIPT = """
import kvcached_core.integration.vllm as adapter
from kvcached_core.errors import PoolExhausted
from kvcached_core.integration.vllm import pools
from kvcached_core.integration.vllm.config import pool_name
from kvcached_core.layout import BlockTiling
from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec
from vllm.v1.core.block_pool import BlockPool

# 32 vLLM blocks of 1 KiB, 4 to a 4 KiB page, at most 3 pages physically.
pool = KVPool.create(pool_name(), PoolSpec(1, 1, 4096, 8 * 4096, 4096),
                     PoolPolicy(min_reserve_pages=0, max_reserve_pages=0, prealloc=False,
                                physical_limit_bytes=3 * 4096, defer_physical_release=True),
                     share_limits=False, export_metrics=False)
pools.register(pools.EnginePool(pool_name(), pool, BlockTiling(1024, 4096), 32))
bp = adapter.make_block_pool(BlockPool, 32, {args})
assert type(bp).__name__ == "ElasticBlockPool" and isinstance(bp, BlockPool)
assert bp.get_num_free_blocks() == 3 + 2 * 4, bp.get_num_free_blocks()
blocks = bp.get_new_blocks(5)
ids = [b.block_id for b in blocks]
assert ids[:3] == [1, 2, 3] and len({{i // 4 for i in ids}}) == 2, ids
assert pool.snapshot().in_use_pages == 2, pool.snapshot()
assert bp.get_num_free_blocks() == 2 + 4, bp.get_num_free_blocks()
# A competitor takes the last page between check and allocation: clean refusal.
pool.set_limit(2 * 4096)
try:
    bp.get_new_blocks(4)
except PoolExhausted:
    pass
else:
    raise AssertionError("allocation beyond the physical limit succeeded")
assert bp.free_block_queue.num_free_blocks == 32 - 1 - 5
pool.set_limit(3 * 4096)
bp.free_blocks(blocks)
released = bp.release_idle_pages(16)
assert released == 1, released
marker = pool.capture_release_marker()
pool.release_retired_through(marker)
assert pool.snapshot().in_use_pages == 1, pool.snapshot()
assert bp.get_num_free_blocks() == 3 + 2 * 4
# Freed blocks go back to the head of vLLM's queue from 0.23 on (LIFO), those of the page just
# given back included: a new allocation must still get only blocks of backed pages.
again = bp.get_new_blocks(6)
backed = {{offset // 4096 for offset in pool.tensors[0].mapped_offsets()}}
assert {{b.block_id // 4 for b in again}} <= backed, ([b.block_id for b in again], backed)
assert len({{b.block_id for b in again}}) == 6
bp.free_blocks(again)
assert bp.release_idle_pages(16) == 1
# A prefix-cache reset between steps (the router putting an idle engine to sleep) gives the
# freed blocks' pages back at once, since an idle engine takes no step whose end would; but
# only once the engine says no batch in flight can still read them.
held = bp.get_new_blocks(6)
bp.free_blocks(held)
in_use = pool.snapshot().in_use_pages
assert in_use >= 2, pool.snapshot()
bp._kv_is_drained = lambda: False
assert bp.reset_prefix_cache()
assert pool.snapshot().in_use_pages == in_use, pool.snapshot()
bp._kv_is_drained = lambda: True
assert bp.reset_prefix_cache()
assert pool.snapshot().in_use_pages == 1, pool.snapshot()  # the null block's page
pools.close(pool_name())
print("OK")
"""


PARKING_SCRIPT = """
import kvcached_core.integration.vllm as adapter
from kvcached_core.integration.vllm import pools
from kvcached_core.integration.vllm.config import pool_name
from kvcached_core.layout import BlockTiling
from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core import kv_cache_utils

# 256 vLLM blocks, 4 to a page: 64 pages, none backed but the null block's.
pool = KVPool.create(pool_name(), PoolSpec(1, 1, 4096, 64 * 4096, 4096),
                     PoolPolicy(min_reserve_pages=0, max_reserve_pages=0, prealloc=False,
                                defer_physical_release=True),
                     share_limits=False, export_metrics=False)
pools.register(pools.EnginePool(pool_name(), pool, BlockTiling(1024, 4096), 256))
bp = adapter.make_block_pool(BlockPool, 256, {args})
queue_type = type(bp.free_block_queue)
passed = [0]
popleft = queue_type.popleft
def counting_popleft(self):
    passed[0] += 1
    return popleft(self)
queue_type.popleft = counting_popleft

held = []
for _ in range(40):
    # Grow by a page, give the page back, again: the allocator hands out pages in its own
    # order, so the blocks it backs may lie anywhere in vLLM's free queue.
    blocks = bp.get_new_blocks(4)
    assert all(b.block_id // 4 in bp._kv_held for b in blocks)
    held.append(blocks[0])
    bp.free_blocks(blocks[1:])
    bp.release_idle_pages(16)
    marker = pool.capture_release_marker()
    pool.release_retired_through(marker)
# Every block is passed over at most once on its way to a backed page (parked meanwhile),
# not once per allocation: a few per cycle, far below 40 walks through the whole queue.
assert passed[0] <= 40 * 16 + 256, passed[0]
logical = bp.free_block_queue.num_free_blocks + bp._kv_parked_count
assert logical == 256 - 1 - len(held), (logical, len(held))
bp._kv_logical_view = True
assert bp.get_num_free_blocks() == logical
bp._kv_logical_view = False
# The first idle step end takes every block of a page not held out of vLLM's queue: the
# queue then holds exactly the free blocks of held pages, and nothing is lost.
before = bp.get_num_free_blocks()
bp._park_queued_unheld_blocks()
assert bp.free_block_queue.num_free_blocks == bp._held_free_blocks()
assert bp.free_block_queue.num_free_blocks + bp._kv_parked_count == logical
assert bp.get_num_free_blocks() == before
again = bp.get_new_blocks(3)
assert {{b.block_id // 4 for b in again}} <= bp._kv_held
bp.free_blocks(again)
bp.free_blocks(held)
assert bp.release_idle_pages(16) >= 1
assert bp.reset_prefix_cache()
pools.close(pool_name())
print("OK")
"""


@pytest.mark.parametrize("script", [SCRIPT, PARKING_SCRIPT], ids=["page-backing", "parking"])
def test_elastic_pool_backs_blocks_by_page(cell: Cell, script: str, tmp_path: Path) -> None:
    args = proof_of(cell).block_pool_args
    assert args is not None, f"{cell.name}: matrix.toml lacks proof.block_pool_args"
    python = contract_venv(cell)
    sdist = unpacked_sdist(cell, tmp_path)
    imports = tmp_path / "imports"
    imports.mkdir()
    (imports / "kvcached_core").symlink_to(ROOT / "kvcached_core")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "VLLM_"))}
    env["PYTHONPATH"] = f"{sdist}{os.pathsep}{imports}"
    source = script.format(args=args)
    done = subprocess.run([str(python), "-c", source],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
