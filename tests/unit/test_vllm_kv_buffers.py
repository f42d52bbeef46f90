"""The vLLM 0.24 - 0.28 KV buffer adapter on the host backend: stock bytes, page-wise backing.

A buffer the adapter returns is viewed exactly as vLLM views a stock `torch.zeros` buffer; the
tests check that block `b` lands on the same bytes in both, and that mapping one kvcached page
backs exactly the blocks of that page in every layer (and every K/V plane).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.vllm import kv_tensor_buffer, per_layer_kv_buffer, pools
from kvcached_core.integration.vllm.kv_buffers import (
    choose_contiguous_layout,
    planes_outside_blocks,
)
from tests.unit.vllm_kv_stand_ins import (
    Config,
    FullAttentionSpec,
    Group,
    MambaSpec,
    SlidingWindowSpec,
    Tensor,
    blocks_first_shape,
    cpu_shape,
    hnd,
    kv_first_shape,
    nhd,
    no_stride_order,
    set_elastic_env,
)

PAGE = 32 << 10            # KVCACHED_PAGE_SIZE in these tests
BLOCK_TOKENS, HEADS, HEAD_SIZE = 16, 2, 64
DTYPE = torch.bfloat16
BLOCK_BYTES = 2 * BLOCK_TOKENS * HEADS * HEAD_SIZE * 2   # K and V: 8 KiB per layer
BLOCKS_PER_PAGE = PAGE // BLOCK_BYTES                     # 4
NUM_BLOCKS = 16
NUM_LAYERS = 3


def layer_spec() -> FullAttentionSpec:
    return FullAttentionSpec(BLOCK_TOKENS, HEADS, HEAD_SIZE, BLOCK_BYTES)


def layer_names(count: int = NUM_LAYERS) -> list[str]:
    return [f"model.layers.{i}.attn" for i in range(count)]


def per_layer_config(num_blocks: int = NUM_BLOCKS) -> Config:
    names = layer_names()
    return Config([Tensor(BLOCK_BYTES * num_blocks, [n]) for n in names],
                  [Group(layer_spec(), names)])


def packed_config(num_layers: int = 2) -> Config:
    """Every layer of block b in one range of `block_stride` bytes (16 KiB: 2 blocks a page)."""
    names = layer_names(num_layers)
    stride = BLOCK_BYTES * num_layers
    return Config([Tensor(stride * NUM_BLOCKS, [n], offset=i * BLOCK_BYTES, block_stride=stride)
                   for i, n in enumerate(names)], [Group(layer_spec(), names)])


@pytest.fixture
def elastic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    name = f"kvbuf-test-{os.getpid()}"
    for key in [k for k in os.environ if k.startswith("KVCACHED_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(PAGE))
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_PREALLOC", "0")
    monkeypatch.setenv("KVCACHED_POOL_NAME", name)
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path))
    yield name
    pools.close(name)


def allocate(config: Config, layouts: Sequence[tuple[Sequence[str], object, object]]
             ) -> list[torch.Tensor]:
    """What the rewritten `_allocate_kv_cache(_tensors)` does: packed backing allocated once."""
    buffers: list[torch.Tensor] = []
    backing: torch.Tensor | None = None
    for tensor in config.kv_cache_tensors:
        if tensor.block_stride > 0:
            if backing is None:
                backing = kv_tensor_buffer(
                    torch.zeros, tensor.size, dtype=torch.int8, device=torch.device("cpu"),
                    kv_cache_config=config, kv_cache_tensor=tensor,
                    block_stride=tensor.block_stride, kv_layouts=layouts)
            buffers.append(backing)
        else:
            buffers.append(kv_tensor_buffer(
                torch.zeros, tensor.size, dtype=torch.int8, device=torch.device("cpu"),
                kv_cache_config=config, kv_cache_tensor=tensor,
                block_stride=tensor.block_stride, kv_layouts=layouts))
    return buffers


def view(raw: torch.Tensor, shape_of: object, order_of: object, tensor: Tensor) -> torch.Tensor:
    """vLLM 0.25.1's `_reshape_attention_kv_cache`, for these shapes."""
    shape = shape_of(NUM_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_SIZE)  # type: ignore[operator]
    try:
        order = tuple(order_of())  # type: ignore[operator]
    except NotImplementedError:
        order = tuple(range(len(shape)))
    inverse = [order.index(i) for i in range(len(order))]
    if tensor.block_stride:
        page = BLOCK_BYTES
        return (raw.view(-1, tensor.block_stride)[:, tensor.offset:tensor.offset + page]
                .view(DTYPE).view(shape))
    return raw.view(DTYPE).view(tuple(shape[i] for i in order)).permute(*inverse)


