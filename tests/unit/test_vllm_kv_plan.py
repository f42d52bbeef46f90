"""vLLM 0.29+: the scheduler keeps stock vLLM's blocks, the workers' KV plan is whole pages.

`kv_cache_budget(..., planned_in_whole_pages=True)` leaves vLLM's bytes alone, so a small
`kv_cache_memory_bytes` gives the scheduler exactly the blocks stock vLLM gives it (the same
capacity, the same refusal). `kv_cache_configs_in_whole_pages` then re-plans each worker's
config for the next block count whose layer regions are whole kvcached pages, through the
planner the call site passes or, where a release scales a rank's tensors with the block
count instead (0.11 - 0.28: `KVBudgetPlannedByScaling`; 0.10, whose ranks keep their own
bytes: `KVBudgetPlannedForUnifiedRanks`), by that scaling. Here the planner is a
stand-in that lays layers out as vLLM's layer-outermost plan does;
tests/contract/test_vllm_kv_plan.py runs the release's own, and
tests/e2e/test_vllm_small_budget.py each CPU cell's engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.vllm import engine, pools, shared_kv_buffer
from tests.unit.vllm_kv_stand_ins import set_elastic_env

MIB = 1 << 20
PAGE = 2 * MIB
LAYERS = 16
BLOCK = 2 * 16 * 2 * 32 * 2  # K and V of 16 tokens, 2 KV heads of 32, bf16: 4 KiB a layer
USER_BUDGET = 2 * MIB
STOCK_BLOCKS = USER_BUDGET // (BLOCK * LAYERS)  # 32: what stock vLLM plans for 2 MiB
PAGE_BLOCKS = PAGE // BLOCK  # 512 blocks make a layer's region whole pages


@dataclass
class PlannedTensor:
    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclass
class PlannedConfig:
    num_blocks: int
    kv_cache_tensors: list[Any]  # PlannedTensor (0.29 on) or LayerTensor (before)
    kv_cache_groups: list[str]
    kv_cache_layout: str | None = None
    hash_block_size: int | None = None
    kv_tp_replicas: int = 1


@dataclass
class CacheConfig:
    num_gpu_blocks_override: int | None = None


@dataclass
class VllmConfig:
    cache_config: CacheConfig = field(default_factory=CacheConfig)


def layer_outermost(groups: list[str], num_blocks: int) -> PlannedConfig:
    """As vLLM's planner lays out a one-group model layer-outermost: layer `l` at
    `l * num_blocks * block`."""
    size = LAYERS * num_blocks * BLOCK
    return PlannedConfig(num_blocks, [PlannedTensor(size, groups, num_blocks * BLOCK, BLOCK)],
                         groups)


def block_outermost(groups: list[str], num_blocks: int) -> PlannedConfig:
    size = LAYERS * num_blocks * BLOCK
    return PlannedConfig(num_blocks, [PlannedTensor(size, groups, BLOCK, LAYERS * BLOCK)],
                         groups)


@pytest.fixture
def elastic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    name = f"kv-plan-{os.getpid()}"
    set_elastic_env(monkeypatch, tmp_path, name, PAGE)
    yield name
    pools.close(name)


def regions(config: PlannedConfig) -> list[tuple[int, int, int, int]]:
    return [(t.offset, len(t.layers), t.layer_stride, t.block_stride)
            for t in config.kv_cache_tensors]


def test_the_budget_is_left_to_vllm_when_the_workers_plan_is_whole_pages(elastic: str) -> None:
    [kept] = engine.kv_cache_budget([USER_BUDGET], block_bytes_per_layer=[BLOCK] * LAYERS,
                                    user_kv_bytes=USER_BUDGET, user_num_blocks=None,
                                    executor_backend="uni", world_size=1,
                                    planned_in_whole_pages=True)
    assert kept == USER_BUDGET
    # A build whose workers are not planned in whole pages would misalign their regions.
    with pytest.raises(KVCachedConfigError, match="without planning the workers"):
        engine.kv_cache_budget([USER_BUDGET], block_bytes_per_layer=[BLOCK] * LAYERS,
                               user_kv_bytes=USER_BUDGET, user_num_blocks=None,
                               executor_backend="uni", world_size=1,
                               planned_in_whole_pages=False)


def test_a_worker_plan_of_stock_blocks_is_widened_to_whole_pages(elastic: str) -> None:
    stock = layer_outermost(["layers"], STOCK_BLOCKS)
    stock.kv_cache_layout, stock.hash_block_size, stock.kv_tp_replicas = "LBHNC", 16, 2
    vllm_config = VllmConfig(CacheConfig(num_gpu_blocks_override=STOCK_BLOCKS))
    seen_override: list[int | None] = []

    def plan(groups: Any, num_blocks: int) -> PlannedConfig:
        seen_override.append(vllm_config.cache_config.num_gpu_blocks_override)
        return layer_outermost(groups, num_blocks)

    [widened] = engine.kv_cache_configs_in_whole_pages([stock], vllm_config=vllm_config,
                                                       plan=plan)
    assert widened.num_blocks == PAGE_BLOCKS
    assert stock.num_blocks == STOCK_BLOCKS  # the scheduler's copy is vLLM's, untouched
    assert (widened.kv_cache_layout, widened.hash_block_size, widened.kv_tp_replicas) == (
        "LBHNC", 16, 2)
    # The user's override is the scheduler's figure: set aside while planning, then back.
    assert seen_override == [None]
    assert vllm_config.cache_config.num_gpu_blocks_override == STOCK_BLOCKS
    # The stock plan's layers start inside pages: one pool cannot back them...
    with pytest.raises(KVCachedConfigError, match="multiple of"):
        shared_kv_buffer(torch.zeros, stock.kv_cache_tensors[0].size, dtype=torch.int8,
                         device=torch.device("cpu"), regions=regions(stock))
    # ...the widened plan's can, and every block the scheduler hands out has its bytes.
    size = widened.kv_cache_tensors[0].size
    raw = shared_kv_buffer(torch.zeros, size, dtype=torch.int8, device=torch.device("cpu"),
                           regions=regions(widened))
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None and engine_pool.num_blocks == PAGE_BLOCKS
    # The pool backs the null block's page, which holds all the scheduler's blocks, at once.
    layers = raw.view(LAYERS, PAGE_BLOCKS, BLOCK)
    layers[:, :STOCK_BLOCKS].fill_(7)
    assert int(layers[:, :STOCK_BLOCKS].sum()) == 7 * LAYERS * STOCK_BLOCKS * BLOCK


@dataclass
class LayerTensor:
    """A KVCacheTensor of vLLM 0.11 - 0.28: one layer's buffer of `num_blocks` blocks (or,
    with a packed `block_stride`, the one backing of every layer, 0.24 - 0.28)."""

    size: int
    shared_by: list[str]
    offset: int = 0
    block_stride: int = 0


def per_layer(num_blocks: int) -> PlannedConfig:
    tensors = [LayerTensor(num_blocks * BLOCK, [f"layer.{i}"]) for i in range(LAYERS)]
    return PlannedConfig(num_blocks, tensors, ["layers"])


def test_a_release_that_scales_tensors_gets_them_scaled_to_whole_pages(elastic: str) -> None:
    stock = per_layer(STOCK_BLOCKS)
    [widened] = engine.kv_cache_configs_in_whole_pages([stock], vllm_config=VllmConfig(),
                                                       plan=None)
    # A layer's K and V planes are half a block each: whole pages of both take 1,024 blocks.
    assert widened.num_blocks == 2 * PAGE_BLOCKS
    assert [(t.size, t.shared_by) for t in widened.kv_cache_tensors] == [
        (2 * PAGE_BLOCKS * BLOCK, [f"layer.{i}"]) for i in range(LAYERS)]
    assert stock.num_blocks == STOCK_BLOCKS  # the scheduler's copy is vLLM's, untouched
    assert {t.size for t in stock.kv_cache_tensors} == {STOCK_BLOCKS * BLOCK}
    # The one packed backing is one region, which the buffer site pads itself.
    backing = LayerTensor(STOCK_BLOCKS * LAYERS * BLOCK, ["layer.0"], 0, LAYERS * BLOCK)
    packed = PlannedConfig(STOCK_BLOCKS, [backing], ["layers"])
    assert engine.kv_cache_configs_in_whole_pages([packed], vllm_config=VllmConfig(),
                                                  plan=None) == [packed]
    # A tensor that is not whole blocks cannot be scaled: refused, not guessed.
    odd = per_layer(STOCK_BLOCKS)
    odd.kv_cache_tensors[3].size += 1
    with pytest.raises(KVCachedConfigError, match="not whole blocks of 32"):
        engine.kv_cache_configs_in_whole_pages([odd], vllm_config=VllmConfig(), plan=None)


@dataclass
class PageSpec:
    page_size_bytes: int


@dataclass
class Group:
    kv_cache_spec: PageSpec


def test_a_vllm_0_10_rank_that_kept_more_bytes_is_scaled_by_the_models_page(
        elastic: str) -> None:
    """vLLM 0.10 brings ranks to the smallest block count without resizing their tensors: a
    rank that sized 40 or 64 blocks keeps their bytes under a common count of 32 (40 x 4 KiB
    is as divisible by 32 as 32 x 4 KiB is, so the bytes alone cannot tell a block). The
    model's one page size can: both are planned as their workers lay the tensors out."""
    groups = [Group(PageSpec(BLOCK))]
    by_page = engine.RANKS_KEEP_THEIR_BYTES
    for own in (32, 40, 64):
        tensors = [LayerTensor(own * BLOCK, [f"layer.{i}"]) for i in range(LAYERS)]
        rank = PlannedConfig(STOCK_BLOCKS, tensors, groups)  # type: ignore[arg-type]
        [widened] = engine.kv_cache_configs_in_whole_pages([rank], vllm_config=VllmConfig(),
                                                           plan=by_page)
        assert widened.num_blocks == 2 * PAGE_BLOCKS, own
        assert {t.size for t in widened.kv_cache_tensors} == {2 * PAGE_BLOCKS * BLOCK}, own
    # Already a whole-page count: a rank that kept more is still brought to it.
    tensors = [LayerTensor(3 * PAGE_BLOCKS * BLOCK, [f"layer.{i}"]) for i in range(LAYERS)]
    rank = PlannedConfig(2 * PAGE_BLOCKS, tensors, groups)  # type: ignore[arg-type]
    [kept] = engine.kv_cache_configs_in_whole_pages([rank], vllm_config=VllmConfig(),
                                                    plan=by_page)
    assert kept.num_blocks == 2 * PAGE_BLOCKS
    assert {t.size for t in kept.kv_cache_tensors} == {2 * PAGE_BLOCKS * BLOCK}
    # Without the model's one page size such a tensor is refused, not guessed.
    bare = [LayerTensor(40 * BLOCK, [f"layer.{i}"]) for i in range(LAYERS)]
    with pytest.raises(KVCachedConfigError, match="not whole blocks of the model"):
        engine.kv_cache_configs_in_whole_pages([PlannedConfig(STOCK_BLOCKS, bare, ["layers"])],
                                               vllm_config=VllmConfig(), plan=by_page)


