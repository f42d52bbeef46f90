"""Seam: the KV budget of vLLM 0.27 - 0.31, sized as stock and planned for the workers in
whole pages, as `kv_plan.py` does for 0.32 and later.

`EngineCore._initialize_kv_caches` has the same shape from 0.20 on: vLLM sizes the workers'
configs in one call (`get_kv_cache_configs`), the scheduler copies its own
(`generate_scheduler_kv_cache_config`), and `initialize_from_config` hands the configs to the
workers. What differs is how a release plans a worker's config for another block count (the
call its own `get_kv_cache_configs` makes to bring ranks to one count), so these variants
differ from 0.32's in `PLAN` only:

- 0.29 - 0.31 re-plan through `get_kv_cache_config_from_groups`, with the bytes of
  `_pool_bytes_per_block(groups)` (0.32 added `vllm_config` to that helper);
- 0.27 - 0.28 (and back to 0.11) scale each KVCacheTensor's size with the block count
  (`tensor.size // num_blocks_old * min_num_blocks`): their workers lay a buffer out from its
  size. `plan=None` asks kvcached_core to do the same (`kv_cache_configs_in_whole_pages`).

A module of its own, so that 0.32 - 0.34's fingerprints (which cover `kv_plan.py`) stay.
The range each variant is declared for is where its proof runs: the cells with a CPU build.
"""

from __future__ import annotations

from codemods.vllm.kv_plan import KVBudgetPlannedInWholePages


class KVBudgetPlannedForGroups(KVBudgetPlannedInWholePages):
    # vLLM 0.29 - 0.31: 0.32's planner, whose bytes-per-block helper takes the groups only.

    DESCRIPTION = ("EngineCore._initialize_kv_caches: KV budget sized as stock, the workers' "
                   "configs re-planned to whole kvcached pages by the release's own planner")
    PLAN = ("lambda groups, num_blocks: _kvcached_get_kv_cache_config_from_groups("
            "vllm_config, groups, num_blocks * _kvcached__pool_bytes_per_block(groups))")


class KVBudgetPlannedByScaling(KVBudgetPlannedInWholePages):
    # vLLM 0.27 - 0.28: a rank's config is re-planned by scaling its tensors' sizes.

    DESCRIPTION = ("EngineCore._initialize_kv_caches: KV budget sized as stock, the workers' "
                   "KV tensors scaled to whole kvcached pages as the release scales ranks")
    PLAN_IMPORTS = ()
    PLAN = "None"
