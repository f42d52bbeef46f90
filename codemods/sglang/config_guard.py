"""Seam: configurations elastic KV memory cannot serve are refused when the pools are set up.

The first statement of ``KVCacheConfigurator.configure`` becomes a guard that, with elastic
memory on, stops start-up naming the memory saver, a custom memory pool, post-capture KV
sizing or hybrid (SWA / Mamba) pools. The call site passes what it knows in, so the adapter
does not read SGLang's globals.
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang._method import (
    MethodScopedCodemod,
    body_statements,
    first_after_docstring,
    is_marked,
    statement,
    with_body,
)

MARKER = "refuse_unsupported"
GUARD = """if _KVCACHED_ELASTIC_GUARD():
    from kvcached_core.integration.sglang.startup import refuse_unsupported

    refuse_unsupported(
        enable_memory_saver=get_exec().features.enable_memory_saver,
        custom_mem_pool=envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get() is not None,
        post_capture_kv_sizing=self.post_capture_kv_active,
        hybrid_layers=self.is_hybrid_swa or self.mambaish_config is not None,
    )
"""
SWITCH_IMPORT = ("from kvcached_core.integration.sglang import elastic_enabled as "
                 "_KVCACHED_ELASTIC_GUARD\n")


class RefuseUnsupportedAtConfigure(MethodScopedCodemod):
    DESCRIPTION = ("Refuse memory saver, custom mem pool, post-capture sizing and hybrid pools "
                   "at start.")
    CLASS = "KVCacheConfigurator"
    METHOD = "configure"

    def rewrite_target(self, node: cst.FunctionDef) -> cst.FunctionDef:
        statements = body_statements(node)
        if any(is_marked(s, MARKER) for s in statements):
            self.record_already_applied()
            return node
        first = first_after_docstring(statements)
        statements[first:first] = [statement(SWITCH_IMPORT), statement(GUARD)]
        self.record_hit()
        return with_body(node, statements)

