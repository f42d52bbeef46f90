"""FTensor memory reaches torch through DLPack with the requested type and layout, and no copy."""

from __future__ import annotations

import gc

import pytest
import torch

from kvcached_core import native
from kvcached_core.errors import KVCachedConfigError

PAGE = 64 * 1024


def _mapped_tensor(pages: int = 4) -> native.FTensor:
    allocator = native.FTensorAllocator(native.host_backend(), PAGE, False)
    (tensor,) = allocator.create_kv_tensors(PAGE * pages, 1, 1)
    allocator.map_pages(list(range(pages)))
    return tensor


@pytest.mark.parametrize(
    "dtype",
    [
        torch.int8,
        torch.uint8,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.int32,
        torch.int64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
)
def test_dtype_shape_device_and_no_copy(dtype: torch.dtype) -> None:
    ftensor = _mapped_tensor()
    item = torch.empty((), dtype=dtype).element_size()
    offset = 2 * PAGE
    shape = (4, PAGE // (8 * item))
    view = native.as_tensor(ftensor, dtype, shape, offset=offset)
    assert view.dtype == dtype
    assert tuple(view.shape) == shape
    assert view.stride() == (shape[1], 1)
    assert view.device == torch.device("cpu")
    assert view.data_ptr() == ftensor.vaddr + offset


def test_strides_in_elements_are_kept() -> None:
    ftensor = _mapped_tensor()
    # FlashInfer-like (blocks, 2, block_size, heads, dim) seen as a permuted window.
    view = native.as_tensor(ftensor, torch.float16, (2, 8, 16), strides=(8 * 16 * 2, 16, 1))
    assert view.stride() == (256, 16, 1)
    view[1, 0, 0] = 3.0
    flat = native.as_tensor(ftensor, torch.float16, (1024,))
    assert float(flat[256]) == 3.0


def test_tensor_outlives_every_python_handle_of_the_ftensor() -> None:
    ftensor = _mapped_tensor()
    view = native.as_tensor(ftensor, torch.int32, (PAGE // 4,))
    view.fill_(11)
    address = ftensor.vaddr
    del ftensor
    gc.collect()
    assert view.data_ptr() == address
    assert int(view.sum()) == 11 * (PAGE // 4)
    view += 1
    assert int(view[0]) == 12


def test_dlpack_protocol_object_reports_its_device() -> None:
    ftensor = _mapped_tensor()
    proto = native.FTensorView(ftensor, 1, 8, (PAGE,), None, 0)
    assert proto.__dlpack_device__() == (1, 0)
    assert torch.from_dlpack(proto).numel() == PAGE
    with pytest.raises(BufferError):
        proto.__dlpack__(copy=True)


def test_view_beyond_the_range_is_refused() -> None:
    ftensor = _mapped_tensor(pages=1)
    with pytest.raises(KVCachedConfigError):
        native.as_tensor(ftensor, torch.uint8, (PAGE + 1,))
    with pytest.raises(KVCachedConfigError):
        native.as_tensor(ftensor, torch.uint8, (16,), offset=PAGE - 8)
