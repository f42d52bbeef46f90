"""KV-cache page geometry: how blocks tile allocator pages and where a page lives.

Everything here is a pure function of a few integers, so the ledger, the engine seams and
the tests agree on one definition of where a byte lives. (Backend shapes and strides over these
tensors are built by each engine seam from the engine's own shapes; the tests model them in
`tests/unit/backend_views.py`.)

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
from dataclasses import dataclass

from kvcached_core.errors import KVCachedConfigError


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
