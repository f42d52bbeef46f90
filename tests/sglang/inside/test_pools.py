"""The patched MHA and MLA pools: SGLang's buffer shapes and strides on VMM-backed memory."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import (
    DIM,
    HEADS,
    LAYERS,
    make_mha_pool,
    make_mla_pool,
    make_token_allocator,
    mapped_pages,
)

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.sglang.pools import ElasticMHAInlineBuffersPoolMixin


def releases_own(elastic: type) -> type:
    """The release's own class the build subclassed (the elastic class's last base)."""
    stock = elastic.__bases__[-1]
    assert stock.__name__ == elastic.__name__.removeprefix("Elastic"), elastic.__bases__
    return stock


def kv_layout(pool: object) -> list[dict[str, object]]:
    """Per layer: K's and V's shape, strides and dtype, whether they share one allocation,
    and whether V then starts a whole number of pages past K's rows."""
    layers = []
    for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True):
        fused = k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        row_bytes = k.stride(0) * k.element_size()
        delta = v.data_ptr() - k.data_ptr()
        layers.append({
            "k": (tuple(k.shape), k.stride(), k.dtype),
            "v": (tuple(v.shape), v.stride(), v.dtype),
            "fused": fused,
            "v_whole_pages_past_k": fused and delta >= k.shape[0] * row_bytes
            and delta % (row_bytes * pool.page_size) == 0,
        })
    return layers


@pytest.mark.parametrize(("size", "page_size"), [(1023, 1), (1020, 4)])
def test_mha_buffers_keep_the_releases_own_layout(size: int, page_size: int) -> None:
    from sglang.srt.mem_cache.memory_pool import ElasticMHATokenToKVPool, MHATokenToKVPool

    assert MHATokenToKVPool is ElasticMHATokenToKVPool
    pool = make_mha_pool(size, page_size)
    # The same pool built by the release's own code: fused (2, rows, H, D) per layer from
    # 0.5.23, K and V allocated apart before; the elastic buffers must match either way.
    stock = make_mha_pool(size, page_size, cls=releases_own(ElasticMHATokenToKVPool))
    assert not hasattr(stock, "kvcached_pool") or stock.kvcached_pool is None
    assert kv_layout(pool) == kv_layout(stock)
    assert len(pool.k_buffer) == len(pool.v_buffer) == LAYERS
    for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True):
        assert k.shape == v.shape == (size + page_size, HEADS, DIM)
        assert k.stride() == v.stride() == (HEADS * DIM, DIM, 1)
        assert k.dtype == torch.bfloat16
    assert pool.k_data_ptrs.tolist() == [k.data_ptr() for k in pool.k_buffer]
    assert pool.v_data_ptrs.tolist() == [v.data_ptr() for v in pool.v_buffer]
    # SGLang's copy kernels walk every layer's K then V through these tables
    assert pool.data_ptrs.tolist() == pool.k_data_ptrs.tolist() + pool.v_data_ptrs.tolist()
    assert pool.data_strides.tolist() == stock.data_strides.tolist()
    assert pool.data_strides.dtype == stock.data_strides.dtype


def test_mha_set_and_get_through_sglang() -> None:
    pool = make_mha_pool(1023)
    allocator = make_token_allocator(1023, pool)
    pointers = [k.data_ptr() for k in pool.k_buffer]
    loc = allocator.alloc(300)
    k = torch.randn(300, HEADS, DIM, dtype=torch.bfloat16)
    v = torch.randn(300, HEADS, DIM, dtype=torch.bfloat16)

    class Layer:
        layer_id = 1

    pool.set_kv_buffer(Layer(), loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k)
    assert torch.equal(pool.get_value_buffer(1)[loc], v)
    allocator.free(loc)
    # Freed memory may be unmapped; the buffers stay where they were.
    assert [k.data_ptr() for k in pool.k_buffer] == pointers


def test_mla_buffers_keep_the_stock_shape() -> None:
    from sglang.srt.mem_cache.memory_pool import ElasticMLATokenToKVPool, MLATokenToKVPool

    assert MLATokenToKVPool is ElasticMLATokenToKVPool
    pool = make_mla_pool(1023)
    # The release's own class (up to 0.5.5 with its inline allocation moved, by the build,
    # into the _create_buffers that 0.5.6 introduced) builds the stock buffers.
    stock = make_mla_pool(1023, cls=releases_own(ElasticMLATokenToKVPool))
    assert getattr(stock, "kvcached_pool", None) is None
    assert [(b.shape, b.stride(), b.dtype) for b in pool.kv_buffer] == \
        [(b.shape, b.stride(), b.dtype) for b in stock.kv_buffer]
    for buffer in pool.kv_buffer:
        assert buffer.shape == (1024, 1, 32) and buffer.stride() == (32, 32, 1)
    # The table __init__ builds after the buffers (SGLang's copy kernels read it).
    assert pool.data_ptrs.tolist() == [b.data_ptr() for b in pool.kv_buffer]


