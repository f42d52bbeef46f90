"""Seam config-guard up to 0.5.15: the guard opens the model runner's ``init_memory_pool``.

Before 0.5.16 there is no ``KVCacheConfigurator``: ``ModelRunnerKVCacheMixin.init_memory_pool``
(srt/model_executor/model_runner_kv_cache_mixin.py) sizes and builds the pools, for a target
and for a draft worker alike, so the guard of codemods/sglang/config_guard.py goes first in it.
The runner holds the ``ServerArgs`` (the memory-saver flag) and knows whether its layers are
hybrid; post-capture KV sizing does not exist yet, so the guard says so with a literal
``False``. It applies only to a module that imports ``envs`` (the custom-memory-pool setting)
and no ``get_exec``.
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang._guard import InsertGuardFirst, imports_name

GUARD = """if _KVCACHED_ELASTIC_GUARD():
    from kvcached_core.integration.sglang.startup import refuse_unsupported

    refuse_unsupported(
        enable_memory_saver=self.server_args.enable_memory_saver,
        custom_mem_pool=envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get() is not None,
        post_capture_kv_sizing=False,
        hybrid_layers=self.is_hybrid_swa or self.mambaish_config is not None,
    )
"""


class RefuseUnsupportedAtInitMemoryPool(InsertGuardFirst):
    DESCRIPTION = ("Refuse memory saver, custom mem pool and hybrid pools first in the model "
                   "runner's init_memory_pool.")
    CLASS = "ModelRunnerKVCacheMixin"
    METHOD = "init_memory_pool"
    GUARD = GUARD

    def settings_fit(self, module: cst.Module) -> bool:
        return imports_name(module, "envs") and not imports_name(module, "get_exec")