def block_of(kv: torch.Tensor, shape_of: object, block: int) -> torch.Tensor:
    dim = list(shape_of(NUM_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_SIZE)).index(NUM_BLOCKS)  # type: ignore[operator]
    return kv.select(dim, block)


def byte_ranges(raw: torch.Tensor, kv: torch.Tensor, shape_of: object, block: int) -> list[int]:
    """Byte offsets (from the buffer start) that block `block` of one layer covers."""
    element = block_of(kv, shape_of, block)
    start = element.data_ptr() - raw.data_ptr()
    offsets = torch.as_strided(torch.arange(raw.numel() // 2, dtype=torch.int64),
                               element.shape, element.stride(),
                               (start // 2)).flatten() * 2
    return sorted(offsets.tolist())


LAYOUTS = [
    pytest.param(blocks_first_shape, nhd, 1, id="flash-attn-0.25-NHD"),
    pytest.param(blocks_first_shape, hnd, 1, id="flash-attn-0.25-HND"),
    pytest.param(cpu_shape, no_stride_order, 1, id="cpu-attn"),
    pytest.param(kv_first_shape, nhd, 2, id="kv-planes-first"),
]


@pytest.mark.parametrize(("shape_of", "order_of", "planes"), LAYOUTS)
def test_planes_outside_the_block_dimension(shape_of: object, order_of: object,
                                            planes: int) -> None:
    assert planes_outside_blocks(shape_of, order_of, block_size=BLOCK_TOKENS,  # type: ignore[arg-type]
                                 num_kv_heads=HEADS, head_size=HEAD_SIZE) == planes


def test_a_stride_order_that_puts_blocks_outermost_makes_one_region() -> None:
    def blocks_outermost() -> tuple[int, ...]:
        return (1, 0, 2, 3, 4)

    assert planes_outside_blocks(kv_first_shape, blocks_outermost, block_size=BLOCK_TOKENS,
                                 num_kv_heads=HEADS, head_size=HEAD_SIZE) == 1


def allocate_per_layer(config: Config, shape_of: object) -> list[torch.Tensor]:
    """What vLLM 0.9 - 0.11's rewritten `_allocate_kv_cache_tensors` does: the shape only."""
    return [per_layer_kv_buffer(torch.zeros, tensor.size, dtype=torch.int8,
                                device=torch.device("cpu"), kv_cache_config=config,
                                kv_cache_tensor=tensor, kv_cache_shape=shape_of)  # type: ignore[arg-type]
            for tensor in config.kv_cache_tensors]


@pytest.mark.parametrize("adapter", ["tensor", "per-layer"])
@pytest.mark.parametrize(("shape_of", "order_of", "planes"), LAYOUTS)
def test_block_bytes_match_a_stock_buffer_and_a_page_backs_its_blocks_in_every_layer(
        elastic: str, monkeypatch: pytest.MonkeyPatch, shape_of: object, order_of: object,
        planes: int, adapter: str) -> None:
    monkeypatch.setenv("KVCACHED_LAYOUT", "per-layer")
    config = per_layer_config()
    if adapter == "tensor":
        ours = allocate(config, [(layer_names(), shape_of, order_of)])
    else:  # vLLM 0.9 - 0.11 tell planes apart by the shape alone
        ours = allocate_per_layer(config, shape_of)
    stock = [torch.zeros(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
    engine_pool = pools.lookup(elastic)
    # A page holds a page's worth of each plane: twice the blocks when K and V are planes.
    k = BLOCKS_PER_PAGE * planes
    assert engine_pool is not None and engine_pool.tiling.min_blocks_per_page == k
    assert [b.numel() for b in ours] == [t.size for t in config.kv_cache_tensors]
    region = config.kv_cache_tensors[0].size // planes
    tensors = engine_pool.pool.tensors
    # Only the null block's page (page 0) is backed, in every layer and plane.
    for ftensor in tensors:
        assert sorted(ftensor.mapped_offsets()) == [r * region for r in range(planes)]

    [page] = engine_pool.pool.alloc(1)
    assert page != 0
    for ftensor in tensors:
        assert sorted(ftensor.mapped_offsets()) == sorted(
            r * region + p * PAGE for r in range(planes) for p in (0, page))

    blocks = range(page * k, (page + 1) * k)
    for layer, (raw, reference, tensor) in enumerate(
            zip(ours, stock, config.kv_cache_tensors, strict=True)):
        kv, stock_kv = (view(raw, shape_of, order_of, tensor),
                        view(reference, shape_of, order_of, tensor))
        assert kv.shape == stock_kv.shape and kv.stride() == stock_kv.stride()
        for block in range(NUM_BLOCKS):
            covered = byte_ranges(raw, kv, shape_of, block)
            assert covered == byte_ranges(reference, stock_kv, shape_of, block)
            # Block b of this layer lies in the pages that back b, in each plane.
            backed = {offset // PAGE for offset in covered}
            assert backed == {(r * region) // PAGE + block // k for r in range(planes)}
        for block in blocks:
            data = torch.full(block_of(kv, shape_of, block).shape, float(layer * 100 + block),
                              dtype=DTYPE)
            block_of(kv, shape_of, block).copy_(data)
            block_of(stock_kv, shape_of, block).copy_(data)
        assert torch.equal(raw, reference)  # the same bytes, and every other block reads zero


def test_packed_backing_is_one_buffer_whose_pages_hold_every_layer_of_a_block(
        elastic: str) -> None:
    config = packed_config()
    layouts = [(layer_names(2), blocks_first_shape, nhd)]
    ours = allocate(config, layouts)
    assert all(b is ours[0] for b in ours)
    stock = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None
    stride = config.kv_cache_tensors[0].block_stride
    assert engine_pool.tiling.min_blocks_per_page == PAGE // stride == 2
    [ftensor] = engine_pool.pool.tensors
    [page] = engine_pool.pool.alloc(1)
    assert sorted(ftensor.mapped_offsets()) == sorted({0, page * PAGE})
    k = engine_pool.tiling.min_blocks_per_page
    for tensor in config.kv_cache_tensors:
        kv = view(ours[0], blocks_first_shape, nhd, tensor)
        stock_kv = view(stock, blocks_first_shape, nhd, tensor)
        assert kv.stride() == stock_kv.stride()
        for block in range(page * k, (page + 1) * k):
            data = torch.full(kv[block].shape, float(block + tensor.offset), dtype=DTYPE)
            kv[block].copy_(data)
            stock_kv[block].copy_(data)
            start = kv[block].data_ptr() - ours[0].data_ptr()
            assert start == block * stride + tensor.offset
            assert start // PAGE == page
    assert torch.equal(ours[0], stock)


def test_a_profiling_sized_cache_that_is_not_whole_pages_still_gets_a_buffer(
        elastic: str) -> None:
    config = per_layer_config(num_blocks=NUM_BLOCKS + 1)
    ours = allocate(config, [(layer_names(), blocks_first_shape, nhd)])
    assert [b.numel() for b in ours] == [t.size for t in config.kv_cache_tensors]
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None and not engine_pool.attached
    assert engine_pool.num_blocks >= NUM_BLOCKS + 1
    # The real allocation replaces the profiling pool, which nothing attached to.
    allocate(per_layer_config(), [(layer_names(), blocks_first_shape, nhd)])
    replaced = pools.lookup(elastic)
    assert replaced is not None and replaced is not engine_pool
    assert replaced.num_blocks == NUM_BLOCKS


def test_switched_off_it_is_exactly_the_stock_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    monkeypatch.setenv("KVCACHED_POOL_NAME", "kvbuf-test-off")
    calls: list[tuple[object, ...]] = []

    def zeros(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append((*args, *sorted(kwargs.items())))
        return torch.zeros(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    config = packed_config()
    buffer = kv_tensor_buffer(zeros, 4096, dtype=torch.int8, device=torch.device("cpu"),
                              kv_cache_config=config, kv_cache_tensor=config.kv_cache_tensors[0],
                              block_stride=0, kv_layouts=[])
    assert calls == [(4096, ("device", torch.device("cpu")), ("dtype", torch.int8))]
    assert buffer.dtype == torch.int8 and buffer.numel() == 4096 and not buffer.any()
    assert pools.lookup("kvbuf-test-off") is None


def test_a_layer_with_no_known_layout_is_refused(elastic: str) -> None:
    with pytest.raises(KVCachedConfigError, match="no known attention layout"):
        allocate(per_layer_config(), [(["another.layer"], blocks_first_shape, nhd)])


def test_vllm_0_9_site_refuses_mamba_models_by_name_before_any_pool(elastic: str) -> None:
    """vLLM 0.9 - 0.10.0's site lays out one backend's shape: a hybrid Mamba model is refused
    in one line naming its family, no pool made."""
    config = per_layer_config()
    config.kv_cache_groups.append(Group(MambaSpec(BLOCK_TOKENS, BLOCK_BYTES), ["other"]))
    tensor = config.kv_cache_tensors[0]
    with pytest.raises(KVCachedConfigError) as caught:
        per_layer_kv_buffer(torch.zeros, tensor.size, dtype=torch.int8,
                            device=torch.device("cpu"), kv_cache_config=config,
                            kv_cache_tensor=tensor, kv_cache_shape=blocks_first_shape)
    message = str(caught.value)
    assert message.startswith("elastic KV cache (kvcached) does not serve the mamba model "
                              "family in this build (mamba: ")
    assert message.endswith("set KVCACHED_ENABLE=0 for the stock KV cache")
    assert "\n" not in message
    assert pools.lookup(elastic) is None


def test_explicit_contiguous_refuses_a_hybrid_mamba_model(
        elastic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_LAYOUT", "contiguous")
    config, attn, _ = mamba_hybrid_config()
    with pytest.raises(KVCachedConfigError, match="contiguous does not support Mamba state"):
        allocate(config, [(attn, kv_first_shape, no_stride_order)])


def test_a_hybrid_mamba_model_whose_groups_differ_in_page_size_is_refused(
        elastic: str) -> None:
    config, attn, _ = mamba_hybrid_config()
    config.kv_cache_groups[1].kv_cache_spec = MambaSpec(BLOCK_TOKENS, BLOCK_BYTES * 2)
    with pytest.raises(KVCachedConfigError, match="have pages of"):
        allocate(config, [(attn, kv_first_shape, no_stride_order)])
    assert pools.lookup(elastic) is None


def mamba_hybrid_config() -> tuple[Config, list[str], list[str]]:
    """vLLM's hybrid allocator for 2 attention and 2 Mamba layers: each KVCacheTensor shared
    by one attention layer and one Mamba layer, one page size."""
    attn, mamba = layer_names(2), [f"model.layers.{i}.mixer" for i in range(2)]
    tensors = [Tensor(BLOCK_BYTES * NUM_BLOCKS, [a, m]) for a, m in zip(attn, mamba,
                                                                          strict=True)]
    groups = [Group(layer_spec(), attn), Group(MambaSpec(BLOCK_TOKENS, BLOCK_BYTES), mamba)]
    return Config(tensors, groups), attn, mamba


def hybrid_views(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.25.1's views of one shared buffer of a hybrid Mamba model: the attention layer's
    (2, blocks, ...) FlashAttention cache restrided blocks-first
    (`_update_hybrid_attention_mamba_layout`), and a Mamba state strided by the page."""
    kv = raw.view(DTYPE).view(kv_first_shape(NUM_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_SIZE))
    hidden = kv.shape[2:].numel()
    kv.as_strided_(size=kv.shape, stride=(hidden, 2 * hidden, *kv.stride()[2:]))
    per_page = BLOCK_BYTES // DTYPE.itemsize
    state = torch.as_strided(raw.view(DTYPE), size=(NUM_BLOCKS, per_page // 2),
                             stride=(per_page, 1))
    return kv, state


@pytest.mark.parametrize("layout", ["per-layer", "auto"])
def test_a_hybrid_mamba_model_s_block_is_one_page_sized_range_of_every_buffer(
        elastic: str, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """vLLM 0.10.2 - 0.28 lay a hybrid Mamba model's buffers out blocks-first, so the pool
    backs block `b` as bytes [b * page, (b + 1) * page) of every buffer, whichever group holds
    it (the attention layers' K/V planes are not regions here): blocks of a mapped page,
    written through the attention view or the state view, land where a stock buffer has them.
    `auto` takes per-layer buffers: vLLM reads Mamba state through as_strided views."""
    monkeypatch.setenv("KVCACHED_LAYOUT", layout)
    config, attn, _ = mamba_hybrid_config()
    ours = allocate(config, [(attn, kv_first_shape, no_stride_order)])
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None
    assert engine_pool.tiling.unit_bytes == BLOCK_BYTES
    assert not engine_pool.pool.geometry.contiguous
    stock = [torch.zeros(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
    [page] = engine_pool.pool.alloc(1)
    for slot in range(len(config.kv_cache_tensors)):
        for raw in (ours[slot], stock[slot]):
            kv, state = hybrid_views(raw)
            for block in engine_pool.tiling.blocks_of(page):
                if block % 2:  # a block id is one group's at a time
                    state[block].fill_(float(1 + slot))
                else:
                    kv[:, block].fill_(float(3 + slot))
        assert torch.equal(ours[slot], stock[slot]), slot


def test_vllm_0_9_site_refuses_sliding_window_models_by_name(elastic: str) -> None:
    config = per_layer_config()
    window = SlidingWindowSpec(BLOCK_TOKENS, HEADS, HEAD_SIZE, BLOCK_BYTES)
    config.kv_cache_groups.append(Group(window, ["other"]))
    tensor = config.kv_cache_tensors[0]
    with pytest.raises(KVCachedConfigError, match="does not serve the sliding-window model"):
        per_layer_kv_buffer(torch.zeros, tensor.size, dtype=torch.int8,
                            device=torch.device("cpu"), kv_cache_config=config,
                            kv_cache_tensor=tensor, kv_cache_shape=blocks_first_shape)
    assert pools.lookup(elastic) is None


def hybrid_config() -> tuple[Config, list[str], list[str]]:
    """vLLM's hybrid allocator for 2 full and 2 sliding-window layers: two groups of the same
    page size, each KVCacheTensor shared by one layer of each group."""
    full, window = layer_names(2), [f"model.layers.{i}.window" for i in range(2)]
    tensors = [Tensor(BLOCK_BYTES * NUM_BLOCKS, [f, w]) for f, w in zip(full, window,
                                                                          strict=True)]
    spec = SlidingWindowSpec(BLOCK_TOKENS, HEADS, HEAD_SIZE, BLOCK_BYTES)
    return Config(tensors, [Group(layer_spec(), full), Group(spec, window)]), full, window


@pytest.mark.parametrize(("shape_of", "order_of"), [
    pytest.param(blocks_first_shape, nhd, id="flash-attn-0.25-NHD"),
    pytest.param(kv_first_shape, no_stride_order, id="flash-attn-0.10"),
])
def test_sliding_window_groups_share_each_layer_slot_s_blocks(
        elastic: str, shape_of: object, order_of: object) -> None:
    """A page backs block `b` of every group in every layer slot: written through either
    group's view, the bytes are where a stock buffer holds them."""
    config, full, window = hybrid_config()
    layouts = [(full, shape_of, order_of), (window, shape_of, order_of)]
    ours = allocate(config, layouts)
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None
    stock = [torch.zeros(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
    k = engine_pool.tiling.min_blocks_per_page
    [page] = engine_pool.pool.alloc(1)
    for slot, tensor in enumerate(config.kv_cache_tensors):
        shaped = [view(raw, shape_of, order_of, tensor) for raw in (ours[slot], stock[slot])]
        block_dim = list(shaped[0].shape).index(NUM_BLOCKS)
        for one in shaped:
            for block in range(page * k, (page + 1) * k):
                group = block % 2  # a block id is one group's at a time
                one.select(block_dim, block).fill_(float(1 + group + 2 * slot))
        # Element by element through vLLM's own view (the contiguous layout, which `auto`
        # takes for blocks-first buffers, puts the same blocks at another block stride).
        assert torch.equal(shaped[0], shaped[1]), slot


def test_groups_of_different_block_shapes_are_refused_in_one_line(elastic: str) -> None:
    config, full, window = hybrid_config()
    config.kv_cache_groups[1].kv_cache_spec = SlidingWindowSpec(
        BLOCK_TOKENS, HEADS * 2, HEAD_SIZE // 2, BLOCK_BYTES)
    with pytest.raises(KVCachedConfigError, match="have different block shapes"):
        allocate(config, [(full, blocks_first_shape, nhd), (window, blocks_first_shape, nhd)])
    assert pools.lookup(elastic) is None


def mla_shape(num_blocks: int, block_size: int, num_kv_heads: int,
              head_size: int) -> tuple[int, ...]:
    """vLLM's MLA backends: one latent plane, `(blocks, tokens, latent)`."""
    return (num_blocks, block_size, head_size)


def test_mla_blocks_that_do_not_tile_a_page_are_backed_per_layer(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """DeepSeek's 576-wide bf16 latent at 32 tokens is 36,864 bytes: on 64 KiB pages the
    ledger takes 7-page ledger pages of 12 whole blocks (or 11 at some pages); the blocks of a
    ledger page are the stock buffer's bytes, in every layer."""
    name = f"kvbuf-mla-{os.getpid()}"
    set_elastic_env(monkeypatch, tmp_path, name, 64 << 10)
    latent, tokens = 576, 32
    block = latent * 2 * tokens
    blocks = 7 * 64  # 7 ledger pages of 64 blocks' worth: 448 blocks, whole pages each
    from tests.unit.test_vllm_families import MLAAttentionSpec

    names = layer_names(2)
    config = Config([Tensor(block * blocks, [n]) for n in names],
                    [Group(MLAAttentionSpec(tokens, 1, latent, block), names)])
    try:
        ours = allocate(config, [(names, mla_shape, no_stride_order)])
        engine_pool = pools.lookup(name)
        assert engine_pool is not None
        tiling = engine_pool.tiling
        assert (tiling.unit_bytes, tiling.ledger_bytes) == (block, 7 * (64 << 10))
        [page] = engine_pool.pool.alloc(1)
        for raw in ours:
            stock = torch.zeros_like(raw)
            for b in tiling.blocks_of(page):
                raw[b * block:(b + 1) * block] = b % 100
                stock[b * block:(b + 1) * block] = b % 100
            assert torch.equal(raw, stock)
    finally:
        pools.close(name)


@pytest.mark.parametrize(("shape_of", "order_of"), [
    pytest.param(blocks_first_shape, nhd, id="flash-attn-0.25-NHD"),
    pytest.param(blocks_first_shape, hnd, id="flash-attn-0.25-HND"),
    pytest.param(cpu_shape, no_stride_order, id="cpu-attn"),
])
def test_contiguous_layout_keeps_stock_block_bytes_and_maps_one_compound_page(
        elastic: str, monkeypatch: pytest.MonkeyPatch, shape_of: object,
        order_of: object) -> None:
    monkeypatch.setenv("KVCACHED_LAYOUT", "contiguous")
    config = per_layer_config()
    ours = allocate(config, [(layer_names(), shape_of, order_of)])
    stock = [torch.zeros(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None and engine_pool.pool.geometry.contiguous
    [ftensor] = engine_pool.pool.tensors
    compound = PAGE * NUM_LAYERS
    assert sorted(ftensor.mapped_offsets()) == [0]  # the null block's page, every layer
    [page] = engine_pool.pool.alloc(1)
    assert sorted(ftensor.mapped_offsets()) == [0, page * compound]  # one mapping per page
    k = engine_pool.tiling.min_blocks_per_page
    base = ours[0].data_ptr()  # layer 0 starts the compound tensor
    for layer, (raw, reference, tensor) in enumerate(
            zip(ours, stock, config.kv_cache_tensors, strict=True)):
        assert raw.numel() == tensor.size
        kv = view(raw, shape_of, order_of, tensor)
        stock_kv = view(reference, shape_of, order_of, tensor)
        assert kv.shape == stock_kv.shape
        for block in range(NUM_BLOCKS):
            element = block_of(kv, shape_of, block)
            start = element.data_ptr() - base
            # All layers of block b sit together, inside the compound page of b's ledger page.
            assert start == (block * NUM_LAYERS + layer) * BLOCK_BYTES
            assert start // compound == block // k
        for block in range(page * k, (page + 1) * k):
            data = torch.full(block_of(kv, shape_of, block).shape,
                              float(layer * 100 + block), dtype=DTYPE)
            block_of(kv, shape_of, block).copy_(data)
            block_of(stock_kv, shape_of, block).copy_(data)
        for block in range(NUM_BLOCKS):
            assert torch.equal(block_of(kv, shape_of, block),
                               block_of(stock_kv, shape_of, block))


def test_contiguous_layout_needs_blocks_first(elastic: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_LAYOUT", "contiguous")
    with pytest.raises(KVCachedConfigError, match="blocks-first"):
        allocate(per_layer_config(), [(layer_names(), kv_first_shape, nhd)])
    with pytest.raises(KVCachedConfigError, match="blocks-first"):
        allocate_per_layer(per_layer_config(), kv_first_shape)


# ------------------------------------------------------------------ KVCACHED_LAYOUT=auto


@dataclass
class PaddedSpec(FullAttentionSpec):
    """A spec whose pages vLLM pads (it views them through as_strided)."""

    page_size_padded: int = BLOCK_BYTES + 4096


def padded_config() -> Config:
    names = layer_names()
    return Config([Tensor(BLOCK_BYTES * NUM_BLOCKS, [n]) for n in names],
                  [Group(PaddedSpec(BLOCK_TOKENS, HEADS, HEAD_SIZE, BLOCK_BYTES), names)])


@pytest.mark.parametrize("layout", [None, "auto"])
@pytest.mark.parametrize("adapter", ["tensor", "per-layer"])
@pytest.mark.parametrize(("shape_of", "order_of"), [
    pytest.param(blocks_first_shape, nhd, id="flash-attn-0.25-NHD"),
    pytest.param(blocks_first_shape, hnd, id="flash-attn-0.25-HND"),
    pytest.param(cpu_shape, no_stride_order, id="cpu-attn"),
])
def test_auto_layout_takes_contiguous_for_blocks_first_buffers(
        elastic: str, monkeypatch: pytest.MonkeyPatch, shape_of: object, order_of: object,
        adapter: str, layout: str | None) -> None:
    if layout is not None:  # unset is the default, auto
        monkeypatch.setenv("KVCACHED_LAYOUT", layout)
    config = per_layer_config()
    if adapter == "tensor":
        ours = allocate(config, [(layer_names(), shape_of, order_of)])
    else:
        ours = allocate_per_layer(config, shape_of)
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None and engine_pool.pool.geometry.contiguous
    [ftensor] = engine_pool.pool.tensors  # one compound tensor for every layer
    [page] = engine_pool.pool.alloc(1)
    # One mapping per logical page: the null block's page and the new one.
    assert sorted(ftensor.mapped_offsets()) == [0, page * PAGE * NUM_LAYERS]
    stock = [torch.zeros(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
    k = engine_pool.tiling.min_blocks_per_page
    for layer, (raw, reference, tensor) in enumerate(
            zip(ours, stock, config.kv_cache_tensors, strict=True)):
        kv = view(raw, shape_of, order_of, tensor)
        stock_kv = view(reference, shape_of, order_of, tensor)
        assert kv.shape == stock_kv.shape
        for block in range(page * k, (page + 1) * k):
            data = torch.full(block_of(kv, shape_of, block).shape, float(layer * 100 + block),
                              dtype=DTYPE)
            block_of(kv, shape_of, block).copy_(data)
            block_of(stock_kv, shape_of, block).copy_(data)
        for block in range(NUM_BLOCKS):
            assert torch.equal(block_of(kv, shape_of, block),
                               block_of(stock_kv, shape_of, block))


@pytest.mark.parametrize("layout", [None, "auto"])
@pytest.mark.parametrize("adapter", ["tensor", "per-layer"])
def test_auto_layout_takes_per_layer_for_kv_planes(
        elastic: str, monkeypatch: pytest.MonkeyPatch, adapter: str,
        layout: str | None) -> None:
    if layout is not None:
        monkeypatch.setenv("KVCACHED_LAYOUT", layout)
    config = per_layer_config()
    if adapter == "tensor":
        allocate(config, [(layer_names(), kv_first_shape, nhd)])
    else:
        allocate_per_layer(config, kv_first_shape)
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None and not engine_pool.pool.geometry.contiguous
    assert len(engine_pool.pool.tensors) == NUM_LAYERS
    region = config.kv_cache_tensors[0].size // 2
    for ftensor in engine_pool.pool.tensors:  # the null block's page in the K and V plane
        assert sorted(ftensor.mapped_offsets()) == [0, region]


def test_auto_layout_takes_per_layer_for_padded_pages(elastic: str) -> None:
    allocate(padded_config(), [(layer_names(), blocks_first_shape, nhd)])
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None and not engine_pool.pool.geometry.contiguous
    assert len(engine_pool.pool.tensors) == NUM_LAYERS


def test_explicit_contiguous_still_refuses_padded_pages(
        elastic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_LAYOUT", "contiguous")
    with pytest.raises(KVCachedConfigError, match="padded KV pages"):
        allocate(padded_config(), [(layer_names(), blocks_first_shape, nhd)])


def test_explicit_per_layer_keeps_one_tensor_per_layer_for_blocks_first(
        elastic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_LAYOUT", "per-layer")
    allocate(per_layer_config(), [(layer_names(), blocks_first_shape, nhd)])
    engine_pool = pools.lookup(elastic)
    assert engine_pool is not None and not engine_pool.pool.geometry.contiguous
    assert len(engine_pool.pool.tensors) == NUM_LAYERS


@pytest.mark.parametrize(("requested", "regions", "strided", "chosen"), [
    (None, 1, None, True),
    (None, 2, None, False),
    (None, 1, "padded KV pages", False),
    (None, 1, "Mamba state", False),
    (False, 1, None, False),
    (False, 2, "padded KV pages", False),
    (True, 1, None, True),
])
def test_layout_choice_rule(requested: bool | None, regions: int, strided: str | None,
                            chosen: bool) -> None:
    assert choose_contiguous_layout(requested, regions=regions, strided_views=strided) is chosen


def test_layout_setting_reads_auto_by_default() -> None:
    from kvcached_core.settings import KVCachedSettings

    assert KVCachedSettings.from_env({}).contiguous_layout is None
    assert KVCachedSettings.from_env({"KVCACHED_LAYOUT": "auto"}).contiguous_layout is None
    assert KVCachedSettings.from_env({"KVCACHED_LAYOUT": "per-layer"}).contiguous_layout is False
    assert KVCachedSettings.from_env({"KVCACHED_LAYOUT": "Contiguous"}).contiguous_layout is True
