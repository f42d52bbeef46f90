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


def test_the_type_stub_lists_exactly_what_the_extension_exports() -> None:
    """`_C.pyi` (what mypy reads) and the compiled module agree, class by class; benchmark
    functions are not part of the product extension."""
    import ast
    from pathlib import Path

    from kvcached_core import _C

    stub = ast.parse((Path(_C.__file__).parent / "_C.pyi").read_text(encoding="utf-8"))
    stub_names = {node.name for node in stub.body
                  if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    assert stub_names == {name for name in dir(_C) if not name.startswith("_")}
    assert not any("bench" in name for name in stub_names)
    for node in stub.body:
        if not isinstance(node, ast.ClassDef):
            continue
        declared = {item.name for item in node.body
                    if isinstance(item, ast.FunctionDef) and not item.name.startswith("_")}
        cls = getattr(_C, node.name)
        inherited = {name for base in cls.__mro__[1:] for name in vars(base)}
        own = {name for name in vars(cls) if not name.startswith("_")} - inherited
        assert declared >= own, (node.name, own - declared)
        assert declared <= {name for name in dir(cls) if not name.startswith("_")}, node.name
