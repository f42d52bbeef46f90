"""What SGLang's rewritten start-up code calls: the capacity budget, the start-up guard, and
the free-memory figure its start-up checks compare."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.sglang.switch import elastic_enabled, sglang_settings
from kvcached_core.startup_memory import (
    GIB,
    acquire_startup_windows_of_engine,
    cuda_device_identity,
    neighbour_kv_bytes,
    release_startup_windows,
)

logger = logging.getLogger(__name__)


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
    hybrid_layers: bool = False,
    mamba_layers: bool = False,
    sliding_window: bool = False,
    sliding_window_with: dict[str, bool] | None = None,
) -> None:
    """Stop start-up, with the reason and the way out, on a configuration elastic pools break.

    `hybrid_layers` (releases whose sliding-window allocator is not elastic): any hybrid
    sliding-window or Mamba model. From 0.5.21 the call site tells them apart: `mamba_layers`
    is refused, and a `sliding_window` model is served (`swa.py`) unless one of
    `sliding_window_with` (a feature name -> whether it is on) is on: each of those builds
    other pools or allocators around the window layers.
    """
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
    if mamba_layers:
        reasons.append("Mamba / linear-attention state pools")
    if sliding_window:
        reasons += [f"a sliding-window model with {name}"
                    for name, on in (sliding_window_with or {}).items() if on]
    if reasons:
        from kvcached_core.limits import engine_of_this_process

        cell = engine_of_this_process() or "this build"
        raise KVCachedConfigError(
            f"kvcached: elastic KV memory (KVCACHED_ENABLE=1) in {cell} does not support "
            + "; ".join(reasons)
            + ". Turn that off or set KVCACHED_ENABLE=0."
        )


def elastic_free_memory_gb(
    measure: Callable[..., float],
    *args: Any,
    distributed: bool = False,
    cpu_group: Any = None,
    elastic: bool | None = None,
    records_directory: str | None = None,
    min_across_ranks: Callable[[float, Any], float] | None = None,
    startup_window: str | None = None,
    **kwargs: Any,
) -> float:
    """The free device memory (GiB) SGLang's start-up sizing sees: its
    `get_available_gpu_memory(*args, distributed=..., cpu_group=..., **kwargs)`, passed in as
    `measure`.

    SGLang takes this figure twice: before loading weights (`pre_model_load_memory`, which sets
    the non-KV slack and is compared across TP ranks) and when it profiles the KV budget (the
    pools' size, refused with "Loaded weights leave no GPU memory for the KV cache" or "Not
    enough memory" when nothing is left). Both charge every byte other processes hold to this
    engine, so an engine starting while an elastic neighbour is in a burst would be refused, or
    sized for its whole life to that moment.

    Stock (`KVCACHED_ENABLE=0`, or pools that are not elastic): exactly `measure`'s figure.
    Elastic: each rank's figure plus the KV that live elastic neighbours hold (they give it
    back when idle), then the minimum across ranks as SGLang takes it, so that every rank sizes
    the same pools. The engine's own KV is never counted: its pools are address space that is
    mapped on demand, and what it has mapped is not a neighbour's. Records do not name a
    device, so on a host with several devices the count can be larger than what this device's
    neighbours hold; that enlarges the pools' address space, not what is mapped (bounded as
    always by the device, `KVCACHED_PHYSICAL_LIMIT` and a shared budget where one is set).

    Both figures are device-wide, so a neighbour that loads its weights between them is
    charged to this engine. `startup_window` makes elastic engines on one CUDA device take
    that span in turns: `"begin"` (the pre-load read) waits for the device's start-up window
    before measuring and keeps it; `"end"` (the KV-profile read) measures, then releases every
    window this process holds, also when the measure raises. None (a draft worker's pre-load
    read, which no KV-profile read follows), stock, or a device other than CUDA: no window.
    """
    if startup_window not in (None, "begin", "end"):
        raise ValueError(f"startup_window must be 'begin', 'end' or None, not {startup_window!r}")
    is_elastic = elastic_enabled() if elastic is None else elastic
    if not is_elastic:
        return measure(*args, distributed=distributed, cpu_group=cpu_group, **kwargs)
    if startup_window == "begin":
        _acquire_window_of(*args, engine_group=cpu_group, **kwargs)
    elif startup_window == "end":
        try:
            return _elastic_figure_gb(measure, args, kwargs, distributed=distributed,
                                      cpu_group=cpu_group, records_directory=records_directory,
                                      min_across_ranks=min_across_ranks)
        finally:
            # This engine's last device-wide figure is taken: a neighbour may start measuring.
            release_startup_windows()
    return _elastic_figure_gb(measure, args, kwargs, distributed=distributed,
                              cpu_group=cpu_group, records_directory=records_directory,
                              min_across_ranks=min_across_ranks)


def _elastic_figure_gb(
    measure: Callable[..., float],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    distributed: bool,
    cpu_group: Any,
    records_directory: str | None,
    min_across_ranks: Callable[[float, Any], float] | None,
) -> float:
    """This rank's figure plus live elastic neighbours' KV, reduced across ranks if asked."""
    local_gb = measure(*args, distributed=False, cpu_group=cpu_group, **kwargs)
    neighbours = neighbour_kv_bytes(directory=records_directory)
    counted_gb = local_gb + neighbours / GIB
    if neighbours:
        logger.info(
            "kvcached: %.2f GiB free on this device and elastic neighbours hold %.2f GiB of KV "
            "they give back when idle; start-up sizing counts %.2f GiB.",
            local_gb, neighbours / GIB, counted_gb,
        )
    if distributed:
        counted_gb = (min_across_ranks or _min_across_ranks)(counted_gb, cpu_group)
    return counted_gb


def _acquire_window_of(device: Any = None, gpu_id: Any = None, *_: Any,
                       engine_group: Any = None, **__: Any) -> None:
    """Wait for the start-up window of the device SGLang's measure
    `get_available_gpu_memory(device, gpu_id, ...)` reads (by position or by name; `gpu_id`
    is this process's CUDA index when `device` is "cuda"), when it is a CUDA device.

    Every rank reads this figure at the same point, after the engine's process groups exist:
    an engine over several ranks (`engine_group`: the world's CPU group, which SGLang reduces
    the figure over) takes the windows of all its devices as one acquisition."""
    if device != "cuda" or gpu_id is None:
        return
    settings = sglang_settings()
    acquire_startup_windows_of_engine(cuda_device_identity(int(gpu_id)), group=engine_group,
                                      timeout_s=settings.start_window_timeout_s,
                                      holder=settings.pool_name or f"sglang pid {os.getpid()}",
                                      directory=settings.shm_dir)


def _min_across_ranks(value: float, cpu_group: Any) -> float:
    """The smallest `value` of every rank in `cpu_group`, as SGLang reduces free memory."""
    import torch
    import torch.distributed

    tensor = torch.tensor(value, dtype=torch.float32)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=cpu_group)
    return float(tensor.item())
