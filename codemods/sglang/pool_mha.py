"""Seam: SGLang's MHA pool keeps its fused per-layer K/V buffers in VMM-backed memory."""

from __future__ import annotations

from codemods.sglang._append import AppendElasticSubclass


class ElasticMHAPool(AppendElasticSubclass):
    DESCRIPTION = "Subclass MHATokenToKVPool so its K/V buffers are views of kvcached tensors."
    ANCHOR = "MHATokenToKVPool"
    ELASTIC = "ElasticMHATokenToKVPool"
    MIXIN_MODULE = "kvcached_core.integration.sglang.pools"
    MIXIN = "ElasticMHAPoolMixin"
    DOC = "MHATokenToKVPool whose K/V buffers are views of VMM-backed kvcached tensors."
    REQUIRED_METHODS = (
        "__init__", "_create_buffers", "_create_buffers_normal", "_kv_buffer_shapes",
        "_init_data_ptrs_and_strides", "_clear_buffers",
    )
