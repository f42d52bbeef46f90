"""The extension imports on any machine and says plainly when there is no CUDA driver."""

from __future__ import annotations

import ctypes

import pytest

from kvcached_core import native


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_driver_status_matches_what_the_loader_sees() -> None:
    available, reason = native.cuda_driver_status()
    if _libcuda_loads():
        assert available, reason
        assert reason.startswith("CUDA driver ")
    else:
        assert not available
        assert reason.startswith("no CUDA driver: libcuda.so.1 could not be loaded (")


def test_asking_for_cuda_without_a_driver_raises_the_same_reason() -> None:
    available, reason = native.cuda_driver_status()
    if available:
        assert native.cuda_backend(0).device_type == "cuda"
        return
    with pytest.raises(RuntimeError) as raised:
        native.cuda_backend(0)
    assert str(raised.value) == reason


def test_host_backend_reports_its_device() -> None:
    backend = native.host_backend()
    assert backend.device_type == "cpu"
    assert backend.device_id == 0
    assert backend.zero_page_read_only
    assert backend.granularity >= 4096
    assert backend.physical_free_bytes() > 0
