"""Seam on EngineCore: the engine's executor, for workers the scheduler reaches only through it.

`_initialize_kv_caches` gets a decorator that, while it runs, hands kvcached the engine's
executor (`self.model_executor`). The KV budget called inside it (the kv-budget seam) then tells
the Ray executor's workers their job through the executor's own `collective_rpc`, and the
scheduler's pool maps and unmaps their pages through it, wherever in the Ray cluster they run.
`_initialize_kv_caches` is a method of `EngineCore` in `vllm/v1/engine/core.py` in every cell
that declares this seam.
"""

from __future__ import annotations

from codemods.vllm._common import DecorateMethods


class KVSizedWithExecutor(DecorateMethods):
    DESCRIPTION = "EngineCore._initialize_kv_caches: the KV budget may use the executor's RPC"
    CLASS_NAME = "EngineCore"
    DECORATORS = {"_initialize_kv_caches": "_kvcached_vllm.kv_caches_sized_with_executor"}
