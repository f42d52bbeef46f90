"""The CUDA backend under the real driver: mapping, zero pages, kernels through views, memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvcached_core import native

MiB = 1 << 20
PAGE = 2 * MiB


def _allocator(
    contiguous: bool, pages: int, layers: int, buffers: int
) -> tuple[native.Backend, native.FTensorAllocator]:
    backend = native.cuda_backend(0)
    allocator = native.FTensorAllocator(backend, PAGE, contiguous)
    allocator.create_kv_tensors(PAGE * pages, layers, buffers)
    return backend, allocator


def test_cuda_backend_reserves_maps_and_unmaps() -> None:
    backend, allocator = _allocator(contiguous=False, pages=8, layers=2, buffers=2)
    assert backend.device_type == "cuda"
    assert backend.granularity == PAGE
    assert backend.zero_page_read_only
    assert allocator.map_pages([0, 3]) == [0, 3]
    for layer, offset in allocator.page_targets(3):
        assert allocator.tensors[layer].is_mapped(offset)
    allocator.unmap_pages([0])
    assert allocator.mapped_page_ids() == [3]
    view = native.as_tensor(allocator.tensors[0], torch.uint8, (allocator.tensors[0].size,))
    assert view.device == torch.device("cuda", 0)
    assert view.data_ptr() == allocator.tensors[0].vaddr


@pytest.mark.parametrize("contiguous", [False, True])
def test_unbacked_pages_read_zero_and_unmapped_pages_read_zero_again(contiguous: bool) -> None:
    _, allocator = _allocator(contiguous=contiguous, pages=4, layers=2, buffers=2)
    views = [native.as_tensor(t, torch.uint8, (t.size,)) for t in allocator.tensors]
    assert all(int(v.count_nonzero()) == 0 for v in views)
    allocator.map_pages([1])
    for layer, offset in allocator.page_targets(1):
        unit = allocator.tensors[layer].page_size
        views[layer][offset : offset + unit].fill_(5)
    torch.cuda.synchronize()
    assert sum(int(v.count_nonzero()) for v in views) == allocator.logical_page_bytes
    allocator.unmap_pages([1])
    assert all(int(v.count_nonzero()) == 0 for v in views)


def _write_and_gather(cache_k: torch.Tensor, cache_v: torch.Tensor, blocks: list[int]) -> None:
    """Writes tokens through a block table (index_put), gathers them back, runs attention."""
    block_size, heads, dim = cache_k.shape[1:]
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = len(blocks) * block_size - 3
    keys = torch.randn(tokens, heads, dim, device="cuda", dtype=cache_k.dtype, generator=generator)
    values = torch.randn_like(keys)
    table = torch.tensor(blocks, device="cuda")
    slots = (table[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()
    slots = slots[:tokens]
    flat_k = cache_k.reshape(-1, heads, dim) if cache_k.is_contiguous() else None
    if flat_k is not None:
        flat_k.index_put_((slots,), keys)
        cache_v.reshape(-1, heads, dim).index_put_((slots,), values)
    else:  # strided views (FlashInfer layout): write block by block
        cache_k[slots // block_size, slots % block_size] = keys
        cache_v[slots // block_size, slots % block_size] = values
    got_k = cache_k[table].reshape(-1, heads, dim)[:tokens]
    got_v = cache_v[table].reshape(-1, heads, dim)[:tokens]
    assert torch.equal(got_k, keys)
    assert torch.equal(got_v, values)
    query = torch.randn(1, heads, 4, dim, device="cuda", dtype=cache_k.dtype, generator=generator)
    paged = torch.nn.functional.scaled_dot_product_attention(
        query, got_k.transpose(0, 1)[None], got_v.transpose(0, 1)[None]
    )
    dense = torch.nn.functional.scaled_dot_product_attention(
        query, keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    )
    assert torch.equal(paged, dense)


def test_flash_attention_layout_per_layer_tensors() -> None:
    block_size, heads, dim, layers = 16, 8, 128, 2
    block_bytes = block_size * heads * dim * 2  # fp16, one of K or V
    pages = 4
    _, allocator = _allocator(contiguous=False, pages=pages, layers=layers, buffers=2)
    pool = native.PageAllocator(allocator, 0, 0, False)
    blocks_per_page = PAGE // block_bytes
    num_blocks = pages * blocks_per_page
    page_ids = pool.alloc_pages(2)
    assert page_ids == [0, 1]
    blocks = [1, 5, blocks_per_page + 2, 3]  # scattered over the two mapped pages
    for tensor in allocator.tensors:
        kv = native.as_tensor(tensor, torch.float16, (2, num_blocks, block_size, heads, dim))
        _write_and_gather(kv[0], kv[1], blocks)
        unbacked = kv[:, 2 * blocks_per_page :]
        assert int(unbacked.count_nonzero()) == 0
    pool.free_pages(page_ids)
    pool.stop()


def test_flashinfer_layout_over_the_contiguous_tensor() -> None:
    block_size, heads, dim, layers = 16, 4, 128, 3
    per_block = 2 * block_size * heads * dim  # elements of K and V of one block of one layer
    pages = 4
    _, allocator = _allocator(contiguous=True, pages=pages, layers=layers, buffers=1)
    (tensor,) = allocator.tensors
    blocks_per_page = PAGE // (per_block * 2)
    num_blocks = pages * blocks_per_page
    pool = native.PageAllocator(allocator, 0, 0, False)
    assert pool.alloc_pages(1) == [0]
    for layer in range(layers):
        # Block n of layer i lives at n * layers * per_block + i * per_block (elements).
        kv = native.as_tensor(
            tensor,
            torch.float16,
            (num_blocks, 2, block_size, heads, dim),
            strides=(layers * per_block, block_size * heads * dim, heads * dim, dim, 1),
            offset=layer * per_block * 2,
        )
        _write_and_gather(kv[:, 0], kv[:, 1], [0, 3, blocks_per_page - 1])
        assert int(kv[blocks_per_page:].count_nonzero()) == 0
    pool.stop()


def test_background_refill_maps_from_its_own_thread() -> None:
    _, allocator = _allocator(contiguous=True, pages=8, layers=2, buffers=2)
    pool = native.PageAllocator(allocator, 2, 4, True)
    deadline = time.monotonic() + 10
    while pool.num_reserved < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert pool.state == "healthy"
    assert allocator.mapped_page_ids() == [0, 1]
    pool.stop()


def test_unmapping_returns_memory_to_the_device() -> None:
    layers, buffers, pages = 4, 2, 64
    _, allocator = _allocator(contiguous=False, pages=pages, layers=layers, buffers=buffers)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    allocator.map_pages(list(range(pages)))
    free_mapped, _ = torch.cuda.mem_get_info()
    mapped = pages * allocator.logical_page_bytes  # 1 GiB
    assert abs((free_before - free_mapped) - mapped) <= 64 * MiB, (free_before, free_mapped)
    allocator.unmap_pages(list(range(pages)))
    free_after, _ = torch.cuda.mem_get_info()
    assert abs(free_after - free_before) <= 64 * MiB, (free_before, free_after)


_WRITE_ZERO_PAGE = textwrap.dedent(
    """
    import torch
    from kvcached_core import native

    allocator = native.FTensorAllocator(native.cuda_backend(0), 2 << 20, False)
    (tensor,) = allocator.create_kv_tensors(4 << 20, 1, 1)
    allocator.map_pages([0])
    view = native.as_tensor(tensor, torch.uint8, (2, 2 << 20))
    view[{row}].fill_(1)
    torch.cuda.synchronize()
    print("ok", int(view[{row}].sum()))
    """
)


@pytest.mark.parametrize(("row", "faults"), [(0, False), (1, True)])
def test_writing_the_zero_page_faults_on_the_device(row: int, faults: bool) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WRITE_ZERO_PAGE.format(row=row)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if faults:
        assert result.returncode != 0
        assert "illegal" in result.stderr.lower() or "fault" in result.stderr.lower(), result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"ok {2 << 20}"
