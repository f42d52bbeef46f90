"""The ranks of one SGLang engine deciding together what fits.

SGLang runs a scheduler on every rank of a tensor-parallel engine (one node or several, with
`--nnodes`) and relies on every rank taking the same decisions from the same batch: admission,
eviction before an allocation, retraction and the decode check each read the rank's own
allocator, and only the pools' sizes are agreed, once, at start. An elastic pool's answers are
not the same on every rank: each rank has its own limit record, and races its own neighbours
for its device or its budget. Ranks that decided differently would desynchronise (a collective
that waits for ever, or batches of different requests whose partial sums are added).

So the ranks agree at the two places where an elastic answer can differ between them:

- what an allocation can take now (`_ElasticLedger.allocatable_pages`): every rank offers its
  own figure and all take the smallest, so every gate reads the same number and the most
  constrained rank binds the engine (a `kvctl limit` on any one rank's pool limits them all);
- whether an allocation succeeded (`_ElasticLedger.take`): a rank that could not map its pages
  (a neighbour spent the budget first) makes every rank give its pages back and report the
  same refusal.

Both are one all-reduce on SGLang's tensor-parallel CPU (gloo) group. It is correct because
SGLang calls the allocator at the same points, in the same order, on every rank: requests
reach every rank through one broadcast and every rank schedules the same batches. That holds
for the ranks of a tensor-parallel group only; pipeline stages, data-parallel attention and
attention context parallelism give ranks different batches or different sequences' slices,
and are refused when the first elastic pool is built.
"""

from __future__ import annotations

from typing import Any

from kvcached_core.errors import KVCachedConfigError


class RankAgreement:
    """Collectives over the CPU group of ranks that share every batch."""

    def __init__(self, group: Any, ranks: int) -> None:
        self.group = group
        self.ranks = ranks

    def least(self, value: int) -> int:
        """The smallest `value` any rank offers (every rank calls this at the same point)."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def all_succeeded(self, succeeded: bool) -> bool:
        """Whether every rank succeeded."""
        return self.least(1 if succeeded else 0) == 1


def distributed_world_size() -> int:
    """Ranks of this engine's torch.distributed world (1 before it exists or without one)."""
    import torch.distributed as dist

    return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1


def _ranks_not_sharing_batches(ranks: int) -> str | None:
    """Why not every rank of the world schedules the same batches, or None when they do.

    Asked of the release's own parallel state; a release that cannot answer is treated as
    not sharing them (refused rather than guessed)."""
    try:
        from sglang.srt.distributed import parallel_state
        from sglang.srt.layers import dp_attention
    except ImportError as missing:
        return f"its parallel state cannot be read ({missing})"
    if parallel_state.get_pp_group().world_size > 1:
        return "pipeline parallelism"
    if parallel_state.get_tp_group().world_size != ranks:
        return "ranks outside tensor parallelism"
    if hasattr(dp_attention, "is_dp_attention_enabled"):  # 0.5.5 and later
        data_parallel_attention = bool(dp_attention.is_dp_attention_enabled())
    elif hasattr(dp_attention, "get_attention_dp_size"):  # 0.4.10
        data_parallel_attention = int(dp_attention.get_attention_dp_size()) > 1
    else:
        return "its data-parallel attention setting cannot be read"
    if data_parallel_attention:
        return "data-parallel attention"
    context_group = getattr(parallel_state, "get_attn_cp_group", None)  # 0.5.16 and later
    if context_group is not None and context_group().world_size > 1:
        return "attention context parallelism"
    return None


def engine_rank_agreement() -> RankAgreement | None:
    """The agreement of this engine's ranks, None for an engine of one rank; refuses, in one
    line, an engine whose ranks do not all schedule the same batches.

    Called where each elastic pool is built (every rank builds its pools at the same point)."""
    ranks = distributed_world_size()
    if ranks == 1:
        return None
    reason = _ranks_not_sharing_batches(ranks)
    if reason is not None:
        from kvcached_core.limits import engine_of_this_process

        cell = engine_of_this_process() or "this build"
        raise KVCachedConfigError(
            f"kvcached: elastic KV memory (KVCACHED_ENABLE=1) in {cell} supports an SGLang "
            f"engine over {ranks} ranks only as one tensor-parallel group, not with {reason} "
            "(its ranks schedule different batches and could not agree on what fits); set "
            "KVCACHED_ENABLE=0"
        )
    from sglang.srt.distributed import parallel_state

    return RankAgreement(parallel_state.get_tp_group().cpu_group, ranks)