def test_a_plan_already_in_whole_pages_or_blocks_first_is_handed_on_as_it_is(
        elastic: str) -> None:
    def plan(groups: Any, num_blocks: int) -> PlannedConfig:
        raise AssertionError("planned again")

    whole = layer_outermost(["layers"], 2 * PAGE_BLOCKS)
    blocks_first = block_outermost(["layers"], STOCK_BLOCKS)  # one region: padded by the pool
    planned = engine.kv_cache_configs_in_whole_pages([whole, blocks_first],
                                                     vllm_config=VllmConfig(), plan=plan)
    assert planned[0] is whole and planned[1] is blocks_first


def test_a_planner_that_does_not_honour_the_block_count_is_refused(elastic: str) -> None:
    with pytest.raises(KVCachedConfigError, match=f"asked for {PAGE_BLOCKS}"):
        engine.kv_cache_configs_in_whole_pages(
            [layer_outermost(["layers"], STOCK_BLOCKS)], vllm_config=VllmConfig(),
            plan=lambda groups, num_blocks: layer_outermost(groups, num_blocks - 1))


def test_switched_off_the_plan_is_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    stock = layer_outermost(["layers"], STOCK_BLOCKS)
    assert engine.kv_cache_configs_in_whole_pages(
        [stock], vllm_config=VllmConfig(), plan=layer_outermost) == [stock]


@dataclass
class ReportedCacheConfig:
    num_gpu_blocks: int | None = None


@dataclass
class ReportedVllmConfig:
    cache_config: ReportedCacheConfig = field(default_factory=ReportedCacheConfig)


class InProcessCore:
    """EngineCore with a worker in its own process: the worker shares the engine's config."""

    model_executor = None

    @engine.kv_caches_sized_with_executor
    def initialize(self, vllm_config: ReportedVllmConfig) -> PlannedConfig:
        scheduler = layer_outermost(["layers"], STOCK_BLOCKS)
        vllm_config.cache_config.num_gpu_blocks = scheduler.num_blocks
        [worker] = engine.kv_cache_configs_in_whole_pages(
            [scheduler], vllm_config=VllmConfig(), plan=layer_outermost)
        vllm_config.cache_config.num_gpu_blocks = worker.num_blocks  # the worker's own count
        return scheduler


def test_the_engine_reports_the_scheduler_blocks_not_its_workers_plan(elastic: str) -> None:
    vllm_config = ReportedVllmConfig()
    assert InProcessCore().initialize(vllm_config).num_blocks == STOCK_BLOCKS
    assert vllm_config.cache_config.num_gpu_blocks == STOCK_BLOCKS
