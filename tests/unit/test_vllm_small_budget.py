"""A KV budget smaller than one kvcached page starts, as it does on stock vLLM (host backend).

The case: a 16-layer model (Llama 3.2 1B's KV shape: 8 KV heads of 64, bf16, 16-token blocks)
with `kv_cache_memory_bytes` = 32 MiB and the default 2 MiB page. One kvcached page of blocks
across every layer and K/V plane is 64 MiB. The scheduler sizes from the user's bytes as stock
vLLM does (64 blocks); the workers' tensors are planned for the next whole-page block count
(`kv_cache_configs_in_whole_pages`, as vLLM 0.9 - 0.28 scale them), which their VMM buffers
back page by page.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvcached_core.integration.vllm import engine, kv_tensor_buffer, pools
from tests.unit.vllm_kv_stand_ins import (
    Config,
    FullAttentionSpec,
    Group,
    Tensor,
    blocks_first_shape,
    kv_first_shape,
    nhd,
    set_elastic_env,
)

MIB = 1 << 20
PAGE = 2 * MIB  # the default KVCACHED_PAGE_SIZE
LAYERS, BLOCK_TOKENS, HEADS, HEAD_SIZE = 16, 16, 8, 64
BLOCK_BYTES = 2 * BLOCK_TOKENS * HEADS * HEAD_SIZE * 2  # K and V, bf16: 32 KiB per layer
USER_BUDGET = 32 * MIB
STOCK_BLOCKS = USER_BUDGET // (BLOCK_BYTES * LAYERS)  # what stock vLLM sizes: 64 blocks
PAGE_OF_BLOCKS = 64 * MIB  # one 2 MiB page of half-blocks in each of 16 layers x 2 planes


def layer_spec() -> FullAttentionSpec:
    return FullAttentionSpec(BLOCK_TOKENS, HEADS, HEAD_SIZE, BLOCK_BYTES)


@pytest.fixture
def elastic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    name = f"small-budget-{os.getpid()}"
    set_elastic_env(monkeypatch, tmp_path, name, PAGE)
    yield name
    pools.close(name)


@dataclass
class RankConfig(Config):
    num_blocks: int = 0


NO_OVERRIDE = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks_override=None))


def budget(available: int, *, user_kv_bytes: int | None) -> int:
    """What the rewritten EngineCore._initialize_kv_caches hands vLLM for a uni engine."""
    [result] = engine.kv_cache_budget([available], block_bytes_per_layer=[BLOCK_BYTES] * LAYERS,
                                      user_kv_bytes=user_kv_bytes, user_num_blocks=None,
                                      executor_backend="uni", world_size=1,
                                      planned_in_whole_pages=True)
    return result


def test_a_user_budget_below_one_page_is_sized_as_stock(elastic: str) -> None:
    assert budget(USER_BUDGET, user_kv_bytes=USER_BUDGET) == USER_BUDGET


ShapeOf = Callable[..., tuple[int, ...]]


@pytest.mark.parametrize(("shape_of", "contiguous"), [
    pytest.param(blocks_first_shape, True, id="blocks-first-contiguous"),
    pytest.param(kv_first_shape, False, id="kv-planes-per-layer"),
])
def test_the_planned_buffers_hold_every_block_stock_vllm_has(
        elastic: str, shape_of: ShapeOf, contiguous: bool) -> None:
    kv_bytes = budget(USER_BUDGET, user_kv_bytes=USER_BUDGET)
    # vLLM's sizing: the budget over every layer's block, each layer a buffer of those blocks.
    assert kv_bytes // (BLOCK_BYTES * LAYERS) == STOCK_BLOCKS
    names = [f"model.layers.{i}.attn" for i in range(LAYERS)]
    stock = RankConfig([Tensor(STOCK_BLOCKS * BLOCK_BYTES, [n]) for n in names],
                       [Group(layer_spec(), names)], num_blocks=STOCK_BLOCKS)
    [config] = engine.kv_cache_configs_in_whole_pages([stock], vllm_config=NO_OVERRIDE,
                                                      plan=None)
    num_blocks = config.num_blocks
    # Whole pages of K and V half-blocks in every layer: 128 blocks, one page of blocks.
    assert num_blocks * BLOCK_BYTES * LAYERS == PAGE_OF_BLOCKS
    buffers = [kv_tensor_buffer(torch.zeros, t.size, dtype=torch.int8,
                                device=torch.device("cpu"), kv_cache_config=config,
                                kv_cache_tensor=t, block_stride=0,
                                kv_layouts=[(names, shape_of, nhd)])
               for t in config.kv_cache_tensors]
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None
    pool = engine_pool.pool
    assert pool.geometry.contiguous is contiguous
    assert [b.numel() for b in buffers] == [t.size for t in config.kv_cache_tensors]
    # The pool holds every block the stock engine has, and every one of those blocks (but the
    # null block) takes writes in every layer once backed.
    assert engine_pool.num_blocks >= STOCK_BLOCKS
    pool.alloc(pool.available_size())
    assert USER_BUDGET <= pool.mapped_bytes() <= PAGE_OF_BLOCKS
    block_dim = 0 if shape_of is blocks_first_shape else 1
    for layer, raw in enumerate(buffers):
        kv = raw.view(torch.bfloat16).view(shape_of(num_blocks, BLOCK_TOKENS, HEADS, HEAD_SIZE))
        kv.narrow(block_dim, 1, STOCK_BLOCKS - 1).fill_(float(layer + 1))
        assert float(kv.select(block_dim, STOCK_BLOCKS - 1).float().mean()) == layer + 1
