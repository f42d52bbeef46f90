"""Seams startup-free-memory and kv-profile-free-memory up to 0.5.15: both reads are the
model runner's.

The pre-load read is in ``ModelRunner.init_torch_distributed`` (srt/model_executor/
model_runner.py; 0.5.16 moved it to srt/distributed/bootstrap.py), the KV-profile read in
``ModelRunnerKVCacheMixin._profile_available_bytes`` (0.5.16: ``KVCacheConfigurator``). The
rewrite is that of codemods/sglang/startup_memory.py. A draft worker is the runner's
``self.is_draft_worker`` here rather than a parameter of the function, so the pre-load read
passes ``startup_window=None if self.is_draft_worker else "begin"``, and applies only where the
runner sets that attribute.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang.startup_memory import _ElasticFreeMemory

_DRAFT = m.Attribute(value=m.Name("self"), attr=m.Name("is_draft_worker"))


class ElasticPreModelLoadMemoryModelRunner(_ElasticFreeMemory):
    DESCRIPTION = ("ModelRunner.init_torch_distributed: get_available_gpu_memory(distributed=...) "
                   "through elastic_free_memory_gb(..., startup_window=\"begin\" unless "
                   "self.is_draft_worker)")
    CLASS = "ModelRunner"
    METHOD = "init_torch_distributed"
    STARTUP_WINDOW = "begin"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._runner_knows_drafts = False

    def visit_Module(self, node: cst.Module) -> None:
        self._runner_knows_drafts = bool(m.findall(
            node, m.AssignTarget(target=_DRAFT) | m.AnnAssign(target=_DRAFT)))

    def _window_value(self) -> cst.BaseExpression:
        return cst.IfExp(test=cst.Attribute(value=cst.Name("self"),
                                            attr=cst.Name("is_draft_worker")),
                         body=cst.Name("None"), orelse=super()._window_value())

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not self._runner_knows_drafts:
            return updated_node  # the anchor changed: the build fails on the missing hit
        return super().leave_Call(original_node, updated_node)


class ElasticKVProfileMemoryModelRunner(_ElasticFreeMemory):
    DESCRIPTION = ("ModelRunnerKVCacheMixin._profile_available_bytes: "
                   "get_available_gpu_memory(distributed=...) through "
                   "elastic_free_memory_gb(..., startup_window=\"end\")")
    CLASS = "ModelRunnerKVCacheMixin"
    METHOD = "_profile_available_bytes"
    STARTUP_WINDOW = "end"
