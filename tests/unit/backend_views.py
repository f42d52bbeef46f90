"""Test model of the views attention backends read over kvcached's flat KV tensors.

The runtime hands engines flat VMM-backed tensors (`FTensorAllocator.create_kv_tensors`) and
each engine seam reshapes them with the engine's own shapes. The tests use this model of the
common backend layouts to check that the allocator layouts (per-layer, contiguous) put every
block where a backend reads it. torch is imported only inside `kv_views`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from kvcached_core.errors import KVCachedConfigError

if TYPE_CHECKING:
    import torch

    from kvcached_core.pool import KVPool


class KVLayout(StrEnum):
    """The KV tensor shapes attention backends expect (per layer)."""

    FLASH_ATTN = "flash_attn"  # (2, num_blocks, block_size, heads, dim)
    FLASHINFER = "flashinfer"  # (num_blocks, 2, block_size, heads, dim)
    PACKED = "packed"  # (num_blocks, heads, block_size, 2 * dim)
    MLA = "mla"  # (num_blocks, block_size, latent)
    CPU = "cpu"  # (2, num_blocks, heads, block_size, dim)


_TWO_BUFFER_LAYOUTS = frozenset({KVLayout.FLASH_ATTN, KVLayout.FLASHINFER, KVLayout.CPU})


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer stores per token, and how the backend indexes it.

    `head_size` is the per-head dimension, or the latent size for MLA (which has one head).
    `kernel_block_size` is the backend's block size in tokens when it is smaller than the
    ledger's `block_size` (None: the same).
    """

    layout: KVLayout
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_size: int
    kernel_block_size: int | None = None

    def __post_init__(self) -> None:
        for field in ("block_size", "num_kv_heads", "head_size", "dtype_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise KVCachedConfigError(
                    f"KVCacheSpec.{field} must be a positive int, got {value!r}"
                )
        if self.layout is KVLayout.MLA and self.num_kv_heads != 1:
            raise KVCachedConfigError(
                f"KVCacheSpec.num_kv_heads must be 1 for the MLA layout, got {self.num_kv_heads}"
            )
        kernel = self.kernel_block_tokens
        if kernel <= 0 or self.block_size % kernel != 0:
            raise KVCachedConfigError(
                f"KVCacheSpec.kernel_block_size={self.kernel_block_size} must divide "
                f"block_size={self.block_size}"
            )

    @property
    def num_kv_buffers(self) -> int:
        """Separate K and V regions (2) or one buffer holding both or a latent (1)."""
        return 2 if self.layout in _TWO_BUFFER_LAYOUTS else 1

    @property
    def kernel_block_tokens(self) -> int:
        return self.block_size if self.kernel_block_size is None else self.kernel_block_size

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.kernel_block_tokens

    @property
    def token_elems(self) -> int:
        """Elements one token occupies in one buffer."""
        if self.layout is KVLayout.PACKED:
            return self.num_kv_heads * 2 * self.head_size
        return self.num_kv_heads * self.head_size

    @property
    def token_bytes(self) -> int:
        return self.token_elems * self.dtype_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one virtual block, per layer per buffer."""
        return self.block_size * self.token_bytes

    @property
    def kernel_block_bytes(self) -> int:
        return self.kernel_block_tokens * self.token_bytes


def block_bytes(
    block_size: int, num_kv_heads: int, head_size: int, dtype_size: int, *, packed: bool = False
) -> int:
    """Bytes of one block per layer per buffer: tokens x heads x dim x itemsize (x2 if packed)."""
    return block_size * num_kv_heads * head_size * dtype_size * (2 if packed else 1)


def kernel_block_byte_offset(
    spec: KVCacheSpec,
    *,
    kernel_block: int,
    layer: int,
    buffer: int,
    num_layers: int,
    region_bytes: int,
    contiguous: bool,
) -> int:
    """Byte offset of a kernel block inside its flat tensor (the layer's, or the shared one)."""
    unit = spec.kernel_block_bytes
    buffers = spec.num_kv_buffers
    if contiguous:
        return (kernel_block * num_layers * buffers + layer * buffers + buffer) * unit
    return buffer * region_bytes + kernel_block * unit


def block_byte_offset(
    spec: KVCacheSpec,
    *,
    block: int,
    layer: int,
    buffer: int,
    num_layers: int,
    region_bytes: int,
    contiguous: bool,
) -> int:
    """Byte offset of the first kernel block of virtual block `block`."""
    return kernel_block_byte_offset(
        spec,
        kernel_block=block * spec.kernel_blocks_per_block,
        layer=layer,
        buffer=buffer,
        num_layers=num_layers,
        region_bytes=region_bytes,
        contiguous=contiguous,
    )


@dataclass(frozen=True)
class ViewGeometry:
    """Shape and element strides of one layer's view, and where it starts (in elements)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int


def num_kernel_blocks(spec: KVCacheSpec, *, region_bytes: int) -> int:
    """Kernel blocks each layer's view holds (whole virtual blocks of one region)."""
    if region_bytes % spec.block_bytes:
        raise KVCachedConfigError(
            f"per-layer region of {region_bytes} bytes is not a multiple of the block size "
            f"{spec.block_bytes} bytes"
        )
    return (region_bytes // spec.block_bytes) * spec.kernel_blocks_per_block


def layer_view_geometry(
    spec: KVCacheSpec, *, layer: int, num_layers: int, region_bytes: int, contiguous: bool
) -> ViewGeometry:
    """The backend's shape for one layer, with strides that follow the allocator layout."""
    if not 0 <= layer < num_layers:
        raise KVCachedConfigError(f"layer {layer} out of range for {num_layers} layers")
    itemsize = spec.dtype_size
    unit_elems = spec.kernel_block_bytes // itemsize
    buffers = spec.num_kv_buffers
    if contiguous:
        block_stride = num_layers * buffers * unit_elems
        buffer_stride = unit_elems
        offset = layer * buffers * unit_elems
    else:
        block_stride = unit_elems
        buffer_stride = region_bytes // itemsize
        offset = 0
    blocks = num_kernel_blocks(spec, region_bytes=region_bytes)
    tokens, heads, dim = spec.kernel_block_tokens, spec.num_kv_heads, spec.head_size
    if spec.layout is KVLayout.FLASH_ATTN:
        shape = (2, blocks, tokens, heads, dim)
        strides = (buffer_stride, block_stride, heads * dim, dim, 1)
    elif spec.layout is KVLayout.FLASHINFER:
        shape = (blocks, 2, tokens, heads, dim)
        strides = (block_stride, buffer_stride, heads * dim, dim, 1)
    elif spec.layout is KVLayout.CPU:
        shape = (2, blocks, heads, tokens, dim)
        strides = (buffer_stride, block_stride, tokens * dim, dim, 1)
    elif spec.layout is KVLayout.PACKED:
        shape = (blocks, heads, tokens, 2 * dim)
        strides = (block_stride, tokens * 2 * dim, 2 * dim, 1)
    else:
        shape = (blocks, tokens, dim)
        strides = (block_stride, dim, 1)
    return ViewGeometry(shape, strides, offset)


def kv_views(
    ftensors: Sequence[Any],
    spec: KVCacheSpec,
    *,
    num_layers: int,
    bytes_per_layer_per_buffer: int,
    contiguous: bool,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One zero-copy torch view per layer over the allocator's FTensors.

    `ftensors` is what `FTensorAllocator.create_kv_tensors` returned: one per layer
    (per-layer layout) or a single one (contiguous layout).
    """
    from kvcached_core import native

    if dtype.itemsize != spec.dtype_size:
        raise KVCachedConfigError(
            f"dtype {dtype} has itemsize {dtype.itemsize}, spec says {spec.dtype_size}"
        )
    expected = 1 if contiguous else num_layers
    if len(ftensors) != expected:
        raise KVCachedConfigError(
            f"expected {expected} KV tensor(s) for {num_layers} layers "
            f"({'contiguous' if contiguous else 'per-layer'} layout), got {len(ftensors)}"
        )
    views = []
    for layer in range(num_layers):
        geometry = layer_view_geometry(
            spec,
            layer=layer,
            num_layers=num_layers,
            region_bytes=bytes_per_layer_per_buffer,
            contiguous=contiguous,
        )
        source = ftensors[0] if contiguous else ftensors[layer]
        views.append(
            native.as_tensor(
                source,
                dtype,
                list(geometry.shape),
                strides=list(geometry.strides),
                offset=geometry.storage_offset * spec.dtype_size,  # as_tensor takes bytes
            )
        )
    return views


def pool_kv_views(pool: KVPool, spec: KVCacheSpec, dtype: torch.dtype) -> list[torch.Tensor]:
    """One view per layer of `pool`'s tensors in the backend's shape (see `kv_views`)."""
    geometry = pool.geometry
    if (
        spec.block_bytes != geometry.block_bytes
        or spec.num_kv_buffers != geometry.num_kv_buffers
    ):
        raise KVCachedConfigError(
            f"spec has {spec.block_bytes}-byte blocks in {spec.num_kv_buffers} buffer(s); "
            f"pool {pool.name!r} has {geometry.block_bytes}-byte blocks in "
            f"{geometry.num_kv_buffers}"
        )
    return kv_views(
        pool.tensors,
        spec,
        num_layers=geometry.num_layers,
        bytes_per_layer_per_buffer=geometry.bytes_per_layer_per_buffer,
        contiguous=geometry.contiguous,
        dtype=dtype,
    )
