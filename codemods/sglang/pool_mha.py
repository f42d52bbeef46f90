"""Seam: SGLang's MHA pool keeps its per-layer K/V buffers in VMM-backed memory.

Two variants, one per K/V layout of the release (codemods/sglang/_kv_layout.py): each applies
only to a pool whose source has its layout, so a release that changes the layout fails the
build instead of getting buffers laid out unlike its own.
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang._append import AppendElasticSubclass
from codemods.sglang._kv_layout import mha_kv_layout

_REQUIRED_METHODS = (
    "__init__", "_create_buffers", "_create_buffers_normal", "_kv_buffer_shapes",
    "_init_data_ptrs_and_strides", "_clear_buffers",
)


class ElasticMHAPool(AppendElasticSubclass):
    DESCRIPTION = "Subclass MHATokenToKVPool so its K/V buffers are views of kvcached tensors."
    ANCHOR = "MHATokenToKVPool"
    ELASTIC = "ElasticMHATokenToKVPool"
    MIXIN_MODULE = "kvcached_core.integration.sglang.pools"
    MIXIN = "ElasticMHAPoolMixin"
    DOC = "MHATokenToKVPool whose K/V buffers are views of VMM-backed kvcached tensors."
    REQUIRED_METHODS = _REQUIRED_METHODS

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        return mha_kv_layout(node) == "fused"


class ElasticMHASeparateKVPool(AppendElasticSubclass):
    DESCRIPTION = ("Subclass MHATokenToKVPool (K and V allocated apart) so each buffer is a "
                   "view of a kvcached tensor.")
    ANCHOR = "MHATokenToKVPool"
    ELASTIC = "ElasticMHATokenToKVPool"
    MIXIN_MODULE = "kvcached_core.integration.sglang.pools"
    MIXIN = "ElasticMHASeparateKVPoolMixin"
    DOC = ("MHATokenToKVPool whose separately allocated K and V buffers are views of "
           "VMM-backed kvcached tensors.")
    REQUIRED_METHODS = _REQUIRED_METHODS

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        return mha_kv_layout(node) == "separate"
