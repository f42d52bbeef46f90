"""Worker-side KV buffers: VMM-backed int8 buffers with exactly the bytes vLLM expects.

vLLM allocates raw `torch.zeros(nbytes, dtype=torch.int8)` buffers and views them in its
backend's shape. Every supported layout is, per buffer, `R` equal *regions* in which vLLM block
`b` is the contiguous range `[r * region + b * unit, + unit)`:

- one buffer per layer (vLLM <= 0.28): FlashAttention / CPU shapes `(2, B, ...)` have R = 2
  (a K and a V plane), FlashInfer `(B, 2, ...)` has R = 1;
- one buffer for all layers (vLLM >= 0.29), layer-outermost layouts (`LB...`): R = layers,
  region = layer stride; block-outermost layouts (`BL...`): R = 1, unit = block stride.

A kvcached pool whose buffers are those regions maps page `p` of every region at once, so the
blocks of page `p` are backed in every layer and plane together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.vllm import pools
from kvcached_core.integration.vllm.config import engine_settings, pool_name
from kvcached_core.native import as_tensor
from kvcached_core.pool import KVPool

Zeros = Callable[..., Any]
logger = logging.getLogger(__name__)


def _backend_of(device: Any) -> tuple[str, int]:
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cpu":
        return "host", 0
    if kind == "cuda":
        index = getattr(device, "index", None)
        return "cuda", int(index or 0)
    raise KVCachedConfigError(f"elastic KV cache supports cpu and cuda devices, not {device}")


def _create_pool(device: Any, *, num_tensors: int, regions: int, region_bytes: int,
                 unit_bytes: int) -> pools.EnginePool:
    settings = engine_settings()
    page = settings.page_size
    ledger_unit = max(page, unit_bytes)
    if ledger_unit % unit_bytes or ledger_unit % page:
        raise KVCachedConfigError(
            f"a vLLM block of {unit_bytes} bytes per region does not tile KVCACHED_PAGE_SIZE "
            f"({page} bytes); choose a page size that is a multiple or a divisor of it"
        )
    if region_bytes % ledger_unit:
        raise KVCachedConfigError(
            f"the KV cache region of {region_bytes} bytes ({region_bytes // unit_bytes} blocks) "
            f"is not a whole number of {ledger_unit}-byte kvcached pages; set "
            f"num_gpu_blocks_override to a multiple of {ledger_unit // unit_bytes}, or leave "
            "the sizing to kvcached (KVCACHED_VIRTUAL_SIZE)"
        )
    backend, index = _backend_of(device)
    name = pool_name()
    stale = pools.lookup(name)
    if stale is not None and not stale.attached:
        pools.close(name)  # a profiling-time allocation that the real one replaces
    pool = KVPool.create(
        name,
        backend=backend,  # type: ignore[arg-type]
        device=index,
        num_layers=num_tensors,
        num_kv_buffers=regions,
        block_bytes=ledger_unit,
        virtual_bytes_per_layer=regions * region_bytes,
        page_size=page,
        min_reserved=settings.min_reserved_pages,
        max_reserved=settings.max_reserved_pages,
        prealloc=settings.prealloc,
        physical_limit_bytes=settings.physical_limit_bytes,
        defer_physical_release=True,
    )
    engine_pool = pools.EnginePool(name, pool, ledger_unit // unit_bytes,
                                   region_bytes // unit_bytes)
    pools.register(engine_pool)
    return engine_pool


def _flat(ftensor: Any, nbytes: int) -> Any:
    import torch

    return as_tensor(ftensor, torch.int8, (nbytes,))


def per_layer_kv_buffer(zeros: Zeros, size: int, *, dtype: Any, device: Any,
                        kv_cache_config: Any, kv_cache_tensor: Any,
                        kv_cache_shape: Callable[..., Sequence[int]]) -> Any:
    """One layer's raw KV buffer (vLLM <= 0.28, `_allocate_kv_cache_tensors`).

    `kv_cache_shape` is the backend's `get_kv_cache_shape`; it tells K/V planes apart.
    """
    if not engine_settings().enabled:
        return zeros(size, dtype=dtype, device=device)
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise KVCachedConfigError(
            f"elastic KV cache supports one KV cache group, this model has {len(groups)}; "
            "set KVCACHED_ENABLE=0"
        )
    spec = groups[0].kv_cache_spec
    tensors = list(kv_cache_config.kv_cache_tensors)
    layer = next(i for i, t in enumerate(tensors) if t is kv_cache_tensor)
    page_bytes = int(spec.page_size_bytes)
    num_blocks = int(size) // page_bytes
    shape = tuple(kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads,
                                 spec.head_size))
    if shape[:2] == (2, num_blocks):
        regions = 2
    elif shape[0] == num_blocks:
        regions = 1
    else:
        raise KVCachedConfigError(f"unsupported KV cache shape {shape} for {num_blocks} blocks")
    if any(int(t.size) != int(size) for t in tensors):
        raise KVCachedConfigError("elastic KV cache needs every layer's KV buffer the same size")
    existing = pools.lookup(pool_name())
    if layer == 0 or existing is None or existing.attached:
        existing = _create_pool(device, num_tensors=len(tensors), regions=regions,
                                region_bytes=int(size) // regions,
                                unit_bytes=page_bytes // regions)
    return _flat(existing.pool.tensors[layer], int(size))


def shared_kv_buffer(zeros: Zeros, size: int, *, dtype: Any, device: Any,
                     regions: Sequence[tuple[int, int, int, int]]) -> Any:
    """The single raw KV buffer of every layer (vLLM >= 0.29, `allocate_kv_cache`).

    `regions` lists each KVCacheTensor as (offset, number of layers, layer stride, block
    stride) in bytes.
    """
    if not engine_settings().enabled:
        return zeros(size, dtype=dtype, device=device)
    if len(regions) != 1:
        # Several KV cache groups overlay one buffer (hybrid / sparse-MLA models): not elastic
        # yet, so this buffer is vLLM's own.
        logger.warning("kvcached: %d KV cache groups share the KV buffer; using a stock "
                       "(non-elastic) buffer", len(regions))
        return zeros(size, dtype=dtype, device=device)
    offset, num_layers, layer_stride, block_stride = (int(v) for v in regions[0])
    if offset != 0:
        raise KVCachedConfigError(f"KV cache tensor starts at offset {offset}, expected 0")
    if layer_stride > block_stride:  # layer-outermost: a region per layer
        count, region, unit = num_layers, layer_stride, block_stride
    else:  # block-outermost: every layer of a block is one contiguous range
        count, region, unit = 1, int(size), block_stride
    if count * region != int(size) or region % unit:
        raise KVCachedConfigError(
            f"KV cache of {size} bytes is not {count} region(s) of {region} bytes in blocks of "
            f"{unit} bytes"
        )
    engine_pool = _create_pool(device, num_tensors=1, regions=count, region_bytes=region,
                               unit_bytes=unit)
    return _flat(engine_pool.pool.tensors[0], int(size))
