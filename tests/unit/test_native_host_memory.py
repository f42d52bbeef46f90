"""The host backend commits and returns real memory; unbacked pages are a read-only zero page."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvcached_core import native

MiB = 1 << 20
PAGE = 2 * MiB
PAGES = 64


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} missing from /proc/self/status")


def _one_layer(
    page: int = PAGE, pages: int = PAGES
) -> tuple[native.HostBackend, native.FTensorAllocator, native.FTensor]:
    backend = native.host_backend()
    allocator = native.FTensorAllocator(backend, page, False)
    (tensor,) = allocator.create_kv_tensors(page * pages, 1, 1)
    return backend, allocator, tensor


def test_resident_memory_follows_map_and_unmap() -> None:
    backend, allocator, _ = _one_layer()
    mapped_bytes = PAGE * PAGES
    before_kib = _status_kib("RssShmem")

    allocator.map_pages(list(range(PAGES)))
    grown = (_status_kib("RssShmem") - before_kib) * 1024
    assert backend.store_allocated_bytes() == mapped_bytes
    assert backend.committed_bytes() == mapped_bytes
    assert abs(grown - mapped_bytes) <= 4 * MiB, grown

    allocator.unmap_pages(list(range(PAGES)))
    dropped = (_status_kib("RssShmem") - before_kib) * 1024
    assert backend.store_allocated_bytes() == 0
    assert backend.committed_bytes() == 0
    assert dropped <= 4 * MiB, dropped


def test_reading_unbacked_pages_gives_zeros_without_resident_memory() -> None:
    _, _, tensor = _one_layer()
    view = native.as_tensor(tensor, torch.uint8, (tensor.size,))
    before_kib = _status_kib("VmRSS")
    assert int(view.max()) == 0
    assert (_status_kib("VmRSS") - before_kib) * 1024 < 8 * MiB


def test_writes_through_a_mapped_page_show_in_a_second_view() -> None:
    _, allocator, tensor = _one_layer(page=64 * 1024, pages=8)
    allocator.map_pages([3])
    as_floats = native.as_tensor(tensor, torch.float32, (8, 64 * 1024 // 4))
    as_bytes = native.as_tensor(tensor, torch.uint8, (64 * 1024,), offset=3 * 64 * 1024)
    as_floats[3].fill_(1.0)
    assert torch.equal(as_bytes[:4], torch.tensor([0, 0, 128, 63], dtype=torch.uint8))
    assert int(as_floats[2].count_nonzero()) == 0
    # Unmapping brings the zero page back.
    allocator.unmap_pages([3])
    assert int(as_bytes.count_nonzero()) == 0


_WRITE_SCRIPT = textwrap.dedent(
    """
    import torch
    from kvcached_core import native

    page = 64 * 1024
    allocator = native.FTensorAllocator(native.host_backend(), page, False)
    (tensor,) = allocator.create_kv_tensors(page * 4, 1, 1)
    allocator.map_pages([0])
    view = native.as_tensor(tensor, torch.uint8, (4, page))
    view[{row}].fill_(7)
    print("wrote", int(view[{row}].sum()))
    """
)


@pytest.mark.parametrize(("row", "dies"), [(0, False), (2, True)])
def test_writing_an_unbacked_page_faults(row: int, dies: bool) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WRITE_SCRIPT.format(row=row)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if dies:
        assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr)
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"wrote {7 * 64 * 1024}"


def test_memory_limit_turns_into_out_of_memory() -> None:
    backend = native.host_backend(memory_limit_bytes=2 * PAGE)
    allocator = native.FTensorAllocator(backend, PAGE, True)
    allocator.create_kv_tensors(PAGE * 4, 1, 1)
    assert backend.physical_free_bytes() <= 2 * PAGE
    allocator.map_pages([0, 1])
    from kvcached_core.errors import PoolExhausted

    with pytest.raises(PoolExhausted):
        allocator.map_pages([2])
    assert allocator.mapped_page_ids() == [0, 1]
    assert backend.committed_bytes() == 2 * PAGE
