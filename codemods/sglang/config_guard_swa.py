"""Seam config-guard from 0.5.21: hybrid sliding-window models pass, Mamba models do not.

The guard of ``config_guard`` (first statement of ``KVCacheConfigurator.configure``), where the
release's sliding-window allocator is elastic (``allocator_swa``): the call site tells the
adapter apart a hybrid sliding-window model (served) and a Mamba / linear-attention one
(refused), and names what would build other pools or allocators around the window layers
(unified memory, the hierarchical cache, an MLA backend, a speculative draft), each refused
with a sliding-window model.

Its rewrite is config_guard's with this guard; config_guard.py itself is left as it is, since its
source is part of the patch-set fingerprint of the cells it still serves (0.5.17 - 0.5.20).
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang._method import (
    body_statements,
    first_after_docstring,
    is_marked,
    statement,
    with_body,
)
from codemods.sglang.config_guard import MARKER, SWITCH_IMPORT, RefuseUnsupportedAtConfigure

GUARD = """if _KVCACHED_ELASTIC_GUARD():
    from kvcached_core.integration.sglang.startup import refuse_unsupported

    refuse_unsupported(
        enable_memory_saver=get_exec().features.enable_memory_saver,
        custom_mem_pool=envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get() is not None,
        post_capture_kv_sizing=self.post_capture_kv_active,
        mamba_layers=self.mambaish_config is not None,
        sliding_window=self.is_hybrid_swa,
        sliding_window_with={
            "--enable-unified-memory": get_memory().enable_unified_memory,
            "--enable-hierarchical-cache": get_memory().enable_hierarchical_cache,
            "an MLA attention backend": self.use_mla_backend,
            "speculative decoding": not self.spec_algorithm.is_none(),
        },
    )
"""


class RefuseUnsupportedAtConfigureSwa(RefuseUnsupportedAtConfigure):
    DESCRIPTION = ("Refuse memory saver, custom mem pool, post-capture sizing and Mamba pools "
                   "at start; hybrid sliding-window models pass.")

    def rewrite_target(self, node: cst.FunctionDef) -> cst.FunctionDef:
        statements = body_statements(node)
        if any(is_marked(s, MARKER) for s in statements):
            self.record_already_applied()
            return node
        first = first_after_docstring(statements)
        statements[first:first] = [statement(SWITCH_IMPORT), statement(GUARD)]
        self.record_hit()
        return with_body(node, statements)
