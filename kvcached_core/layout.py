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


# A ledger page of blocks that straddle page boundaries may leave at most this fraction of its
# bytes unused (the straddling blocks are never handed out); `choose_block_tiling` takes the
# smallest ledger page that keeps to it.
MAX_STRADDLE_WASTE = 1 / 8


@dataclass(frozen=True)
class BlockTiling:
    """Where an engine's blocks sit in ledger pages, whatever their size.

    Block `b` is bytes `[b * unit_bytes, (b + 1) * unit_bytes)` of each region; ledger page `p`
    is bytes `[p * ledger_bytes, (p + 1) * ledger_bytes)` (`ledger_bytes` a whole number of
    allocator pages, mapped together). A page holds the blocks that lie wholly inside it. When
    the unit divides the page (every dense model at a power-of-two block) that is exactly
    `ledger_bytes // unit_bytes` blocks and every block has a page. Otherwise (MLA's 576-wide
    latent: 36,864 bytes at 32 tokens) a block that crosses a page boundary belongs to no page
    and is never handed out: at most one block per boundary, which `choose_block_tiling` keeps
    below `MAX_STRADDLE_WASTE` of a page. Stock vLLM never sees the difference: it is offered
    fewer free blocks, never a different layout.
    """

    unit_bytes: int
    ledger_bytes: int

    @property
    def exact(self) -> bool:
        """Every block lies in one page (no block straddles a boundary)."""
        return self.ledger_bytes % self.unit_bytes == 0

    @property
    def min_blocks_per_page(self) -> int:
        """Blocks every ledger page holds at least (what a newly mapped page surely adds)."""
        whole, rest = divmod(self.ledger_bytes, self.unit_bytes)
        return whole - (1 if rest else 0)

    @property
    def quantum_blocks(self) -> int:
        """The fewest blocks whose bytes are whole ledger pages: a region of `n` blocks is
        page-aligned (so page `p` of every region can be mapped at once) iff `n` is a
        multiple of it."""
        return self.ledger_bytes // math.gcd(self.unit_bytes, self.ledger_bytes)

    def page_of(self, block: int) -> int | None:
        """The ledger page holding block `block`, or None when it straddles two pages."""
        start = block * self.unit_bytes
        page = start // self.ledger_bytes
        if (start + self.unit_bytes - 1) // self.ledger_bytes != page:
            return None
        return page

    def blocks_of(self, page: int) -> range:
        """The blocks lying wholly inside ledger page `page`, ascending."""
        unit, ledger = self.unit_bytes, self.ledger_bytes
        return range(-(-page * ledger // unit), (page + 1) * ledger // unit)

    def pages_for(self, num_blocks: int) -> int:
        """Ledger pages spanned by blocks `[0, num_blocks)`."""
        return -(-num_blocks * self.unit_bytes // self.ledger_bytes)


def choose_block_tiling(unit_bytes: int, page_size: int) -> BlockTiling:
    """The ledger page for blocks of `unit_bytes` on allocator pages of `page_size`.

    A page when blocks tile it, the block when pages tile it; otherwise the smallest whole
    number of pages whose straddling blocks waste at most `MAX_STRADDLE_WASTE` of it, which
    at worst is the least common multiple (whole blocks, no waste): one 2 MiB page for MLA's
    36,864-byte blocks (56 or 55 blocks a page), nine 16 KiB pages (four blocks) for the same
    blocks on a host pool of 16 KiB pages.
    """
    if unit_bytes <= 0 or page_size <= 0:
        raise KVCachedConfigError(
            f"block bytes ({unit_bytes}) and page size ({page_size}) must be positive")
    if page_size % unit_bytes == 0:
        return BlockTiling(unit_bytes, page_size)
    if unit_bytes % page_size == 0:
        return BlockTiling(unit_bytes, unit_bytes)
    most = unit_bytes // math.gcd(unit_bytes, page_size)  # pages in the common multiple
    for pages in range(1, most + 1):
        tiling = BlockTiling(unit_bytes, pages * page_size)
        used = tiling.min_blocks_per_page * unit_bytes
        if used > 0 and used >= (1 - MAX_STRADDLE_WASTE) * tiling.ledger_bytes:
            return tiling
    return BlockTiling(unit_bytes, most * page_size)  # not reached: the multiple has no waste


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
