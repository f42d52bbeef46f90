"""Layouts, all-or-nothing mapping with rollback, quarantine, and the two-phase unmap."""

from __future__ import annotations

import pytest
import torch

from kvcached_core import native
from kvcached_core.errors import (
    KVCachedConfigError,
    MapQuarantinedError,
    PoolExhausted,
    StateConsistencyError,
)

PAGE = 64 * 1024
PAGES = 8
LAYERS = 2
BUFFERS = 2


def _allocator(
    contiguous: bool, backend: native.HostBackend | None = None
) -> tuple[native.HostBackend, native.FTensorAllocator]:
    backend = backend or native.host_backend()
    allocator = native.FTensorAllocator(backend, PAGE, contiguous)
    allocator.create_kv_tensors(PAGE * PAGES, LAYERS, BUFFERS)
    return backend, allocator


def _reads_zero(tensor: native.FTensor) -> bool:
    return int(native.as_tensor(tensor, torch.uint8, (tensor.size,)).count_nonzero()) == 0


def test_per_layer_layout_maps_one_page_of_every_layer_and_buffer() -> None:
    backend, allocator = _allocator(contiguous=False)
    tensors = allocator.tensors
    assert [t.name for t in tensors] == ["kv_0", "kv_1"]
    assert all(t.size == BUFFERS * PAGES * PAGE for t in tensors)
    assert allocator.num_logical_pages == PAGES
    assert allocator.logical_page_bytes == PAGE * LAYERS * BUFFERS
    bpb = PAGES * PAGE
    expected = [(layer, b * bpb + 3 * PAGE) for layer in range(LAYERS) for b in range(BUFFERS)]
    assert allocator.page_targets(3) == expected

    assert allocator.map_pages([3]) == [3]
    for layer, offset in expected:
        assert tensors[layer].is_mapped(offset)
    assert sum(t.num_mapped for t in tensors) == LAYERS * BUFFERS
    assert backend.committed_bytes() == allocator.logical_page_bytes
    # Mapped units take writes; the rest of the range is still the zero page.
    for layer, offset in expected:
        native.as_tensor(tensors[layer], torch.uint8, (PAGE,), offset=offset).fill_(1)
    total = sum(int(native.as_tensor(t, torch.uint8, (t.size,)).sum()) for t in tensors)
    assert total == LAYERS * BUFFERS * PAGE


def test_contiguous_layout_maps_one_compound_page() -> None:
    backend, allocator = _allocator(contiguous=True)
    (tensor,) = allocator.tensors
    compound = PAGE * LAYERS * BUFFERS
    assert tensor.name == "kv_contiguous"
    assert tensor.size == PAGES * compound
    assert tensor.page_size == compound
    assert allocator.page_targets(5) == [(0, 5 * compound)]
    allocator.map_pages([5])
    assert tensor.mapped_offsets() == [5 * compound]
    assert backend.committed_bytes() == compound


def test_already_mapped_ids_are_skipped_and_reported_as_not_new() -> None:
    _, allocator = _allocator(contiguous=False)
    assert allocator.map_pages([1, 2]) == [1, 2]
    assert allocator.map_pages([2, 3, 3]) == [3]
    assert allocator.mapped_page_ids() == [1, 2, 3]


def test_failed_map_rolls_back_everything() -> None:
    backend, allocator = _allocator(contiguous=False)
    units = LAYERS * BUFFERS
    backend.inject_failure("map", nth=units + 2)  # second unit of the second page
    with pytest.raises(RuntimeError, match="injected failure of map"):
        allocator.map_pages([0, 1])
    assert allocator.mapped_page_ids() == []
    assert backend.committed_bytes() == 0
    assert all(_reads_zero(t) and t.num_mapped == 0 for t in allocator.tensors)
    assert allocator.num_quarantined == 0
    assert allocator.map_pages([0, 1]) == [0, 1]


def test_out_of_memory_on_create_is_pool_exhausted_after_rollback() -> None:
    backend, allocator = _allocator(contiguous=False)
    backend.inject_failure("create", nth=3, out_of_memory=True)
    with pytest.raises(PoolExhausted):
        allocator.map_pages([4])
    assert allocator.mapped_page_ids() == []
    assert backend.committed_bytes() == 0


def test_uncertain_rollback_of_the_failing_unit_quarantines_its_page() -> None:
    backend, allocator = _allocator(contiguous=True)
    backend.inject_failure("map", nth=1)
    backend.inject_failure("map_zero", nth=1)  # restoring the zero page fails too
    with pytest.raises(MapQuarantinedError, match=r"quarantined page ids \[0\]"):
        allocator.map_pages([0])
    assert allocator.quarantined_page_ids() == [0]
    assert allocator.num_quarantined == 1
    with pytest.raises(MapQuarantinedError):
        allocator.map_pages([0])
    assert allocator.map_pages([1]) == [1]


def test_uncertain_rollback_of_an_earlier_page_quarantines_it() -> None:
    backend, allocator = _allocator(contiguous=True)
    # Unmap calls: #1 zero of page 0, #2 zero of page 1, #3 rollback of page 0.
    backend.inject_failure("map", nth=2)
    backend.inject_failure("unmap", nth=3)
    with pytest.raises(MapQuarantinedError):
        allocator.map_pages([0, 1])
    assert allocator.quarantined_page_ids() == [0]
    assert allocator.mapped_page_ids() == []
    assert allocator.map_pages([1]) == [1]


