"""Seam config-guard, 0.5.6: the runner still builds the pools, with 0.5.7's settings.

0.5.6 is the last release whose ``ModelRunner.init_memory_pool`` (srt/model_executor/
model_runner.py) sizes and builds the pools itself, but its runner already calls its
sliding-window hybrids ``is_hybrid_swa`` (``is_hybrid`` up to 0.5.5) and the custom memory pool
setting is a string of ``sglang.srt.environ`` (``envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL``, the
pool type; a boolean up to 0.5.5), which the runner's module does not import. The guard of
codemods/sglang/config_guard_mixin_envs_local.py (0.5.7's, importing ``envs`` itself and
naming both hybrids) goes first in the method. It applies only where the runner reads
``self.is_hybrid_swa`` and ``self.mambaish_config``, with the module shape the other runner
guards need.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang.config_guard_mixin_envs_local import GUARD
from codemods.sglang.model_runner_sizing import RefuseUnsupportedAtRunnerInitMemoryPool

_SWA = m.Attribute(value=m.Name("self"), attr=m.Name("is_hybrid_swa"))


class RefuseUnsupportedAtRunnerInitMemoryPoolSwa(RefuseUnsupportedAtRunnerInitMemoryPool):
    DESCRIPTION = ("Refuse memory saver, custom mem pool and hybrid pools first in "
                   "ModelRunner.init_memory_pool (is_hybrid_swa, envs imported by the guard).")
    GUARD = GUARD

    def settings_fit(self, module: cst.Module) -> bool:
        return super().settings_fit(module) and bool(m.findall(module, _SWA))
