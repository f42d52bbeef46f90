"""Seam: the prefix cache is bounded after every request release, so idle memory returns.

``mem_cache/common.py::release_kv_cache`` is where every tree (UnifiedRadixCache, SGLang's
default, and RadixCache) takes over a finished request's KV and unpins it. Appending the bound
there caps what the tree keeps evictable at ``KVCACHED_MAX_CACHED_TOKENS``, whichever tree runs.
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang._method import (
    MethodScopedCodemod,
    body_statements,
    is_marked,
    statement,
    with_body,
)

MARKER = "bound_prefix_cache"
BOUND = """if _kvcached_sglang.ELASTIC:
    from kvcached_core.integration.sglang.prefix_cache import bound_prefix_cache

    bound_prefix_cache(tree_cache)
"""
SWITCH_IMPORT = "import kvcached_core.integration.sglang as _kvcached_sglang\n"


class BoundPrefixCacheOnRelease(MethodScopedCodemod):
    DESCRIPTION = "Evict the prefix cache down to KVCACHED_MAX_CACHED_TOKENS after each release."
    CLASS = ""
    METHOD = "release_kv_cache"

    def rewrite_target(self, node: cst.FunctionDef) -> cst.FunctionDef:
        statements = body_statements(node)
        if any(is_marked(s, MARKER) for s in statements):
            self.record_already_applied()
            return node
        statements += [statement(SWITCH_IMPORT), statement(BOUND)]
        self.record_hit()
        return with_body(node, statements)