def test_failed_unmap_is_a_state_consistency_error() -> None:
    backend, allocator = _allocator(contiguous=False)
    allocator.map_pages([0])
    backend.inject_failure("unmap", nth=1)
    with pytest.raises(StateConsistencyError, match="unmap of page id 0 failed"):
        allocator.unmap_pages([0])
    assert allocator.quarantined_page_ids() == [0]


def test_unmapping_an_unmapped_page_is_refused() -> None:
    _, allocator = _allocator(contiguous=False)
    with pytest.raises(StateConsistencyError, match="page id 2 is not mapped"):
        allocator.unmap_pages([2])
    with pytest.raises(KVCachedConfigError):
        allocator.map_pages([PAGES])


def test_geometry_errors_name_the_fix() -> None:
    allocator = native.FTensorAllocator(native.host_backend(), PAGE, False)
    with pytest.raises(KVCachedConfigError, match="multiple of page_size"):
        allocator.create_kv_tensors(PAGE + 1, 1, 2)
    with pytest.raises(KVCachedConfigError, match="granularity"):
        native.FTensorAllocator(native.host_backend(), 1000, False)
    allocator.create_kv_tensors(PAGE, 1, 2)
    with pytest.raises(KVCachedConfigError, match="already called"):
        allocator.create_kv_tensors(PAGE, 1, 2)


def test_groups_coexist_on_one_backend() -> None:
    backend = native.host_backend()
    _, first = _allocator(contiguous=False, backend=backend)
    _, second = _allocator(contiguous=True, backend=backend)
    first.map_pages([0])
    second.map_pages([0, 1])
    assert first.mapped_page_ids() == [0]
    assert second.mapped_page_ids() == [0, 1]
    first.unmap_pages([0])
    assert second.mapped_page_ids() == [0, 1]
    assert backend.committed_bytes() == 2 * second.logical_page_bytes


def test_two_phase_unmap_commit() -> None:
    backend, allocator = _allocator(contiguous=True)
    allocator.map_pages([0, 1, 2])
    allocator.prepare_unmap(7, [0, 1])
    assert allocator.pending_txn == 7
    assert allocator.mapped_page_ids() == [2]
    # Handles are retained until commit, and the range reads the zero page meanwhile.
    assert backend.committed_bytes() == 3 * allocator.logical_page_bytes
    with pytest.raises(StateConsistencyError, match="pending"):
        allocator.map_pages([3])
    with pytest.raises(StateConsistencyError, match="pending"):
        allocator.unmap_pages([2])
    with pytest.raises(StateConsistencyError, match="pending"):
        allocator.prepare_unmap(8, [2])
    allocator.prepare_unmap(7, [0, 1])  # a repeated prepare is a no-op
    allocator.commit_unmap(7)
    assert allocator.pending_txn is None
    assert backend.committed_bytes() == allocator.logical_page_bytes
    allocator.commit_unmap(7)  # duplicate commit: no-op
    allocator.prepare_unmap(7, [0, 1])  # late duplicate prepare of a committed txn: no-op
    assert backend.committed_bytes() == allocator.logical_page_bytes
    with pytest.raises(StateConsistencyError, match="committed"):
        allocator.abort_unmap(7)
    with pytest.raises(StateConsistencyError, match="unknown"):
        allocator.commit_unmap(99)


def test_two_phase_unmap_abort_restores_contents() -> None:
    _, allocator = _allocator(contiguous=True)
    (tensor,) = allocator.tensors
    compound = tensor.page_size
    allocator.map_pages([2])
    page = native.as_tensor(tensor, torch.int64, (compound // 8,), offset=2 * compound)
    page.copy_(torch.arange(compound // 8))
    allocator.prepare_unmap(9, [2])
    assert int(page.count_nonzero()) == 0  # the zero page while pending
    allocator.abort_unmap(9)
    assert torch.equal(page, torch.arange(compound // 8))
    assert allocator.mapped_page_ids() == [2]
    allocator.abort_unmap(9)  # duplicate abort: no-op
    with pytest.raises(StateConsistencyError, match="aborted"):
        allocator.prepare_unmap(9, [2])  # a late prepare cannot reopen it
    with pytest.raises(StateConsistencyError, match="aborted"):
        allocator.commit_unmap(9)


def test_abort_before_prepare_rejects_the_late_prepare_and_history_is_bounded() -> None:
    _, allocator = _allocator(contiguous=True)
    allocator.map_pages([0])
    allocator.abort_unmap(10)  # the coordinator gave up before this worker saw the prepare
    with pytest.raises(StateConsistencyError, match="aborted"):
        allocator.prepare_unmap(10, [0])
    for txn in range(1000, 1064):  # push txn 10 out of the 64-entry history
        allocator.abort_unmap(txn)
    allocator.prepare_unmap(10, [0])
    allocator.commit_unmap(10)
    assert allocator.mapped_page_ids() == []
