"""Seam capacity up to 0.5.15: the KV budget is profiled by the model runner's KV mixin.

``ModelRunnerKVCacheMixin._profile_available_bytes`` (srt/model_executor/
model_runner_kv_cache_mixin.py) returns the byte budget the pool configurator sizes every pool
from; 0.5.16 moved it into ``KVCacheConfigurator``. The rewrite is that of
codemods/sglang/capacity.py: each ``return`` value goes through ``kv_budget_bytes``.
"""

from __future__ import annotations

from codemods.sglang.capacity import KVBudgetCapacity


class KVBudgetCapacityModelRunner(KVBudgetCapacity):
    DESCRIPTION = ("Pass every KV budget ModelRunnerKVCacheMixin profiles through kvcached's "
                   "budget.")
    CLASS = "ModelRunnerKVCacheMixin"
    METHOD = "_profile_available_bytes"
