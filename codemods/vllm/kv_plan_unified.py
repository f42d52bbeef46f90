"""Seam: the KV budget of vLLM 0.9 - 0.10, sized as stock and planned for the workers in whole
pages, as `kv_plan_older.py` does for 0.11 - 0.28.

Their `EngineCore._initialize_kv_caches` plans each rank itself (`get_kv_cache_config`, one call
per rank) and brings the ranks to one block count with `unify_kv_cache_configs`, which lowers
`num_blocks` but leaves each rank's tensor bytes as that rank sized them. The scheduler takes
`kv_cache_configs[0]` before `initialize_from_config` hands the configs to the workers, so the
rewrite is 0.11's (`KVBudgetPlannedByScaling`: each KV cache tensor scaled to the next
whole-page block count), but with `plan=RANKS_KEEP_THEIR_BYTES`: a tensor's bytes per block are
the model's page size, not its bytes over the common count. The guard differs too: this
release's core.py imports `unify_kv_cache_configs`, not `get_kv_cache_configs`, from the
planner's module, and a release that plans elsewhere matches one place instead of two. The
user's `kv_cache_memory_bytes` is read where the release has it (0.10.2 on; 0.9 sizes from the
profiled budget only).

A module of its own, so that the fingerprints of 0.11 - 0.34 (which cover `kv_plan.py` and
`kv_plan_older.py`) stay.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.helpers import get_full_name_for_node

from codemods.vllm.kv_plan_older import KVBudgetPlannedByScaling


class KVBudgetPlannedForUnifiedRanks(KVBudgetPlannedByScaling):
    # vLLM 0.9 - 0.10: ranks planned one by one, then unified (their tensors keep their bytes).

    DESCRIPTION = ("EngineCore._initialize_kv_caches: KV budget sized as stock, the workers' "
                   "KV tensors scaled to whole kvcached pages after the ranks are unified")
    PLAN = "_kvcached_vllm.RANKS_KEEP_THEIR_BYTES"
    USER_KV_BYTES = 'getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None)'

    def visit_Module(self, node: cst.Module) -> None:
        unify = m.ImportAlias(name=m.Name("unify_kv_cache_configs"))
        self._planner_imported = any(
            isinstance(imported, cst.ImportFrom) and imported.module is not None
            and get_full_name_for_node(imported.module) == self.PLANNER_MODULE
            and bool(m.findall(imported, unify))
            for imported in m.findall(node, m.ImportFrom()))
