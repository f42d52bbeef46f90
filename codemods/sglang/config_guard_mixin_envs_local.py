"""Seam config-guard, 0.5.7 - 0.5.9: the model runner's KV mixin, which imports no ``envs``.

From 0.5.7 ``ModelRunnerKVCacheMixin.init_memory_pool``
(srt/model_executor/model_runner_kv_cache_mixin.py) sizes and builds the pools, as it does up to
0.5.15, but until 0.5.10 its module does not import ``envs``: the custom memory pool setting
(``SGLANG_MOONCAKE_CUSTOM_MEM_POOL``, a string setting of ``sglang.srt.environ`` since 0.5.7) is
read elsewhere (``mem_cache/utils.py``). The guard of codemods/sglang/config_guard_model_runner.py
goes first in the method, importing ``envs`` itself. It applies only to a module that imports
none of ``envs``, ``get_exec`` or ``get_bool_env_var`` (the 0.5.6 runner's boolean setting).
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang._guard import InsertGuardFirst, imports_name

GUARD = """if _KVCACHED_ELASTIC_GUARD():
    from kvcached_core.integration.sglang.startup import refuse_unsupported
    from sglang.srt.environ import envs as _kvcached_envs

    refuse_unsupported(
        enable_memory_saver=self.server_args.enable_memory_saver,
        custom_mem_pool=_kvcached_envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get() is not None,
        post_capture_kv_sizing=False,
        hybrid_layers=self.is_hybrid_swa or self.mambaish_config is not None,
    )
"""


class RefuseUnsupportedAtInitMemoryPoolEnvsLocal(InsertGuardFirst):
    DESCRIPTION = ("Refuse memory saver, custom mem pool and hybrid pools first in the model "
                   "runner's init_memory_pool (envs imported by the guard).")
    CLASS = "ModelRunnerKVCacheMixin"
    METHOD = "init_memory_pool"
    GUARD = GUARD

    def settings_fit(self, module: cst.Module) -> bool:
        return not any(imports_name(module, name)
                       for name in ("envs", "get_exec", "get_bool_env_var"))
