"""A pytest plugin loaded into the release's own tests/v1/core run, stock and patched tree alike.

vLLM 0.34's CPU platform refuses an x86 CPU without Triton's CPU backend in
`CpuPlatform.check_and_update_config`, which every `VllmConfig` runs: 344 of 0.34's 701 L1 tests
(298 of test_scheduler.py) build one. triton-cpu is on no index this project's machines reach,
and no test of tests/v1/core runs a kernel: they exercise the scheduler and the KV cache manager
in Python. So while that one check runs, and only in a release whose check says "requires Triton
(triton-cpu)", vLLM reads Triton as present. Everything else keeps vLLM's own Triton
placeholders: a test that called a kernel would still fail, on both trees. Older releases are
left exactly as they are.
"""

from __future__ import annotations

import inspect
from typing import Any

_REFUSAL = "requires Triton (triton-cpu)"


def pytest_configure(config: Any) -> None:
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:  # a release without a CPU platform module has no such check
        return
    original = CpuPlatform.check_and_update_config
    if _REFUSAL not in inspect.getsource(original):
        return

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        import vllm.triton_utils as triton_utils

        saved = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            original.__func__(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = saved

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
