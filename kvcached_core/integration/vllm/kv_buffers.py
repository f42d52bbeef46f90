"""Worker-side KV buffers: VMM-backed int8 buffers with exactly the bytes vLLM expects.

vLLM allocates raw `torch.zeros(nbytes, dtype=torch.int8)` buffers and views them in its
backend's shape. Every supported layout is, per buffer, `R` equal *regions* in which vLLM block
`b` is the contiguous range `[r * region + b * unit, + unit)`:

- one buffer per layer (vLLM <= 0.28): FlashAttention / CPU shapes `(2, B, ...)` have R = 2
  (a K and a V plane), FlashInfer `(B, 2, ...)` has R = 1; in general R is the product of the
  dimensions that lie outside the block dimension in memory (the backend's shape permuted by its
  stride order), so 0.23 - 0.28's blocks-first `(B, 2, N, H, D)` / `(B, H, N, 2D)` have R = 1;
- one "packed backing" for every layer (vLLM 0.24 - 0.28 with a KVCacheTensor `block_stride`):
  block `b` is the contiguous range `[b * block_stride, + block_stride)` of every layer: R = 1;
- one buffer for all layers (vLLM >= 0.29), layer-outermost layouts (`LB...`): R = layers,
  region = layer stride; block-outermost layouts (`BL...`): R = 1, unit = block stride.

A kvcached pool whose buffers are those regions maps page `p` of every region at once, so the
blocks of page `p` are backed in every layer and plane together.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.vllm import families, pools, workers
from kvcached_core.integration.vllm.config import (
    engine_settings,
    pool_name,
    vllm_zero_page_writable,
)
from kvcached_core.layout import choose_block_tiling
from kvcached_core.native import as_tensor
from kvcached_core.pool import BackendKind, KVPool, PoolPolicy, PoolSpec

Zeros = Callable[..., Any]
ShapeOf = Callable[..., Sequence[int]]
StrideOrderOf = Callable[[], Sequence[int]]
#: One attention group as a zeros site passes it: its layer names, the backend's
#: `get_kv_cache_shape` and `get_kv_cache_stride_order`.
KVBufferLayout = tuple[Sequence[str], ShapeOf, StrideOrderOf]
logger = logging.getLogger(__name__)

# A number of blocks no other dimension of a KV shape takes, to find the block dimension.
_PROBE_BLOCKS = 1_234_577


def _backend_of(device: Any) -> tuple[BackendKind, int]:
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cpu":
        return "host", 0
    if kind == "cuda":
        index = getattr(device, "index", None)
        return "cuda", int(index or 0)
    raise KVCachedConfigError(f"elastic KV cache supports cpu and cuda devices, not {device}")


def _create_pool(device: Any, *, num_tensors: int, regions: int, region_bytes: int,
                 unit_bytes: int, contiguous: bool = False) -> pools.EnginePool:
    """The engine's pool: `num_tensors` buffers of `regions` regions of `region_bytes`, in
    which a block is `unit_bytes`. `contiguous`: one compound page per ledger page holding
    that page's blocks of every buffer (see `_contiguous_layer_view`)."""
    settings = engine_settings()
    page = settings.page_size
    tiling = choose_block_tiling(unit_bytes, page)
    ledger_unit = tiling.ledger_bytes
    if region_bytes % ledger_unit:
        raise KVCachedConfigError(
            f"the KV cache region of {region_bytes} bytes ({region_bytes // unit_bytes} blocks) "
            f"is not a whole number of {ledger_unit}-byte kvcached pages; set "
            f"num_gpu_blocks_override to a multiple of {tiling.quantum_blocks}, or leave "
            "the sizing to kvcached (KVCACHED_VIRTUAL_SIZE)"
        )
    backend, index = _backend_of(device)
    name = pool_name()
    stale = pools.lookup(name)
    if stale is not None and not stale.attached:
        pools.close(name)  # a profiling-time allocation that the real one replaces
    served = workers.served_pool(name, backend=backend, device=index, num_tensors=num_tensors,
                                 regions=regions, region_bytes=region_bytes,
                                 ledger_unit=ledger_unit, unit_bytes=unit_bytes,
                                 contiguous=contiguous)
    if served is not None:  # a worker process of an mp-executor engine
        return served
    pool = KVPool.create(
        name,
        PoolSpec(num_tensors, regions, ledger_unit, regions * region_bytes, page, contiguous),
        PoolPolicy.from_settings(settings, defer_physical_release=True,
                                 zero_page_writable=vllm_zero_page_writable(settings)),
        backend=backend,
        device=index,
    )
    engine_pool = pools.EnginePool(name, pool, tiling, region_bytes // unit_bytes)
    pools.register(engine_pool)
    return engine_pool


def _flat(ftensor: Any, nbytes: int) -> Any:
    import torch

    return as_tensor(ftensor, torch.int8, (nbytes,))


def per_layer_kv_buffer(zeros: Zeros, size: int, *, dtype: Any, device: Any,
                        kv_cache_config: Any, kv_cache_tensor: Any,
                        kv_cache_shape: Callable[..., Sequence[int]]) -> Any:
    """One layer's raw KV buffer (vLLM 0.9 - 0.10.0, `_allocate_kv_cache_tensors`).

    `kv_cache_shape` is the backend's `get_kv_cache_shape`; it tells K/V planes apart.
    """
    if not engine_settings().enabled:
        return zeros(size, dtype=dtype, device=device)
    size = int(size)
    families.require_served("per_layer_kv_buffer", families.families_of(kv_cache_config))
    spec = _uniform_spec(kv_cache_config, size, one_group=True)
    num_blocks = size // int(spec.page_size_bytes)
    shape = tuple(kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads,
                                 spec.head_size))
    if shape[:2] == (2, num_blocks):
        regions = 2
    elif shape[0] == num_blocks:
        regions = 1
    else:
        raise KVCachedConfigError(f"unsupported KV cache shape {shape} for {num_blocks} blocks")
    return _layer_buffer(device, kv_cache_config, kv_cache_tensor, int(spec.page_size_bytes),
                         size, regions=regions, strided_views=_strided_views(spec))


