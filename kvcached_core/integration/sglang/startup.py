"""What the rewritten KV-cache configurator calls: the capacity budget and the start-up guard."""

from __future__ import annotations

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.sglang.switch import sglang_settings


def kv_budget_bytes(profiled_bytes: int) -> int:
    """The KV byte budget the pools are sized from.

    SGLang profiles the memory free at start. With elastic pools the budget is what kvcached
    may map for this engine: `KVCACHED_PHYSICAL_LIMIT` when set (never more than profiled),
    else the profiled figure. Either way the whole logical capacity can be backed, which is
    what lets the allocator report logical free space to the scheduler.
    """
    settings = sglang_settings()
    limit = settings.physical_limit_bytes
    if not settings.enabled or limit is None:
        return profiled_bytes
    return min(profiled_bytes, limit)


def refuse_unsupported(
    *,
    enable_memory_saver: bool,
    custom_mem_pool: bool,
    post_capture_kv_sizing: bool,
    hybrid_layers: bool,
) -> None:
    """Stop start-up, with the reason and the way out, on a configuration elastic pools break."""
    reasons = []
    if enable_memory_saver:
        reasons.append("--enable-memory-saver (torch_memory_saver owns the KV memory)")
    if custom_mem_pool:
        reasons.append("a custom memory pool (SGLANG_MOONCAKE_CUSTOM_MEM_POOL)")
    if post_capture_kv_sizing:
        reasons.append(
            "post-capture KV sizing (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING resizes the pool "
            "after graph capture)"
        )
    if hybrid_layers:
        reasons.append("hybrid sliding-window or linear-attention (Mamba) KV pools")
    if reasons:
        raise KVCachedConfigError(
            "kvcached: elastic KV memory (KVCACHED_ENABLE=1) does not support "
            + "; ".join(reasons)
            + ". Turn that off or set KVCACHED_ENABLE=0."
        )

