"""Seam config-guard, 0.5.2: the runner's first linear-attention hybrids, before
``mambaish_config``.

0.5.2 builds linear-attention (GDN) pools for Qwen3-Next, which the runner names with its
``is_hybrid_gdn`` property; ``mambaish_config`` (read by the guard from 0.5.3) does not exist yet.
The guard of codemods/sglang/model_runner_sizing.py goes first in ``ModelRunner.init_memory_pool``
and names both hybrids: sliding-window (``is_hybrid``) and GDN. It applies only where the runner
reads ``self.is_hybrid_gdn`` and not ``self.mambaish_config``, with the settings the other runner
guards need (``get_bool_env_var`` imported, no ``envs``).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang.model_runner_sizing import (
    _GUARD,
    RefuseUnsupportedAtRunnerInitMemoryPoolBeforeMamba,
)

_GDN = m.Attribute(value=m.Name("self"), attr=m.Name("is_hybrid_gdn"))


class RefuseUnsupportedAtRunnerInitMemoryPoolGdn(
        RefuseUnsupportedAtRunnerInitMemoryPoolBeforeMamba):
    DESCRIPTION = ("Refuse memory saver, custom mem pool, sliding-window and GDN hybrids first "
                   "in ModelRunner.init_memory_pool (no mambaish_config yet).")
    GUARD = _GUARD.format(hybrid="self.is_hybrid or self.is_hybrid_gdn")

    def settings_fit(self, module: cst.Module) -> bool:
        return super().settings_fit(module) and bool(m.findall(module, _GDN))
