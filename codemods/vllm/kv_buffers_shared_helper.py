"""Seam: vLLM 0.34's one KV backing buffer, made by a helper that is not given its layout.

0.29 - 0.33 zero the buffer of every layer inside `vllm/v1/worker/utils.py:allocate_kv_cache`
(`vllm-kv-buffers-shared`). 0.34 moved that `torch.zeros(buf_size, dtype=torch.int8, ...)` into
`_allocate_kv_cache_buffer(raw_size, device)`, which sees neither the KVCacheConfig nor its
KVCacheTensors. So, as Model Runner V2's `_allocate_kv_cache` is handled in 0.24 - 0.28, the
helper gains a keyword (`kvcached_regions=()`) and its one caller passes each KVCacheTensor's
(offset, number of layers, layer stride, block stride): three places in all. The empty default is
never used (the helper has no other caller); with it the adapter would keep vLLM's own buffer.

0.34 also lets a caller hand `allocate_kv_cache` an `allocate` callable (vLLM's own extensible KV
cache, `enable_extensible_kv_cache`). That branch is left alone: with elastic mode on it makes no
VMM pool, and the scheduler's block pool then refuses to start
(`kvcached_core/integration/vllm/block_pool.py`), so nothing runs half-elastic.

A module of its own: the fingerprint of a codemod covers its module and what it imports, so the
older cells' KV-buffer variants (`kv_buffers.py`) keep theirs.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.vllm.kv_buffers import ModelRunnerV2KVBuffers, SharedKVBuffer, _names_bound_in

_REGIONS = "kvcached_regions"
# The caller's expression for the new keyword: the regions the 0.29 - 0.33 site passes.
_CALLER_REGIONS = SharedKVBuffer.EXTRA.removeprefix("regions=")
# The name that expression reads, which the caller must bind.
_CALLER_NEEDS = "kv_cache_config"


class SharedKVBufferFromCaller(ModelRunnerV2KVBuffers):
    DESCRIPTION = "_allocate_kv_cache_buffer: torch.zeros -> shared_kv_buffer (regions passed in)"
    FUNCTION_NAME = "_allocate_kv_cache_buffer"
    CALLER_NAME = "allocate_kv_cache"
    ADAPTER = "shared_kv_buffer"
    GROUPS = _REGIONS
    EXTRA = f"regions={_REGIONS}"

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        super().visit_FunctionDef(node)
        if node.name.value == self.CALLER_NAME:
            # The caller binds no `kvcached_regions`; it must bind what the regions are read from.
            self._caller_binds_groups[-1] = _CALLER_NEEDS in _names_bound_in(node)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        result = super().leave_Call(original_node, updated_node)
        if result is updated_node or not self._in_caller:
            return result
        # The base passed `kvcached_regions=kvcached_regions`: pass the regions themselves.
        passed = m.Arg(keyword=m.Name(_REGIONS), value=m.Name(_REGIONS))
        return result.with_changes(args=[
            arg.with_changes(value=cst.parse_expression(_CALLER_REGIONS))
            if m.matches(arg, passed) else arg for arg in result.args])
