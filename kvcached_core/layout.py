"""KV-cache geometry: block bytes, backend shapes and strides, page tiling and tensor views.

Everything here is a pure function of a few integers, so the ledger, the engine seams and
the tests agree on one definition of where a byte lives. torch is imported only inside
`kv_views`, which turns the allocator's flat tensors into the per-layer views a backend reads.

Memory model (all sizes are bytes *per layer per KV buffer* unless said otherwise):

- A *virtual block* is the unit the ledger hands out: `block_size` tokens. A backend may read
  it as `k` consecutive *kernel blocks* of `block_size // k` tokens each; the kernel blocks of
  one virtual block are adjacent in memory, so a virtual block is one contiguous byte range.
- Per-layer allocator layout: one flat tensor per layer, `[buffer 0 region | buffer 1 region]`;
  kernel block `u` of buffer `j` starts at `j * region_bytes + u * kernel_block_bytes`.
- Contiguous allocator layout: one flat tensor, interleaved at kernel-block granularity as
  `[kernel block][layer][buffer][payload]`; kernel block `u` of layer `i`, buffer `j` starts at
  `(u * num_layers * num_kv_buffers + i * num_kv_buffers + j) * kernel_block_bytes`. A compound
  page (`page_size * num_layers * num_kv_buffers` bytes) therefore holds whole virtual blocks of
  every layer, and mapping one logical page backs the same blocks in all layers at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from kvcached_core.errors import KVCachedConfigError

if TYPE_CHECKING:
    import torch


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


@dataclass(frozen=True)
class PageGeometry:
    """How ledger blocks sit on allocator pages.

    Either `blocks_per_page` blocks tile one page (`pages_per_block == 1`), or one block
    spans `pages_per_block` pages that are mapped together (`blocks_per_page == 1`).
    """

    block_bytes: int
    page_size: int
    blocks_per_page: int
    pages_per_block: int

    @property
    def ledger_page_bytes(self) -> int:
        """Bytes of the unit the ledger allocates: max(page, block)."""
        return self.page_size * self.pages_per_block


def _divisors(value: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(value) + 1) if value % d == 0]
    return sorted(set(small + [value // d for d in small]))


def nearest_working_block_bytes(block_bytes: int, page_size: int) -> int:
    """The block size closest to `block_bytes` that tiles pages or is tiled by them."""
    if block_bytes >= page_size:
        lower = (block_bytes // page_size) * page_size
        upper = lower + page_size
        return lower if block_bytes - lower <= upper - block_bytes else upper
    return min(_divisors(page_size), key=lambda d: (abs(d - block_bytes), -d))


def nearest_working_block_tokens(token_bytes: int, page_size: int, block_tokens: int) -> int | None:
    """The token count closest to `block_tokens` whose block tiles pages (None if none <= 4x)."""
    best: int | None = None
    for tokens in range(1, 4 * block_tokens + 1):
        size = tokens * token_bytes
        if (page_size % size == 0 or size % page_size == 0) and (
            best is None or abs(tokens - block_tokens) <= abs(best - block_tokens)
        ):
            best = tokens
    return best


def check_page_geometry(
    block_bytes: int, page_size: int, *, token_bytes: int | None = None
) -> PageGeometry:
    """Validate that blocks tile pages (or pages tile blocks); name a working size otherwise."""
    if block_bytes <= 0 or page_size <= 0:
        raise KVCachedConfigError(
            f"block_bytes ({block_bytes}) and page_size ({page_size}) must be positive"
        )
    if page_size % block_bytes == 0:
        return PageGeometry(block_bytes, page_size, page_size // block_bytes, 1)
    if block_bytes % page_size == 0:
        return PageGeometry(block_bytes, page_size, 1, block_bytes // page_size)
    nearest = nearest_working_block_bytes(block_bytes, page_size)
    suggestion = f"nearest working block size: {nearest}"
    if token_bytes:
        tokens = nearest_working_block_tokens(
            token_bytes, page_size, max(1, block_bytes // token_bytes)
        )
        if tokens is not None:
            suggestion += f" bytes ({tokens} tokens of {token_bytes} bytes)"
        else:
            suggestion += " bytes"
    else:
        suggestion += " bytes"
    raise KVCachedConfigError(
        f"block size {block_bytes} bytes does not tile page size {page_size} bytes "
        f"(neither divides the other); {suggestion}"
    )


def compound_page_bytes(page_size: int, num_layers: int, num_kv_buffers: int) -> int:
    """Bytes one logical page maps in the contiguous layout (all layers and buffers)."""
    return page_size * num_layers * num_kv_buffers


def page_byte_offset(
    page_id: int, page_size: int, *, num_layers: int, num_kv_buffers: int, contiguous: bool
) -> int:
    """Offset of a logical page inside each per-layer region, or inside the contiguous tensor."""
    if contiguous:
        return page_id * compound_page_bytes(page_size, num_layers, num_kv_buffers)
    return page_id * page_size


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
