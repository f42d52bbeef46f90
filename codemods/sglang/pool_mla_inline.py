"""Seam mla-pool up to 0.5.5: the latent buffers are allocated inline in ``__init__``.

Until 0.5.6 gave ``MLATokenToKVPool`` a ``_create_buffers`` method, its ``__init__`` allocates
every layer's latent buffer itself (and the FP4 scale buffers beside them), between setting
fields the rest of the class reads. No method can be overridden to place those buffers in
VMM-backed memory without copying the constructor, so this variant does not make the pool
elastic: its mixin stops an elastic engine when the pool is built, before a byte is allocated,
with the way out. A stock engine (``KVCACHED_ENABLE=0``) keeps the class as it is. It applies
only to a class without ``_create_buffers`` whose ``__init__`` assigns ``self.kv_buffer``.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang._append import AppendElasticSubclass

_KV_BUFFER = m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("kv_buffer")))


class RefuseInlineMLAPool(AppendElasticSubclass):
    DESCRIPTION = ("Subclass MLATokenToKVPool (latent buffers allocated in __init__) so an "
                   "elastic engine refuses it.")
    ANCHOR = "MLATokenToKVPool"
    ELASTIC = "ElasticMLATokenToKVPool"
    MIXIN_MODULE = "kvcached_core.integration.sglang.pools"
    MIXIN = "RefuseInlineMLAPoolMixin"
    DOC = ("MLATokenToKVPool of a release that allocates its latent buffers in __init__: "
           "refused with elastic KV memory.")
    REQUIRED_METHODS = ("__init__",)

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        methods = {statement.name.value: statement for statement in node.body.body
                   if isinstance(statement, cst.FunctionDef)}
        return ("_create_buffers" not in methods
                and bool(m.findall(methods["__init__"], _KV_BUFFER)))
