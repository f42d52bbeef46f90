"""Seam prefix-cache-bound up to 0.5.5: the bound follows the radix tree's own release.

Before ``mem_cache/common.py::release_kv_cache`` gathered it, each tree took over a finished
request's KV in its own ``cache_finished_req``, called from a dozen scheduler sites. The one
tree an elastic engine runs there is ``RadixCache`` (hierarchical and LMCache trees inherit or
call its method; the hybrid trees are refused by the config guard), so the bound goes at the end
of ``RadixCache.cache_finished_req``: after the request is inserted and its lock released, the
tree evicts down to ``KVCACHED_MAX_CACHED_TOKENS`` by token count, the eviction API of this
release (kvcached_core/integration/sglang/prefix_cache.py, ``bound_radix_tree``).
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
from codemods.sglang.prefix_cache_bound import SWITCH_IMPORT

MARKER = "bound_radix_tree"
BOUND = """if _kvcached_sglang.ELASTIC:
    from kvcached_core.integration.sglang.prefix_cache import bound_radix_tree

    bound_radix_tree(self)
"""


class BoundRadixTreeOnFinishedRequest(MethodScopedCodemod):
    DESCRIPTION = ("Evict RadixCache down to KVCACHED_MAX_CACHED_TOKENS at the end of each "
                   "cache_finished_req.")
    CLASS = "RadixCache"
    METHOD = "cache_finished_req"

    def rewrite_target(self, node: cst.FunctionDef) -> cst.FunctionDef:
        statements = body_statements(node)
        if any(is_marked(s, MARKER) for s in statements):
            self.record_already_applied()
            return node
        statements += [statement(SWITCH_IMPORT), statement(BOUND)]
        self.record_hit()
        return with_body(node, statements)
