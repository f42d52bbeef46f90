"""A lost page race inside vLLM's allocate_slots, on a real KVCacheManager (patched sdist tree).

Another engine takes the last mappable page between allocate_slots' capacity check and its
allocation. The patched `allocate_slots` must then answer None with the request exactly as
before the call (no blocks, prefix-cache hits untouched, no per-request bookkeeping), so that
the same request can be scheduled again once memory is back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.matrix import Cell
from tests.contract.vllm_contract import (
    contract_venv,
    run_on_patched_tree,
    tree_workspace,
    unpacked_sdist,
)
from tests.proof_cells import proof_of

pytestmark = pytest.mark.slow

# How the release's own tests build the manager and the request: matrix.toml's
# [cell.proof.kv_manager] of each cell.

SCRIPT = """
import sys

sys.path.insert(0, "tests/v1/core")
import test_prefix_caching as upstream

from kvcached_core.integration.vllm import pools
from kvcached_core.integration.vllm.config import pool_name
from kvcached_core.layout import BlockTiling
from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec

PAGE = 4096
BLOCKS_PER_PAGE = 4
NUM_PAGES = 8
NUM_BLOCKS = BLOCKS_PER_PAGE * NUM_PAGES
BLOCK_TOKENS = 16

{setup}

# 32 vLLM blocks of 16 tokens, 4 to a 4 KiB host page; every page may be mapped at first.
pool = KVPool.create(pool_name(), PoolSpec(1, 1, PAGE, NUM_PAGES * PAGE, PAGE),
                     PoolPolicy(min_reserve_pages=0, max_reserve_pages=0, prealloc=False,
                                physical_limit_bytes=NUM_PAGES * PAGE,
                                defer_physical_release=True),
                     share_limits=False, export_metrics=False)
pools.register(pools.EnginePool(pool_name(), pool, BlockTiling(PAGE // BLOCKS_PER_PAGE, PAGE),
                                NUM_BLOCKS))
config = upstream.make_kv_cache_config(BLOCK_TOKENS, NUM_BLOCKS)
manager = {manager}
bp = manager.block_pool
assert type(bp).__name__ == "ElasticBlockPool", type(bp)
managers = list(manager.coordinator.single_type_managers)


def make_request(request_id, tokens):
    return {request}


def computed_blocks(request):
    found = manager.get_computed_blocks(request)  # (blocks, tokens[, ...]) by version
    return found[0], found[1]


def request_tables(request_id):
    \"\"\"Every per-request dict of the single-type managers that knows `request_id`.\"\"\"
    return sorted(f"{{type(m).__name__}}.{{name}}" for m in managers
                  for name, value in vars(m).items()
                  if isinstance(value, dict) and request_id in value)


def free_ids():
    return sorted(b.block_id for b in bp.free_block_queue.get_all_free_blocks())


# Request A: 3 full blocks of shared prefix + 7 tokens; finished, so its full blocks stay
# in the prefix cache with ref count 0.
prefix = [i for i in range(3) for _ in range(BLOCK_TOKENS)]
req_a = make_request("A", prefix + [3] * 7)
hit, hit_tokens = computed_blocks(req_a)
assert hit_tokens == 0
blocks_a = manager.allocate_slots(req_a, len(req_a.prompt_token_ids), 0, hit)
assert blocks_a is not None
cached_ids = blocks_a.get_block_ids()[0][:3]
manager.free(req_a)
assert all(bp.blocks[i].ref_cnt == 0 and bp.blocks[i].block_hash is not None
           for i in cached_ids), cached_ids

# Request B shares A's prefix and needs 7 new blocks: more than the held pages have free,
# so the allocation must map another page.
req_b = make_request("B", prefix + [7] * 100)
hit, hit_tokens = computed_blocks(req_b)
assert hit_tokens == 3 * BLOCK_TOKENS, hit_tokens
assert [b.block_id for b in hit.blocks[0]] == cached_ids
in_use_before = pool.snapshot().in_use_pages
refs_before = {{i: bp.blocks[i].ref_cnt for i in cached_ids}}
free_before = free_ids()
num_free_before = bp.get_num_free_blocks()
assert num_free_before >= 7 + 3, num_free_before  # the capacity check passes
assert request_tables("B") == []

# Another engine takes every remaining page after the capacity check: the allocation loses.
stock_get_new_blocks = bp.get_new_blocks
raced = []


def get_new_blocks_after_competitor(num_blocks):
    if not raced:
        raced.append(num_blocks)
        pool.set_limit(pool.snapshot().in_use_pages * PAGE)
    return stock_get_new_blocks(num_blocks)


bp.get_new_blocks = get_new_blocks_after_competitor
result = manager.allocate_slots(req_b, 100, len(hit.blocks[0]) * BLOCK_TOKENS, hit)
del bp.get_new_blocks
assert raced == [7], raced  # the race was hit inside allocate_slots, not by its check
assert result is None, result
assert all(not m.req_to_blocks.get("B") for m in managers)
assert request_tables("B") == [], request_tables("B")
assert {{i: bp.blocks[i].ref_cnt for i in cached_ids}} == refs_before
assert all(bp.blocks[i].block_hash is not None for i in cached_ids)
assert free_ids() == free_before
assert pool.snapshot().in_use_pages == in_use_before, pool.snapshot()

# The memory comes back: the same request is scheduled as if the race never happened.
pool.set_limit(NUM_PAGES * PAGE)
hit, hit_tokens = computed_blocks(req_b)
assert [b.block_id for b in hit.blocks[0]] == cached_ids and hit_tokens == 48
blocks_b = manager.allocate_slots(req_b, 100, len(hit.blocks[0]) * BLOCK_TOKENS, hit)
assert blocks_b is not None
ids_b = manager.get_block_ids("B")[0]
assert len(ids_b) == 10 and ids_b[:3] == cached_ids, ids_b
assert len(set(ids_b)) == 10 and 0 not in ids_b
assert all(bp.blocks[i].ref_cnt == 1 for i in ids_b)
backed = {{offset // PAGE for offset in pool.tensors[0].mapped_offsets()}}
assert {{i // BLOCKS_PER_PAGE for i in ids_b}} <= backed, (ids_b, backed)
manager.free(req_b)
assert request_tables("B") == [], request_tables("B")

# Everything but the null block is free again, and the elastic count agrees with vLLM's queue.
assert free_ids() == list(range(1, NUM_BLOCKS)), free_ids()
assert bp.free_block_queue.num_free_blocks == NUM_BLOCKS - 1
assert bp.get_num_free_blocks() == NUM_BLOCKS - 1, bp.get_num_free_blocks()
assert all(b.ref_cnt == 0 for b in bp.blocks[1:])
pools.close(pool_name())
print("OK")
"""


def race_script(cell: Cell) -> str:
    recipe = proof_of(cell).kv_manager
    assert recipe is not None, f"{cell.name}: matrix.toml lacks [cell.proof.kv_manager]"
    return SCRIPT.format(setup=recipe.setup, manager=recipe.manager, request=recipe.request)


def test_lost_page_race_leaves_the_request_as_before(cell: Cell, tmp_path: Path) -> None:
    script = race_script(cell)
    python = contract_venv(cell)
    tree = unpacked_sdist(cell, tmp_path)
    tree_workspace(tree, patched=True, cell=cell)
    manager_source = (tree / "vllm" / "v1" / "core" / "kv_cache_manager.py").read_text(
        encoding="utf-8")
    assert "_kvcached_vllm.none_on_pool_exhausted" in manager_source

    done = run_on_patched_tree(python, tree, script, tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
