"""CpuPlatform with a Ray device key.

vLLM's Ray executors ask Ray for the device as `resources={ray_device_key: n}` unless the key is
"GPU", and Ray refuses "CPU" there (ray/_common/ray_option_utils.py: use num_cpus), so the
device is a custom Ray resource, `vllm_cpu`, that every node declares (`ray start --resources
'{"vllm_cpu": 1}'`): one unit per worker slot. vLLM's workers also look the key up in
`ray.get_runtime_context().get_accelerator_ids()`, which holds only Ray's own accelerator
kinds: the key is added there, with no ids (a CPU worker is not pinned to a device).
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform

RAY_RESOURCE = "vllm_cpu"


def _accelerator_ids_with_the_cpu_key() -> None:
    try:
        from ray.runtime_context import RuntimeContext
    except ImportError:
        return
    original = RuntimeContext.get_accelerator_ids
    if getattr(original, "_with_cpu_key", False):
        return

    def get_accelerator_ids(self: Any) -> dict[str, list[str]]:
        ids: dict[str, list[str]] = original(self)
        ids.setdefault(RAY_RESOURCE, [])
        return ids

    get_accelerator_ids._with_cpu_key = True  # type: ignore[attr-defined]
    RuntimeContext.get_accelerator_ids = get_accelerator_ids  # type: ignore[method-assign]


_accelerator_ids_with_the_cpu_key()


class CpuRayPlatform(CpuPlatform):
    ray_device_key: str = RAY_RESOURCE