def planes_outside_blocks(kv_cache_shape: ShapeOf, kv_cache_stride_order: StrideOrderOf, *,
                          block_size: int, num_kv_heads: int, head_size: int) -> int:
    """How many equal regions a layer buffer has in which block `b` is one contiguous range:
    the product of the dimensions laid out outside the block dimension in memory.

    A backend without its own stride order raises NotImplementedError, which vLLM reads as
    "memory order is the shape's order".
    """
    shape = tuple(int(d) for d in kv_cache_shape(_PROBE_BLOCKS, block_size, num_kv_heads,
                                                 head_size))
    try:
        order = tuple(int(i) for i in kv_cache_stride_order())
    except NotImplementedError:
        order = tuple(range(len(shape)))
    if sorted(order) != list(range(len(shape))) or shape.count(_PROBE_BLOCKS) != 1:
        raise KVCachedConfigError(
            f"cannot tell where the blocks lie in KV cache shape {shape} with stride order "
            f"{order}"
        )
    in_memory = [shape[i] for i in order]
    return math.prod(in_memory[:in_memory.index(_PROBE_BLOCKS)])


def _whole_pages(region_bytes: int, unit_bytes: int) -> int:
    """`region_bytes` rounded up to whole ledger pages (what `_create_pool` needs)."""
    ledger_unit = choose_block_tiling(unit_bytes, engine_settings().page_size).ledger_bytes
    return -(-region_bytes // ledger_unit) * ledger_unit


def _regions_of_tensor(kv_cache_tensor: Any, spec: Any,
                       kv_layouts: Sequence[KVBufferLayout]) -> int:
    layer_names = set(kv_cache_tensor.shared_by)
    counts = {
        planes_outside_blocks(shape_of, stride_order_of, block_size=int(spec.block_size),
                              num_kv_heads=int(spec.num_kv_heads),
                              head_size=int(spec.head_size))
        for names, shape_of, stride_order_of in kv_layouts if layer_names & set(names)
    }
    if len(counts) != 1:
        raise KVCachedConfigError(
            f"KV cache layers {sorted(layer_names)} have "
            f"{'no known attention layout' if not counts else 'different layouts'}; "
            "set KVCACHED_ENABLE=0"
        )
    return counts.pop()


def kv_tensor_buffer(zeros: Zeros, size: int, *, dtype: Any, device: Any,
                     kv_cache_config: Any, kv_cache_tensor: Any, block_stride: int,
                     kv_layouts: Sequence[KVBufferLayout]) -> Any:
    """The raw buffer of one KVCacheTensor, or the packed backing of all of them (vLLM 0.10.1 -
    0.28: V1 `_allocate_kv_cache_tensors`, Model Runner V2 `_allocate_kv_cache` from 0.22).

    `block_stride` is the tensor's packed block stride (0: not packed, and always 0 before
    0.24); `kv_layouts` lists each attention group (or, for 0.22's Model Runner V2, each layer)
    as (layer names, `get_kv_cache_shape`, `get_kv_cache_stride_order`).
    Every layer's buffer is one kvcached tensor of a single pool, so mapping ledger page `p`
    backs the blocks of page `p` in every layer and plane at once.
    """
    if not engine_settings().enabled:
        return zeros(size, dtype=dtype, device=device)
    size = int(size)
    found = families.families_of(kv_cache_config)
    families.require_served("kv_tensor_buffer", found)
    if int(block_stride) > 0:
        # One backing for every layer of every group: block b is one contiguous range, so a
        # page backs the same block ids of every group (they share one block pool).
        engine_pool = _create_pool(device, num_tensors=1, regions=1,
                                   region_bytes=_whole_pages(size, int(block_stride)),
                                   unit_bytes=int(block_stride))
        return _flat(engine_pool.pool.tensors[0], size)
    if families.MAMBA.name in found:
        # A model with Mamba groups: both runners of these releases lay every buffer out
        # blocks-first (`_update_hybrid_attention_mamba_layout` restrides attention layers from
        # (2, num_blocks, ...) to (num_blocks, 2, ...); state tensors are strided by the page),
        # so block b is bytes [b * page, (b + 1) * page) of every buffer, whatever its group.
        page_bytes = _hybrid_page(kv_cache_config, size)
        return _layer_buffer(device, kv_cache_config, kv_cache_tensor, page_bytes, size,
                             regions=1, strided_views="Mamba state")
    spec = _uniform_spec(kv_cache_config, size, one_group=False)
    regions = _regions_of_tensor(kv_cache_tensor, spec, kv_layouts)
    return _layer_buffer(device, kv_cache_config, kv_cache_tensor, int(spec.page_size_bytes),
                         size, regions=regions, strided_views=_strided_views(spec))


def _strided_views(spec: Any) -> str | None:
    """What makes vLLM read a group's buffers through as_strided views of their storage."""
    return "padded KV pages" if getattr(spec, "page_size_padded", None) is not None else None


def _hybrid_page(kv_cache_config: Any, size: int) -> int:
    """The one page size of a hybrid model's groups (vLLM's hybrid allocator pads them to
    one)."""
    _require_equal_buffers(kv_cache_config, size)
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    pages = {int(spec.page_size_bytes) for spec in specs}
    if len(pages) != 1:
        raise KVCachedConfigError(
            f"the {len(specs)} KV cache groups of this hybrid model have pages of "
            f"{sorted(pages)} bytes: one pool cannot back them in this release; set "
            "KVCACHED_ENABLE=0")
    return pages.pop()


def _require_equal_buffers(kv_cache_config: Any, size: int) -> None:
    """One pool backs every layer buffer at one size: refuse buffers of other sizes."""
    if any(int(t.size) != size for t in kv_cache_config.kv_cache_tensors):
        raise KVCachedConfigError("elastic KV cache needs every layer's KV buffer the same size")


def _uniform_spec(kv_cache_config: Any, size: int, *, one_group: bool) -> Any:
    """The one KV cache spec that describes every layer buffer's blocks (the caller has
    refused, by name, any family its site does not serve).

    `kv_tensor_buffer` serves several groups (sliding-window layers beside full ones): vLLM's
    hybrid allocator gives every group the same page size and lets one layer of each group
    share a KVCacheTensor, a block id belonging to one group at a time, so when the groups'
    attention shapes agree block `b` is the same bytes of the tensor in every group.
    `per_layer_kv_buffer` (vLLM 0.9 - 0.10.0) is handed one backend's shape: one group only.
    """
    groups = kv_cache_config.kv_cache_groups
    if one_group and len(groups) != 1:
        raise KVCachedConfigError(
            f"elastic KV cache supports one KV cache group, this model has {len(groups)}; "
            "set KVCACHED_ENABLE=0"
        )
    _require_equal_buffers(kv_cache_config, size)
    shapes = {tuple(int(getattr(g.kv_cache_spec, field)) for field in
                    ("page_size_bytes", "block_size", "num_kv_heads", "head_size"))
              for g in groups}
    if len(shapes) != 1:
        raise KVCachedConfigError(
            f"the {len(groups)} KV cache groups of this model have different block shapes "
            f"(page bytes, tokens, KV heads, head size: {sorted(shapes)}): one pool cannot "
            "back them in this release; set KVCACHED_ENABLE=0")
    return groups[0].kv_cache_spec


def _layer_buffer(device: Any, kv_cache_config: Any, kv_cache_tensor: Any, page_bytes: int,
                  size: int, *, regions: int, strided_views: str | None) -> Any:
    """The raw buffer of one layer's KVCacheTensor (`regions` equal regions, block `b` one
    range of each), from the engine's pool, which the first layer creates.

    With R = 1 the address space is rounded up to whole pages (vLLM's minimal profiling cache
    need not be whole pages); the buffer is its first `size` bytes.
    """
    if page_bytes % regions or size % page_bytes:
        raise KVCachedConfigError(
            f"a KV buffer of {size} bytes in {regions} region(s) is not whole blocks of "
            f"{page_bytes} bytes"
        )
    unit_bytes = page_bytes // regions
    region_bytes = size // regions
    if regions == 1:
        region_bytes = _whole_pages(region_bytes, unit_bytes)
    tensors = list(kv_cache_config.kv_cache_tensors)
    index = next(i for i, t in enumerate(tensors) if t is kv_cache_tensor)
    contiguous = choose_contiguous_layout(engine_settings().contiguous_layout,
                                          regions=regions,
                                          strided_views=strided_views)
    existing = pools.lookup(pool_name())
    if index == 0 or existing is None or existing.attached:
        existing = _create_pool(device, num_tensors=len(tensors), regions=regions,
                                region_bytes=region_bytes, unit_bytes=unit_bytes,
                                contiguous=contiguous)
    if contiguous:
        return _contiguous_layer_view(existing.pool.tensors[0], index, len(tensors), size,
                                      unit_bytes)
    return _flat(existing.pool.tensors[index], size)


def choose_contiguous_layout(requested: bool | None, *, regions: int,
                             strided_views: str | None) -> bool:
    """Whether a pool of layer buffers takes the contiguous layout.

    `requested` is `KVCACHED_LAYOUT`: True (contiguous), False (per-layer) or None (auto).
    Contiguous needs a blocks-first KV layout (R = 1: a block is one range of a layer's
    buffer) that vLLM reads with `.view()`: `strided_views` names what it reads through
    as_strided views of the raw storage instead (padded pages, Mamba state), which would not
    see this layout's block stride. `auto` takes it wherever it
    fits, on every device: one mapping per logical page instead of one per layer (on an H200
    0.34-0.37 ms against 1.89-1.97 ms per logical page of a 16-layer model; see
    docs/runtime.md). An explicit `contiguous` that cannot be honoured is refused.
    """
    fits = regions == 1 and strided_views is None
    if requested is None:
        return fits
    if requested and strided_views is not None:
        raise KVCachedConfigError(
            f"KVCACHED_LAYOUT=contiguous does not support {strided_views}; use "
            "KVCACHED_LAYOUT=per-layer (or auto)"
        )
    if requested and regions != 1:
        raise KVCachedConfigError(
            "KVCACHED_LAYOUT=contiguous needs a blocks-first KV layout (a block is one range "
            f"of a layer's buffer); this attention backend puts {regions} planes outside the "
            "blocks: use KVCACHED_LAYOUT=per-layer (or auto)"
        )
    return requested


def _contiguous_layer_view(ftensor: Any, layer: int, num_layers: int, size: int,
                           unit_bytes: int) -> Any:
    """Layer `layer`'s raw buffer inside the one compound tensor of the contiguous layout.

    Block `b` of layer `l` lies at `(b * num_layers + l) * unit_bytes`: every layer of a
    ledger page's blocks is one compound page, so growing by a page is one physical mapping
    instead of one per layer. vLLM views the raw buffer with `.view(dtype).view(shape)`,
    which accepts this `(blocks, unit_bytes)` tensor with a row stride of `num_layers` blocks
    because the block dimension stays outermost: the same bytes of block `b` a stock buffer
    has, at a different distance between blocks.
    """
    import torch

    return as_tensor(ftensor, torch.int8, (size // unit_bytes, unit_bytes),
                     strides=(num_layers * unit_bytes, 1), offset=layer * unit_bytes)


def shared_geometry(size: int, regions: Sequence[tuple[int, int, int, int]]
                    ) -> tuple[int, int, int]:
    """(number of regions, region bytes, block bytes) of the shared buffer, in which block `b`
    of every KV cache tensor lies at `[r * region + b * unit, + unit)` for some region `r`.
    It holds for several tensors too (KV cache groups overlay the same bytes, a block id
    belonging to one group at a time), which is what makes hybrid models elastic.

    Layer-outermost (`LB...`, layer stride > block stride): every tensor must have the same
    layer stride (the region) and block stride (the unit), and start at a whole region: each
    of its layers is then one region. Block-outermost (`BL...`): every tensor must have the
    same block stride (the unit of the one region) and lie within a block. Anything else (KV
    cache groups of different geometries, a tensor at an offset inside a region) is refused:
    one pool could not back its blocks page by page.
    """
    found = [tuple(int(v) for v in region) for region in regions]
    if not found:
        raise KVCachedConfigError("the KV cache buffer has no KV cache tensor")
    outer = {layer_stride > block_stride for _, _, layer_stride, block_stride in found}
    strides = {(layer_stride, block_stride) for _, _, layer_stride, block_stride in found}
    if len(outer) != 1 or (outer == {True} and len(strides) != 1) or \
            len({block_stride for *_, block_stride in found}) != 1:
        raise KVCachedConfigError(
            f"the {len(found)} KV cache tensors of this model (its KV cache groups) do not "
            f"share one block geometry (layer and block strides {sorted(strides)}): its KV "
            "cache cannot be elastic in this release; set KVCACHED_ENABLE=0")
    if outer == {True}:  # layer-outermost: a region per layer slot
        (layer_stride, unit), = strides
        count, region = size // layer_stride, layer_stride
        misplaced = [offset for offset, layers, _, _ in found
                     if offset % region or offset + layers * region > size]
    else:  # block-outermost: every layer of a block is one contiguous range
        unit = found[0][3]
        count, region = 1, size
        misplaced = [offset for offset, layers, layer_stride, _ in found
                     if offset + layers * layer_stride > unit]
    if misplaced:
        raise KVCachedConfigError(
            f"a KV cache tensor starts at offset {misplaced[0]}, inside a region of {region} "
            "bytes: its KV cache cannot be elastic in this release; set KVCACHED_ENABLE=0")
    if count * region != size or region % unit:
        raise KVCachedConfigError(
            f"KV cache of {size} bytes is not {count} region(s) of {region} bytes in blocks of "
            f"{unit} bytes"
        )
    return count, region, unit


def shared_kv_buffer(zeros: Zeros, size: int, *, dtype: Any, device: Any,
                     regions: Sequence[tuple[int, int, int, int]]) -> Any:
    """The single raw KV buffer of every layer (vLLM >= 0.29, `allocate_kv_cache`).

    `regions` lists each KVCacheTensor as (offset, number of layers, layer stride, block
    stride) in bytes: one per KV cache group (and per spec within a group). Every model family
    is served (`families.SITE_FAMILIES`): the groups of a sliding-window, MLA or Mamba hybrid
    model overlay the same bytes, a block id belonging to one group at a time, so one pool
    backs them all as long as they share one block geometry, which `shared_geometry` checks.
    """
    if not engine_settings().enabled:
        return zeros(size, dtype=dtype, device=device)
    count, region, unit = shared_geometry(int(size), regions)
    # The layout is vLLM's: a blocks-first buffer (one region) maps one compound page per
    # logical page already; an explicit `contiguous` over layer regions cannot be honoured.
    choose_contiguous_layout(engine_settings().contiguous_layout, regions=count, strided_views=None)
    if count == 1:
        # As `_layer_buffer` with R = 1: a block count that is not whole pages (vLLM's own
        # tests, a user's num_gpu_blocks_override) gets whole pages of address space, and
        # the buffer is its first `size` bytes; the last page backs the last blocks.
        region = _whole_pages(region, unit)
    engine_pool = _create_pool(device, num_tensors=1, regions=count, region_bytes=region,
                               unit_bytes=unit)
    return _flat(engine_pool.pool.tensors[0], int(size))
