"""Seam: SGLang's MLA pool keeps its per-layer latent buffers in VMM-backed memory."""

from __future__ import annotations

from codemods.sglang._append import AppendElasticSubclass


class ElasticMLAPool(AppendElasticSubclass):
    DESCRIPTION = "Subclass MLATokenToKVPool so its latent buffers are views of kvcached tensors."
    ANCHOR = "MLATokenToKVPool"
    ELASTIC = "ElasticMLATokenToKVPool"
    MIXIN_MODULE = "kvcached_core.integration.sglang.pools"
    MIXIN = "ElasticMLAPoolMixin"
    DOC = "MLATokenToKVPool whose latent buffers are views of VMM-backed kvcached tensors."
    REQUIRED_METHODS = ("__init__", "_create_buffers", "_clear_buffers")
