"""Seam: the KV budget of vLLM 0.32+, sized as stock and planned for the workers in whole pages.

`vllm-kv-budget-user-bytes` rounds the KV bytes vLLM sizes from up to whole kvcached pages of
blocks, because a layer-outermost KV buffer puts layer `l` at `l * num_blocks * block` bytes and
one pool can back it page by page only if those regions are whole pages. The scheduler then has
more blocks than stock vLLM for a small `kv_cache_memory_bytes`, and starts where stock vLLM
refuses. From 0.32, `EngineCore._initialize_kv_caches` plans the workers' KV caches in one call
whose result the scheduler has already copied (`generate_scheduler_kv_cache_config`) before
`self.model_executor.initialize_from_config(kv_cache_configs)` hands it to the workers. So:

- `kv_cache_budget(...)` is called as before, with `planned_in_whole_pages=True`: it leaves the
  bytes as they are, and vLLM's own check, fitted `max_model_len` and block count are stock's;
- the configs handed to `initialize_from_config` go through `kv_cache_configs_in_whole_pages`,
  which re-plans each for the next whole-page block count with vLLM's own planner, the one
  `get_kv_cache_configs` calls to bring ranks to one block count. Where that planner lives is
  the one difference between releases (`PLAN`). Each variant rewrites only a module that
  imports `get_kv_cache_configs` from the planner's own module (`PLANNER_MODULE`), so a
  release whose planning lives elsewhere matches one place instead of two and is refused.

A module of its own: the fingerprint of a codemod covers its module and what it imports, so the
older cells' budget codemods (`engine_core.py`) keep theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.codemod.visitors import AddImportsVisitor

from codemods.vllm._common import is_adapter_call
from codemods.vllm.engine_core import KVCacheBudgetWithUserBytes

_PLAN_ADAPTER = "kv_cache_configs_in_whole_pages"
_INITIALIZE = m.Call(func=m.Attribute(
    value=m.Attribute(value=m.Name("self"), attr=m.Name("model_executor")),
    attr=m.Name("initialize_from_config")), args=[m.Arg(keyword=None)])


class KVBudgetPlannedInWholePages(KVCacheBudgetWithUserBytes):
    # vLLM 0.32: the planner is `kv_cache_utils.get_kv_cache_config_from_groups`, given bytes
    # (`num_blocks` times `_pool_bytes_per_block`, as its own re-plan computes them).

    DESCRIPTION = ("EngineCore._initialize_kv_caches: KV budget sized as stock, the workers' "
                   "configs re-planned to whole kvcached pages")
    #: Where `EngineCore` imports `get_kv_cache_configs` from: the planner's module.
    PLANNER_MODULE = "vllm.v1.core.kv_cache_utils"
    #: (module, name) pairs the plan expression reads, imported under `_kvcached_` aliases.
    PLAN_IMPORTS: tuple[tuple[str, str], ...] = (
        ("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups"),
        ("vllm.v1.core.kv_cache_utils", "_pool_bytes_per_block"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        planner = m.ImportFrom(module=_dotted(self.PLANNER_MODULE))
        self._planner_imported = any(
            isinstance(imported, cst.ImportFrom) and isinstance(imported.names, Sequence)
            and any(m.matches(alias, m.ImportAlias(name=m.Name("get_kv_cache_configs")))
                    for alias in imported.names)
            for imported in m.findall(node, planner))
    PLAN = ("lambda groups, num_blocks: _kvcached_get_kv_cache_config_from_groups("
            "vllm_config, groups, num_blocks * _kvcached__pool_bytes_per_block(vllm_config, "
            "groups))")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if self._method is not None and m.matches(updated_node, _INITIALIZE):
            return self._planned(updated_node) if self._planner_imported else updated_node
        result = super().leave_Call(original_node, updated_node)
        if result is not updated_node and is_adapter_call(result, "kv_cache_budget"):
            assert isinstance(result, cst.Call)
            flag = cst.Arg(keyword=cst.Name("planned_in_whole_pages"), value=cst.Name("True"),
                           equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                 whitespace_after=cst.SimpleWhitespace("")))
            return result.with_changes(args=[*result.args, flag])
        return result

    def _planned(self, call: cst.Call) -> cst.Call:
        (configs,) = call.args
        if is_adapter_call(configs.value, _PLAN_ADAPTER):
            self.record_already_applied()
            return call
        self.record_hit()
        for module, name in self.PLAN_IMPORTS:
            AddImportsVisitor.add_needed_import(self.context, module, name, f"_kvcached_{name}")
        wrapper = cst.parse_expression(
            f"_kvcached_vllm.{_PLAN_ADAPTER}(__CONFIGS__, vllm_config=vllm_config, "
            f"plan={self.PLAN})")
        assert isinstance(wrapper, cst.Call)
        wrapped = wrapper.with_changes(args=[cst.Arg(value=configs.value), *wrapper.args[1:]])
        return call.with_changes(args=[configs.with_changes(value=wrapped)])


def _dotted(module: str) -> m.Attribute | m.Name:
    """A matcher of the dotted name `module` in an import."""
    *parents, last = module.split(".")
    if not parents:
        return m.Name(last)
    return m.Attribute(value=_dotted(".".join(parents)), attr=m.Name(last))


class KVBudgetPlannedByBuilder(KVBudgetPlannedInWholePages):
    # vLLM 0.33 - 0.34: planning moved to `kv_cache_planning`, behind the builder
    # `kv_cache_config_builder.get_kv_cache_config_builder` returns, whose
    # `get_kv_cache_config_from_groups` takes the block count itself.

    DESCRIPTION = ("EngineCore._initialize_kv_caches: KV budget sized as stock, the workers' "
                   "configs re-planned to whole kvcached pages by the KV cache config builder")
    PLANNER_MODULE = "vllm.v1.core.kv_cache_planning"
    PLAN_IMPORTS = (("vllm.v1.core.kv_cache_config_builder", "get_kv_cache_config_builder"),)
    PLAN = ("lambda groups, num_blocks: _kvcached_get_kv_cache_config_builder(vllm_config)"
            ".get_kv_cache_config_from_groups(vllm_config, groups, num_blocks)")