def test_mla_latent_memory_follows_the_allocator() -> None:
    pool = make_mla_pool(1023)
    allocator = make_token_allocator(1023, pool)
    pool.kvcached_pool.trim()  # drop the warm reserve: count only what blocks hold
    idle = mapped_pages(pool)
    pointers = [b.data_ptr() for b in pool.kv_buffer]
    loc = allocator.alloc(300)
    assert mapped_pages(pool) > idle
    latent = torch.randn(300, 1, 32, dtype=torch.bfloat16)
    for layer_id in range(LAYERS):
        pool.get_key_buffer(layer_id)[loc] = latent + layer_id
    for layer_id in range(LAYERS):
        assert torch.equal(pool.get_key_buffer(layer_id)[loc], latent + layer_id)
    allocator.free(loc)
    pool.kvcached_pool.trim()
    assert mapped_pages(pool) == idle
    # Freed memory is unmapped; the buffers stay where they were.
    assert [b.data_ptr() for b in pool.kv_buffer] == pointers


def test_unsupported_pool_configurations_are_refused() -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    parameters = inspect.signature(MHATokenToKVPool.__init__).parameters
    if "post_capture_active" in parameters:
        # post-capture KV sizing exists from 0.5.16
        with pytest.raises(KVCachedConfigError, match="post-capture"):
            MHATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, head_num=HEADS,
                             head_dim=DIM, layer_num=LAYERS, device="cpu",
                             enable_memory_saver=False, post_capture_active=True)
    if issubclass(MHATokenToKVPool, ElasticMHAInlineBuffersPoolMixin) and "k_scale_buffer" in (
            inspect.getsource(releases_own(MHATokenToKVPool)._create_buffers)):
        # 0.5.5.post3's pool allocates an FP4 cache inline
        with pytest.raises(KVCachedConfigError, match="FP4"):
            MHATokenToKVPool(size=64, page_size=1, dtype=torch.float4_e2m1fn_x2,
                             head_num=HEADS, head_dim=DIM, layer_num=LAYERS, device="cpu",
                             enable_memory_saver=False)
    from sglang.srt.mem_cache.memory_pool import ElasticMLATokenToKVPool, MLATokenToKVPool

    if "kv_scale_buffer" in inspect.getsource(
            releases_own(ElasticMLATokenToKVPool)._create_buffers):
        # 0.5.5.post3's MLA pool allocates an FP4 cache itself as well (later releases give
        # FP4 a subclass of its own, refused as every subclass is)
        with pytest.raises(KVCachedConfigError, match="FP4"):
            MLATokenToKVPool(size=64, page_size=1, dtype=torch.float4_e2m1fn_x2,
                             kv_lora_rank=16, qk_rope_head_dim=16, layer_num=LAYERS,
                             device="cpu", enable_memory_saver=False)
    if "v_head_dim" in parameters:  # a V head dim of its own exists from 0.5.6
        with pytest.raises(KVCachedConfigError, match="equal K and V"):
            MHATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, head_num=HEADS,
                             head_dim=DIM, v_head_dim=DIM // 2, layer_num=LAYERS, device="cpu",
                             enable_memory_saver=False)


def test_start_up_guard_names_each_unsupported_feature() -> None:
    from kvcached_core.integration.sglang.startup import refuse_unsupported

    refuse_unsupported(enable_memory_saver=False, custom_mem_pool=False,
                       post_capture_kv_sizing=False, hybrid_layers=False)
    with pytest.raises(KVCachedConfigError, match="memory-saver.*custom memory pool"):
        refuse_unsupported(enable_memory_saver=True, custom_mem_pool=True,
                           post_capture_kv_sizing=False, hybrid_layers=False)
    with pytest.raises(KVCachedConfigError, match="post-capture"):
        refuse_unsupported(enable_memory_saver=False, custom_mem_pool=False,
                           post_capture_kv_sizing=True, hybrid_layers=False)
