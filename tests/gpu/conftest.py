"""GPU tests run only where an NVIDIA driver and a CUDA build of torch are present.

Elsewhere every test here is skipped with the reason the driver loader gave, so the skip is
visible in the test summary (`-ra`).
"""

from __future__ import annotations

import pytest


def _gpu_unavailable_reason() -> str | None:
    from kvcached_core import native

    available, reason = native.cuda_driver_status()
    if not available:
        return reason
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use CUDA here"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_unavailable_reason()
    for item in items:
        if "tests/gpu/" not in item.nodeid.replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs an NVIDIA GPU: {reason}"))
