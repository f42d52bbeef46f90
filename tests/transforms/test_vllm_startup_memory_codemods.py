# ruff: noqa: E501  (the expected sources hold the codemod's long lines as written)
"""codemods/vllm/startup_memory: whole before/after sources for each release's shape of the
start-up memory checks and of the start-up window, idempotency, and what is left alone."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from libcst.codemod import CodemodContext, TransformSuccess, transform_module

from codemods.base import BuildContext, HitCountingCodemod
from codemods.vllm.startup_memory import (
    ElasticMemoryProfileCheck,
    ElasticStartupFreeMemoryCheck,
    StartupWindowAroundSnapshot,
)

BUILD = BuildContext(
    cell="vllm-0.25", engine="vllm", package="vllm", upstream_version="0.25.1",
    built_version="0.25.1+kvcached.1", base_artifact="vllm.whl", base_sha256="0" * 64,
    transform_ids=(), fingerprint="1" * 64, toolkit_version="0.1.0",
)

WINDOW_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm-startup-window"


def run(codemod: type[HitCountingCodemod], source: str) -> tuple[int, int, str]:
    command = codemod(CodemodContext(filename="x.py"), BUILD)
    result = transform_module(command, textwrap.dedent(source))
    assert isinstance(result, TransformSuccess)
    return command.hits, command.already_applied, result.code


# vLLM 0.32's request_memory (0.25 has only the second comparison).
REQUEST_MEMORY = '''\
"""Worker utilities."""
import math


def request_memory(init_snapshot, cache_config, external_weight_memory=0):
    requested_memory = math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)
    if external_weight_memory > 0:
        engine_memory = requested_memory - external_weight_memory
        if init_snapshot.free_memory < engine_memory:
            raise ValueError("Free memory on device is less than the engine's budget")
        return engine_memory
    if init_snapshot.free_memory < requested_memory:
        raise ValueError("Free memory on device is less than desired GPU memory utilization")
    return requested_memory


def other(snapshot, limit):
    return snapshot.free_memory < limit
'''

REQUEST_MEMORY_PATCHED = '''\
"""Worker utilities."""
import kvcached_core.integration.vllm as _kvcached_vllm
import math


def request_memory(init_snapshot, cache_config, external_weight_memory=0):
    requested_memory = math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)
    if external_weight_memory > 0:
        engine_memory = requested_memory - external_weight_memory
        if _kvcached_vllm.startup_memory_short(init_snapshot.free_memory, engine_memory):
            raise ValueError("Free memory on device is less than the engine's budget")
        return engine_memory
    if _kvcached_vllm.startup_memory_short(init_snapshot.free_memory, requested_memory):
        raise ValueError("Free memory on device is less than desired GPU memory utilization")
    return requested_memory


def other(snapshot, limit):
    return snapshot.free_memory < limit
'''

# vLLM 0.9.2: both checks in the worker; the profile assertion compares strictly.
WORKER_09 = '''\
class Worker:
    def init_device(self):
        self.init_snapshot = MemorySnapshot()
        self.requested_memory = (self.init_snapshot.total_memory *
                                 self.cache_config.gpu_memory_utilization)
        if self.init_snapshot.free_memory < self.requested_memory:
            raise ValueError("Free memory on device on startup is less than desired")

    def determine_available_memory(self):
        free_gpu_memory = profile_result.after_profile.free_memory
        assert self.init_snapshot.free_memory > free_gpu_memory, (
            "Error in memory profiling. "
            f"Initial free memory {self.init_snapshot.free_memory}")
        return self.requested_memory - profile_result.non_kv_cache_memory

    def sleep(self):
        assert self.init_snapshot.free_memory > free_gpu_memory
'''

WORKER_09_PATCHED = '''\
import kvcached_core.integration.vllm as _kvcached_vllm
class Worker:
    def init_device(self):
        self.init_snapshot = MemorySnapshot()
        self.requested_memory = (self.init_snapshot.total_memory *
                                 self.cache_config.gpu_memory_utilization)
        if _kvcached_vllm.startup_memory_short(self.init_snapshot.free_memory, self.requested_memory):
            raise ValueError("Free memory on device on startup is less than desired")

    def determine_available_memory(self):
        free_gpu_memory = profile_result.after_profile.free_memory
        assert _kvcached_vllm.memory_profile_consistent(self.init_snapshot.free_memory, free_gpu_memory, strict=True), (
            "Error in memory profiling. "
            f"Initial free memory {self.init_snapshot.free_memory}")
        return self.requested_memory - profile_result.non_kv_cache_memory

    def sleep(self):
        assert self.init_snapshot.free_memory > free_gpu_memory
'''

# vLLM 0.32: the assertion takes a local for the initial figure and compares with >=.
PROFILE_032 = '''\
class Worker:
    def determine_available_memory(self) -> int:
        init_free_memory = self.init_snapshot.free_memory
        free_gpu_memory = profile_result.after_profile.free_memory
        if rocm_fallback is None:
            assert init_free_memory >= free_gpu_memory, "Error in memory profiling."
        return 0
'''

PROFILE_032_PATCHED = '''\
import kvcached_core.integration.vllm as _kvcached_vllm
class Worker:
    def determine_available_memory(self) -> int:
        init_free_memory = self.init_snapshot.free_memory
        free_gpu_memory = profile_result.after_profile.free_memory
        if rocm_fallback is None:
            assert _kvcached_vllm.memory_profile_consistent(init_free_memory, free_gpu_memory, strict=False), "Error in memory profiling."
        return 0
'''


def test_request_memory_comparisons_go_through_the_adapter() -> None:
    hits, already, code = run(ElasticStartupFreeMemoryCheck, REQUEST_MEMORY)
    assert (hits, already) == (2, 0)
    assert code == REQUEST_MEMORY_PATCHED


def test_worker_of_0_9_gets_both_checks() -> None:
    hits, _, code = run(ElasticStartupFreeMemoryCheck, WORKER_09)
    assert hits == 1
    hits, _, code = run(ElasticMemoryProfileCheck, code)
    assert hits == 1
    assert code == WORKER_09_PATCHED


def test_profile_assertion_of_0_32_keeps_its_operands_and_message() -> None:
    hits, _, code = run(ElasticMemoryProfileCheck, PROFILE_032)
    assert hits == 1
    assert code == PROFILE_032_PATCHED


@pytest.mark.parametrize(("codemod", "patched"), [
    (ElasticStartupFreeMemoryCheck, REQUEST_MEMORY_PATCHED),
    (ElasticStartupFreeMemoryCheck, WORKER_09_PATCHED),
    (ElasticMemoryProfileCheck, WORKER_09_PATCHED),
    (ElasticMemoryProfileCheck, PROFILE_032_PATCHED),
])
def test_rewritten_sources_are_recognised_and_left_as_they_are(
        codemod: type[HitCountingCodemod], patched: str) -> None:
    hits, already, again = run(codemod, patched)
    assert (hits, again) == (0, patched)
    assert already >= 1


def test_a_release_without_the_checks_has_no_hit() -> None:
    source = "def request_memory(snapshot, config):\n    return snapshot.total_memory\n"
    assert run(ElasticStartupFreeMemoryCheck, source) == (0, 0, source)
    source = "class Worker:\n    def determine_available_memory(self):\n        return 1\n"
    assert run(ElasticMemoryProfileCheck, source) == (0, 0, source)


@pytest.mark.parametrize("case", ["", "_0_9"])
def test_snapshot_is_taken_in_the_window_and_the_profile_ends_it(case: str) -> None:
    """0.32's chained snapshot (`= init_snapshot = MemorySnapshot(device=...)`) and 0.9.2's
    `MemorySnapshot()` are both wrapped; determine_available_memory and
    initialize_from_config get the decorator that ends the window."""
    before = (WINDOW_FIXTURES / f"before{case}.py").read_text(encoding="utf-8")
    hits, already, code = run(StartupWindowAroundSnapshot, before)
    assert (hits, already) == (3, 0)
    assert code == (WINDOW_FIXTURES / f"after{case}.py").read_text(encoding="utf-8")
    compile(code, "gpu_worker.py", "exec")
    hits, already, again = run(StartupWindowAroundSnapshot, code)
    assert (hits, already, again) == (0, 3, code)


def test_window_codemod_leaves_other_classes_and_methods_alone() -> None:
    source = """\
