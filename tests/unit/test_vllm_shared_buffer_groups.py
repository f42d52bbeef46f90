"""vLLM >= 0.29's one shared KV buffer on the host backend: its geometry, and models with
several KV cache groups (sliding-window and full attention layers, padded hybrid pages).

vLLM gives each group its own KVCacheTensors over the same bytes (a block id belongs to one
group at a time). `shared_geometry` finds the one page-affine layout of them all where there is
one, and one pool backs every group's blocks; a layout that has none is refused at the buffer
with one line, never given a stock buffer. MLA's blocks, which do not tile a page, are backed
page by page too (the blocks straddling a page boundary are never handed out).
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
from kvcached_core.layout import BlockTiling
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
    assert engine_pool is not None and engine_pool.tiling.min_blocks_per_page == K
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


def test_every_group_of_a_hybrid_model_is_backed_by_one_pool(elastic: str) -> None:
    """Sliding-window and full-attention groups overlay one buffer: a page backs block `b`
    of every group in every layer slot, with the bytes a stock buffer would hold."""
    size = 2 * LAYER
    raw = shared_kv_buffer(torch.zeros, size, dtype=torch.int8, device=torch.device("cpu"),
                           regions=HYBRID)
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None and engine_pool.tiling == BlockTiling(BLOCK, PAGE)
    (ftensor,) = engine_pool.pool.tensors
    [page] = engine_pool.pool.alloc(1)
    stock = torch.zeros(size, dtype=torch.int8)
    for group, (offset, layers, layer_stride, block_stride) in enumerate(HYBRID):
        # Each group writes its own blocks of the page (a block id is one group's at a time).
        for block in range(page * K + group, (page + 1) * K, len(HYBRID)):
            for slot in range(layers):
                start = offset + slot * layer_stride + block * block_stride
                raw[start:start + block_stride] = group + 1
                stock[start:start + block_stride] = group + 1
    assert torch.equal(raw, stock)
    assert sorted(ftensor.mapped_offsets()) == sorted(
        slot * LAYER + p * PAGE for slot in range(2) for p in (0, page))


# MLA on vLLM 0.32's CPU engine: one 576-wide bf16 latent of 32 tokens per block (36,864
# bytes) in each of 2 layer slots; on 2 MiB pages 56 or 55 blocks lie wholly in a page.
MLA_BLOCK = 576 * 2 * 32
MLA_PAGE = 2 << 20
MLA_BLOCKS = 512  # the fewest whose bytes are whole pages: 18 MiB per layer slot


def test_mla_blocks_that_do_not_tile_a_page_are_backed_page_by_page(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    name = f"kvshared-mla-{os.getpid()}"
    set_elastic_env(monkeypatch, tmp_path, name, MLA_PAGE)
    layer = MLA_BLOCKS * MLA_BLOCK
    try:
        raw = shared_kv_buffer(torch.zeros, 2 * layer, dtype=torch.int8,
                               device=torch.device("cpu"), regions=[(0, 2, layer, MLA_BLOCK)])
        engine_pool = pools.lookup(name)
        assert engine_pool is not None
        tiling = engine_pool.tiling
        assert tiling == BlockTiling(MLA_BLOCK, MLA_PAGE) and tiling.min_blocks_per_page == 55
        assert tiling.page_of(56) is None  # bytes 2,064,384 - 2,101,248 cross the first page
        [page] = engine_pool.pool.alloc(1)
        blocks = tiling.blocks_of(page)
        (ftensor,) = engine_pool.pool.tensors
        assert sorted(ftensor.mapped_offsets()) == sorted(
            slot * layer + p * MLA_PAGE for slot in range(2) for p in (0, page))
        stock = torch.zeros(2 * layer, dtype=torch.int8)
        for slot in range(2):
            for block in blocks:  # every block of the page is readable and writable
                start = slot * layer + block * MLA_BLOCK
                raw[start:start + MLA_BLOCK] = slot + 1
                stock[start:start + MLA_BLOCK] = slot + 1
        assert torch.equal(raw, stock)
    finally:
        pools.close(name)


def test_mla_regions_that_are_not_whole_pages_name_the_block_count_that_is(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A block count vLLM was not given by kvcached (num_gpu_blocks_override) is refused with
    the multiple that works: the budget kvcached hands vLLM is always such a multiple."""
    from kvcached_core.integration.vllm.engine import aligned_blocks_quantum

    set_elastic_env(monkeypatch, tmp_path, f"kvshared-mla-{os.getpid()}", MLA_PAGE)
    assert aligned_blocks_quantum([MLA_BLOCK] * 2, MLA_PAGE) % MLA_BLOCKS == 0
    with pytest.raises(KVCachedConfigError, match="multiple of 512"):
        shared_kv_buffer(torch.zeros, 2 * 113 * MLA_BLOCK, dtype=torch.int8,
                         device=torch.device("cpu"),
                         regions=[(0, 2, 113 * MLA_BLOCK, MLA_BLOCK)])


def test_switched_off_the_hybrid_buffer_is_the_stock_allocation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    raw = shared_kv_buffer(torch.zeros, 2 * LAYER, dtype=torch.int8,
                           device=torch.device("cpu"), regions=HYBRID)
    assert raw.numel() == 2 * LAYER and not raw.any()


def test_an_explicit_contiguous_layout_over_layer_regions_is_refused_in_one_line(
        elastic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.29+ lays a layer-outermost buffer out region per layer slot: a user's
    `KVCACHED_LAYOUT=contiguous` cannot be honoured there, and is refused, not ignored."""
    monkeypatch.setenv("KVCACHED_LAYOUT", "contiguous")
    with pytest.raises(KVCachedConfigError) as caught:
        shared_kv_buffer(torch.zeros, 2 * LAYER, dtype=torch.int8,
                         device=torch.device("cpu"), regions=HYBRID)
    assert "KVCACHED_LAYOUT=contiguous needs a blocks-first KV layout" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert pools.lookup(elastic) is None
    # Blocks-first, the one buffer is one region: the compound layout it asks for.
    shared_kv_buffer(torch.zeros, NUM_BLOCKS * 2 * BLOCK, dtype=torch.int8,
                     device=torch.device("cpu"), regions=[(0, 2, BLOCK, 2 * BLOCK)])
    assert pools.lookup(elastic) is not None


def test_a_block_count_that_is_not_whole_pages_gets_whole_pages_of_address_space(
        elastic: str) -> None:
    """vLLM's own tests (and a user's num_gpu_blocks_override) size the buffer from any block
    count, as the stock engine does: 7 blocks-first blocks of 16 KiB are 3.5 pages of 32 KiB.
    The buffer is its first bytes of 4 pages, and the page of the last blocks backs them."""
    unit = 2 * BLOCK  # both layers of a block in one range
    size = 7 * unit
    raw = shared_kv_buffer(torch.zeros, size, dtype=torch.int8, device=torch.device("cpu"),
                           regions=[(0, 2, BLOCK, unit)])
    assert raw.numel() == size
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None
    (ftensor,) = engine_pool.pool.tensors
    pages = engine_pool.pool.alloc(3)  # every page but the null block's
    assert sorted(ftensor.mapped_offsets()) == [p * PAGE for p in range(4)]
    assert max(pages) == 3
    raw[6 * unit:7 * unit] = 7  # the last block, in the last (half-used) page
    assert int(raw[6 * unit:].sum()) == 7 * unit
