"""vLLM >= 0.29's one shared KV buffer on the host backend: its geometry, and models with
several KV cache groups (sliding-window and full attention layers, padded hybrid pages).

vLLM gives each group its own KVCacheTensors over the same bytes (a block id belongs to one
group at a time). `shared_geometry` finds the one page-affine layout of them all where there is
one; until a family beyond one full-attention group is declared elastic, a model with several
groups is refused at the buffer with one line, never given a stock buffer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.vllm import pools, shared_kv_buffer
from kvcached_core.integration.vllm.kv_buffers import shared_geometry
from tests.unit.vllm_kv_stand_ins import set_elastic_env

PAGE = 32 << 10
BLOCK = 8 << 10                      # one layer's block (K and V) in bytes
NUM_BLOCKS = 16
LAYER = NUM_BLOCKS * BLOCK           # a layer's region in a layer-outermost buffer
K = PAGE // BLOCK                    # blocks per page


@pytest.fixture
def elastic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    name = f"kvshared-test-{os.getpid()}"
    set_elastic_env(monkeypatch, tmp_path, name, PAGE)
    yield name
    pools.close(name)


# Gemma-like: one full-attention group and two sliding-window groups of two layer slots each,
# every group's tensor at offset 0 (vLLM resets the offset per group).
HYBRID = [(0, 2, LAYER, BLOCK), (0, 2, LAYER, BLOCK), (0, 1, LAYER, BLOCK)]


def test_groups_of_one_layer_outermost_geometry_make_one_region_per_layer_slot() -> None:
    assert shared_geometry(2 * LAYER, HYBRID) == (2, LAYER, BLOCK)
    assert shared_geometry(2 * LAYER, [(0, 2, LAYER, BLOCK)]) == (2, LAYER, BLOCK)
    # Block-outermost: every layer of a block in one range; groups repeat the same packing.
    assert shared_geometry(NUM_BLOCKS * 2 * BLOCK,
                           [(0, 2, BLOCK, 2 * BLOCK), (0, 1, BLOCK, 2 * BLOCK)]) == \
        (1, NUM_BLOCKS * 2 * BLOCK, 2 * BLOCK)


@pytest.mark.parametrize(("regions", "words"), [
    ([(0, 2, LAYER, BLOCK), (0, 2, LAYER // 2, BLOCK // 2)], "do not share one block geometry"),
    ([(0, 2, LAYER, BLOCK), (0, 2, BLOCK, 2 * BLOCK)], "do not share one block geometry"),
    ([(0, 1, LAYER, BLOCK), (BLOCK, 1, LAYER, BLOCK)], "starts at offset 8192, inside a region"),
    ([], "has no KV cache tensor"),
])
def test_another_geometry_is_refused_in_one_line(regions: list[tuple[int, int, int, int]],
                                                 words: str) -> None:
    with pytest.raises(KVCachedConfigError) as caught:
        shared_geometry(2 * LAYER, regions)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_one_tensor_maps_a_page_in_every_layer_slot(elastic: str) -> None:
    size = 2 * LAYER
    raw = shared_kv_buffer(torch.zeros, size, dtype=torch.int8, device=torch.device("cpu"),
                           regions=[(0, 2, LAYER, BLOCK)])
    assert raw.numel() == size and raw.dtype == torch.int8
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None and engine_pool.blocks_per_page == K
    (ftensor,) = engine_pool.pool.tensors
    assert sorted(ftensor.mapped_offsets()) == [0, LAYER]  # the null block's page, each slot
    [page] = engine_pool.pool.alloc(1)
    assert sorted(ftensor.mapped_offsets()) == sorted(
        slot * LAYER + p * PAGE for slot in range(2) for p in (0, page))
    stock = torch.zeros(size, dtype=torch.int8)
    for slot in range(2):
        for block in range(page * K, (page + 1) * K):
            start = slot * LAYER + block * BLOCK
            raw[start:start + BLOCK] = slot + 1
            stock[start:start + BLOCK] = slot + 1
    assert torch.equal(raw, stock)
    # Freed, the page is retired until the step that may read it ends, then unmapped in
    # every slot.
    marker = engine_pool.pool.capture_release_marker()
    engine_pool.pool.free([page])
    engine_pool.pool.release_retired_through(marker + 1)
    engine_pool.pool.trim()
    assert sorted(ftensor.mapped_offsets()) == [0, LAYER]


def test_several_kv_cache_groups_are_refused_at_the_buffer_not_given_a_stock_one(
        elastic: str) -> None:
    with pytest.raises(KVCachedConfigError) as caught:
        shared_kv_buffer(torch.zeros, 2 * LAYER, dtype=torch.int8,
                         device=torch.device("cpu"), regions=HYBRID)
    assert str(caught.value) == (
        "elastic KV cache serves models with one KV cache group; this model's KV cache has 3 "
        "tensors (KV cache groups of sliding-window, hybrid or other layers beside full "
        "attention); set KVCACHED_ENABLE=0")
    assert pools.lookup(elastic) is None


def test_switched_off_the_hybrid_buffer_is_the_stock_allocation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    raw = shared_kv_buffer(torch.zeros, 2 * LAYER, dtype=torch.int8,
                           device=torch.device("cpu"), regions=HYBRID)
    assert raw.numel() == 2 * LAYER and not raw.any()
