"""Seam mha-pool up to 0.5.15: K and V are allocated inline in ``_create_buffers``.

Before 0.5.16 split ``_create_buffers`` into per-layout helpers (``_create_buffers_normal``
and the quantized and post-capture paths), the pool allocated each layer's K and V apart
inside ``_create_buffers`` itself and derived the pointer and stride tables from them there.
This variant subclasses such a pool (no ``_create_buffers_normal``, V a per-layer list of
allocations of its own: codemods/sglang/_kv_layout.py reads the same statements from the
later method) with a mixin that replaces the whole method.
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang._append import AppendElasticSubclass
from codemods.sglang._kv_layout import _method, mha_kv_layout


def _inline_kv_layout(node: cst.ClassDef) -> str:
    """The K/V layout of ``_create_buffers`` read as if it were ``_create_buffers_normal``."""
    create = _method(node, "_create_buffers")
    if create is None or _method(node, "_create_buffers_normal") is not None:
        return "unknown"
    return mha_kv_layout(node.with_changes(body=node.body.with_changes(
        body=[create.with_changes(name=cst.Name("_create_buffers_normal"))])))


class ElasticMHAInlineBuffersPool(AppendElasticSubclass):
    DESCRIPTION = ("Subclass MHATokenToKVPool (K and V allocated inline in _create_buffers) so "
                   "each buffer is a view of a kvcached tensor.")
    ANCHOR = "MHATokenToKVPool"
    ELASTIC = "ElasticMHATokenToKVPool"
    MIXIN_MODULE = "kvcached_core.integration.sglang.pools"
    MIXIN = "ElasticMHAInlineBuffersPoolMixin"
    DOC = ("MHATokenToKVPool whose K and V buffers, allocated in _create_buffers, are views "
           "of VMM-backed kvcached tensors.")
    REQUIRED_METHODS = ("__init__", "_create_buffers", "_clear_buffers")

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        return _inline_kv_layout(node) == "separate"