class AsyncIntermediateTensors:
    def init_device(self):
        self.init_snapshot = MemorySnapshot()

    def determine_available_memory(self):
        return 0


class Worker:
    def sleep(self):
        self.init_snapshot = MemorySnapshot()

    def init_device(self):
        self.init_snapshot = self.other_snapshot()
        snapshot = MemorySnapshot()
"""
    assert run(StartupWindowAroundSnapshot, source) == (0, 0, source)


@pytest.mark.parametrize("enabled", ["0", "1"])
def test_wrapped_snapshot_builds_the_original_snapshot_once(
        enabled: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewritten right-hand side, run through the adapter, builds the snapshot the stock
    line built, once, with its arguments; elastic, it holds the device's window after."""
    import types

    import kvcached_core.integration.vllm as adapter
    from kvcached_core.startup_memory import holds_startup_window, release_startup_windows

    monkeypatch.setenv("KVCACHED_ENABLE", enabled)
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    code = run(StartupWindowAroundSnapshot, (WINDOW_FIXTURES / "before.py").read_text())[2]
    line = next(x for x in code.splitlines() if "startup_snapshot(" in x)
    expression = line.split("= init_snapshot = ", 1)[1]
    calls: list[dict[str, object]] = []

    class MemorySnapshot:
        def __init__(self, **kwargs: object) -> None:
            calls.append(kwargs)

    device = types.SimpleNamespace(type="cuda", index=0)
    try:
        snapshot = eval(expression, {"_kvcached_vllm": adapter, "MemorySnapshot": MemorySnapshot,
                                     "self": types.SimpleNamespace(device=device)})
        assert isinstance(snapshot, MemorySnapshot)
        assert calls == [{"device": device}]
        assert holds_startup_window("cuda-3") == (enabled == "1")
    finally:
        release_startup_windows()


def test_window_and_profile_check_share_the_worker_module_and_its_import() -> None:
    """Both rewrite 0.32's gpu_worker.py: the profile assertion of the windowed worker still
    goes through the adapter, and the module imports the adapter once."""
    _, _, code = run(StartupWindowAroundSnapshot, (WINDOW_FIXTURES / "before.py").read_text())
    hits, _, code = run(ElasticMemoryProfileCheck, code)
    assert hits == 1
    assert code.count("import kvcached_core.integration.vllm as _kvcached_vllm\n") == 1
    assert "_kvcached_vllm.memory_profile_consistent(init_free_memory, free_gpu_memory, " \
           "strict=False)" in code
    assert "@_kvcached_vllm.ends_startup_window\n    def determine_available_memory" in code
