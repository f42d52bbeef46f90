"""The patched MHA and MLA pools: SGLang's buffer shapes and strides on VMM-backed memory."""

from __future__ import annotations

import pytest
import torch
from conftest import DIM, HEADS, LAYERS, make_mha_pool, make_mla_pool

from kvcached_core.errors import KVCachedConfigError


def test_mha_buffers_keep_the_stock_fused_layout() -> None:
    from sglang.srt.mem_cache.memory_pool import ElasticMHATokenToKVPool, MHATokenToKVPool

    assert MHATokenToKVPool is ElasticMHATokenToKVPool
    pool = make_mha_pool(1023)
    assert len(pool.k_buffer) == len(pool.v_buffer) == LAYERS
    for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True):
        assert k.shape == v.shape == (1024, HEADS, DIM)
        assert k.stride() == v.stride() == (HEADS * DIM, DIM, 1)
        assert k.dtype == torch.bfloat16
        # V is the second half of the same per-layer allocation, a whole number of rows on.
        delta = v.data_ptr() - k.data_ptr()
        assert delta > 0 and delta % (k.stride(0) * k.element_size()) == 0
    assert pool.k_data_ptrs.tolist() == [k.data_ptr() for k in pool.k_buffer]
    assert pool.v_data_ptrs.tolist() == [v.data_ptr() for v in pool.v_buffer]


def test_mha_set_and_get_through_sglang() -> None:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    pool = make_mha_pool(1023)
    allocator = TokenToKVPoolAllocator(1023, torch.bfloat16, "cpu", pool, False)
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
    pool = make_mla_pool(1023)
    for buffer in pool.kv_buffer:
        assert buffer.shape == (1024, 1, 32) and buffer.stride() == (32, 32, 1)
    assert pool.data_ptrs.tolist() == [b.data_ptr() for b in pool.kv_buffer]


def test_unsupported_pool_configurations_are_refused() -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    with pytest.raises(KVCachedConfigError, match="post-capture"):
        MHATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, head_num=HEADS,
                         head_dim=DIM, layer_num=LAYERS, device="cpu",
                         enable_memory_saver=False, post_capture_active=True)
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
