"""Seam: a lost race for the last physical page ends as "no blocks" in `allocate_slots`.

`KVCacheManager.allocate_slots` gets the adapter's `none_on_pool_exhausted` decorator: on
PoolExhausted it rolls back every block the call added to the request and returns None, which
the scheduler already treats as "preempt or wait". Any other error propagates.
"""

from __future__ import annotations

from codemods.vllm._common import DecorateMethods


class NoneOnPoolExhausted(DecorateMethods):
    DESCRIPTION = "KVCacheManager.allocate_slots: PoolExhausted -> rollback, return None"
    CLASS_NAME = "KVCacheManager"
    DECORATORS = {"allocate_slots": "_kvcached_vllm.none_on_pool_exhausted"}
