"""Seam config-guard, 0.5.16: the settings are read from ``self.server_args``.

The guard of codemods/sglang/config_guard_swa.py (hybrid sliding-window models pass, Mamba
models do not), first in ``KVCacheConfigurator.configure``; only where it reads the settings
differs. Up to 0.5.16 the configurator holds the ``ServerArgs`` (``self.server_args``) and its
module imports no ``get_exec`` / ``get_memory`` (the grouped settings accessors of later
releases), so the later guard's calls would be undefined names there: the memory saver,
unified memory and the hierarchical cache are fields of ``self.server_args``. This variant
applies only to a module without ``get_exec`` whose configurator declares a ``server_args``
field.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang._method import (
    MethodScopedCodemod,
    body_statements,
    first_after_docstring,
    is_marked,
    statement,
    with_body,
)
from codemods.sglang.config_guard import MARKER, SWITCH_IMPORT

GUARD = """if _KVCACHED_ELASTIC_GUARD():
    from kvcached_core.integration.sglang.startup import refuse_unsupported

    refuse_unsupported(
        enable_memory_saver=self.server_args.enable_memory_saver,
        custom_mem_pool=envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get() is not None,
        post_capture_kv_sizing=self.post_capture_kv_active,
        mamba_layers=self.mambaish_config is not None,
        sliding_window=self.is_hybrid_swa,
        sliding_window_with={
            "--enable-unified-memory": self.server_args.enable_unified_memory,
            "--enable-hierarchical-cache": self.server_args.enable_hierarchical_cache,
            "an MLA attention backend": self.use_mla_backend,
            "speculative decoding": not self.spec_algorithm.is_none(),
        },
    )
"""
_SERVER_ARGS_FIELD = m.AnnAssign(target=m.Name("server_args"))


class RefuseUnsupportedAtConfigureServerArgs(MethodScopedCodemod):
    DESCRIPTION = ("Refuse memory saver (self.server_args), custom mem pool, post-capture "
                   "sizing and Mamba pools at start; hybrid sliding-window models pass.")
    CLASS = "KVCacheConfigurator"
    METHOD = "configure"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._holds_server_args = False

    def visit_Module(self, node: cst.Module) -> None:
        imports_get_exec = bool(m.findall(node, m.ImportAlias(name=m.Name("get_exec"))))
        configurators = [
            statement for statement in node.body
            if isinstance(statement, cst.ClassDef) and statement.name.value == self.CLASS
        ]
        self._holds_server_args = not imports_get_exec and any(
            m.findall(configurator.body, _SERVER_ARGS_FIELD) for configurator in configurators
        )

    def rewrite_target(self, node: cst.FunctionDef) -> cst.FunctionDef:
        statements = body_statements(node)
        if any(is_marked(s, MARKER) for s in statements):
            self.record_already_applied()
            return node
        if not self._holds_server_args:
            return node  # the settings moved: the build fails on the missing hit
        first = first_after_docstring(statements)
        statements[first:first] = [statement(SWITCH_IMPORT), statement(GUARD)]
        self.record_hit()
        return with_body(node, statements)
