"""Seam: the coordinator's `BlockPool(...)` becomes the adapter's elastic pool.

`self.block_pool = BlockPool(args...)` in `KVCacheCoordinator.__init__` becomes
`self.block_pool = _kvcached_vllm.make_block_pool(BlockPool, args...)`: the same arguments,
forwarded, so the rewrite holds whatever the constructor takes in a given version.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.vllm._common import MethodCodemod, adapter_attr, is_adapter_call


class ElasticBlockPoolConstruction(MethodCodemod):
    DESCRIPTION = "KVCacheCoordinator.__init__: BlockPool(...) -> make_block_pool(BlockPool, ...)"
    CLASS_NAME = "KVCacheCoordinator"

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not self.in_target_class():
            return updated_node
        if is_adapter_call(updated_node, "make_block_pool"):
            self.record_already_applied()
            return updated_node
        if not m.matches(updated_node.func, m.Name("BlockPool")):
            return updated_node
        self.record_hit()
        first = cst.Arg(value=cst.Name("BlockPool"))
        return updated_node.with_changes(func=adapter_attr("make_block_pool"),
                                         args=[first, *updated_node.args])
