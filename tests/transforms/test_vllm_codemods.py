"""codemods/vllm: before/after for each seam, hit counting, idempotency and no-match cases."""

from __future__ import annotations

import textwrap

import pytest
from libcst.codemod import CodemodContext, TransformSuccess, transform_module

from codemods.base import BuildContext, HitCountingCodemod
from codemods.vllm.allocate_slots import NoneOnPoolExhausted
from codemods.vllm.block_pool import ElasticBlockPoolConstruction
from codemods.vllm.engine_core import (
    ClosePoolOnShutdown,
    KVCacheBudget,
    KVCacheBudgetWithUserBytes,
    ReleasePagesAfterStep,
)
from codemods.vllm.kv_buffers import (
    ModelRunnerV2KVBuffers,
    PerLayerKVBuffers,
    SharedKVBuffer,
    TensorKVBuffers,
)

BUILD = BuildContext(
    cell="vllm-0.32", engine="vllm", package="vllm", upstream_version="0.32.0",
    built_version="0.32.0+kvcached.1", base_artifact="vllm.whl", base_sha256="0" * 64,
    transform_ids=(), fingerprint="1" * 64, toolkit_version="0.1.0",
)
IMPORT = "import kvcached_core.integration.vllm as _kvcached_vllm\n"


def run(codemod: type[HitCountingCodemod], source: str) -> tuple[int, int, str]:
    command = codemod(CodemodContext(filename="x.py"), BUILD)
    result = transform_module(command, textwrap.dedent(source))
    assert isinstance(result, TransformSuccess)
    return command.hits, command.already_applied, result.code


def assert_idempotent(codemod: type[HitCountingCodemod], rewritten: str) -> None:
    hits, already, again = run(codemod, rewritten)
    assert (hits, again) == (0, rewritten)
    assert already >= 1


COORDINATOR = '''\
"""Coordinator."""
from __future__ import annotations

from vllm.v1.core.block_pool import BlockPool


class KVCacheCoordinator:
    def __init__(self, kv_cache_config, enable_caching):
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)


class Other:
    def __init__(self):
        self.pool = BlockPool(3, True)
'''


def test_block_pool_construction_goes_through_the_adapter() -> None:
    hits, _, code = run(ElasticBlockPoolConstruction, COORDINATOR)
    assert hits == 1
    assert code.startswith('"""Coordinator."""\nfrom __future__ import annotations\n' + IMPORT)
    assert ("self.block_pool = _kvcached_vllm.make_block_pool(BlockPool, "
            "kv_cache_config.num_blocks, enable_caching)") in code
    assert "self.pool = BlockPool(3, True)" in code  # other classes are left alone
    assert_idempotent(ElasticBlockPoolConstruction, code)


def test_block_pool_keyword_arguments_are_forwarded() -> None:
    source = COORDINATOR.replace("BlockPool(kv_cache_config.num_blocks, enable_caching)",
                                 "BlockPool(num_gpu_blocks=n, enable_caching=c, medium=m)")
    hits, _, code = run(ElasticBlockPoolConstruction, source)
    assert hits == 1
    assert "make_block_pool(BlockPool, num_gpu_blocks=n, enable_caching=c, medium=m)" in code


def test_block_pool_without_the_anchor_has_no_hit() -> None:
    source = "class KVCacheCoordinator:\n    x = 1\n"
    hits, already, code = run(ElasticBlockPoolConstruction, source)
    assert (hits, already) == (0, 0)
    assert IMPORT not in code


ENGINE_CORE = '''\
class EngineCore:
    def _initialize_kv_caches(self, vllm_config):
        kv_cache_specs = self.model_executor.get_kv_cache_specs()
        available_gpu_memory = self.model_executor.determine_available_memory()
        return available_gpu_memory

    def step(self):
        return self.scheduler.schedule()

    @staticmethod
    def step_with_batch_queue(self):
        return None

    def shutdown(self):
        pass


class EngineCoreProc(EngineCore):
    def shutdown(self):
        pass
'''


def test_engine_steps_release_pages_and_shutdown_closes_the_pool() -> None:
    hits, _, code = run(ReleasePagesAfterStep, ENGINE_CORE)
    assert hits == 2
    assert ("    @_kvcached_vllm.released_after_step(pipelined=False)\n"
            "    def step(self):") in code
    assert ("    @staticmethod\n    @_kvcached_vllm.released_after_step(pipelined=True)\n"
            "    def step_with_batch_queue") in code
    assert_idempotent(ReleasePagesAfterStep, code)
    hits, _, code = run(ClosePoolOnShutdown, code)
    assert hits == 1  # EngineCoreProc.shutdown is not EngineCore's
    assert code.count("@_kvcached_vllm.close_on_shutdown") == 1
    assert code.count(IMPORT) == 1


@pytest.mark.parametrize(("codemod", "user_bytes"), [
    (KVCacheBudget, "user_kv_bytes=None"),
    (KVCacheBudgetWithUserBytes,
     "user_kv_bytes=vllm_config.cache_config.kv_cache_memory_bytes"),
])
def test_kv_budget_wraps_the_profiled_memory(codemod: type[HitCountingCodemod],
                                             user_bytes: str) -> None:
    hits, _, code = run(codemod, ENGINE_CORE)
    assert hits == 1
    assert ("available_gpu_memory = _kvcached_vllm.kv_cache_budget("
            "self.model_executor.determine_available_memory(), ") in code
    assert user_bytes in code
    assert ("executor_backend=vllm_config.parallel_config.distributed_executor_backend, "
            "world_size=vllm_config.parallel_config.world_size, "
            "pipeline_size=vllm_config.parallel_config.pipeline_parallel_size)") in code
    compile(code, "core.py", "exec")
    assert_idempotent(codemod, code)


def test_allocate_slots_is_decorated() -> None:
    source = "class KVCacheManager:\n    def allocate_slots(self, request, n):\n        pass\n"
    hits, _, code = run(NoneOnPoolExhausted, source)
    assert hits == 1
    assert "    @_kvcached_vllm.none_on_pool_exhausted\n    def allocate_slots" in code
    assert_idempotent(NoneOnPoolExhausted, code)


RUNNER_09 = '''\
import torch


class GPUModelRunner:
    def _allocate_kv_cache_tensors(self, kv_cache_config):
        for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
            tensor = torch.zeros(kv_cache_tensor.size,
                                 dtype=torch.int8,
                                 device=self.device)

    def profile(self):
        return torch.zeros(10, dtype=torch.int8, device=self.device)
'''


def test_per_layer_buffers_pass_the_backend_shape() -> None:
    hits, _, code = run(PerLayerKVBuffers, RUNNER_09)
    assert hits == 1
    assert "_kvcached_vllm.per_layer_kv_buffer(torch.zeros, kv_cache_tensor.size," in code
    assert "kv_cache_shape=self.attn_backends[0].get_kv_cache_shape)" in code
    assert "return torch.zeros(10, dtype=torch.int8, device=self.device)" in code
    compile(code, "runner.py", "exec")
    assert_idempotent(PerLayerKVBuffers, code)


UTILS_032 = '''\
import torch


def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
    buf = torch.zeros(buf_size, dtype=torch.int8, device=device)
    other = torch.zeros(4, dtype=torch.float32, device=device)
    return buf


def something_else(device):
    return torch.zeros(8, dtype=torch.int8, device=device)
'''


def test_shared_buffer_passes_each_tensor_geometry() -> None:
    hits, _, code = run(SharedKVBuffer, UTILS_032)
    assert hits == 1
    assert ("buf = _kvcached_vllm.shared_kv_buffer(torch.zeros, buf_size, dtype=torch.int8, "
            "device=device, regions=[(t.offset, len(t.layers), t.layer_stride, t.block_stride) "
            "for t in kv_cache_config.kv_cache_tensors])") in code
    assert "torch.zeros(4, dtype=torch.float32" in code  # not a KV byte buffer
    assert "return torch.zeros(8, dtype=torch.int8, device=device)" in code
    assert_idempotent(SharedKVBuffer, code)


# vLLM 0.25.1 shapes: gpu_model_runner.py (V1 runner) and gpu/attn_utils.py (Model Runner V2).
RUNNER_025 = '''\
import torch


class GPUModelRunner:
    def _allocate_kv_cache_tensors(
        self, kv_cache_config: KVCacheConfig
    ) -> dict[str, torch.Tensor]:
        kv_cache_raw_tensors: dict[str, torch.Tensor] = {}
        packed_backing: torch.Tensor | None = None
        for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
            if kv_cache_tensor.block_stride > 0:
                # Allocate once; all packed tensors alias the same backing.
                if packed_backing is None:
                    packed_backing = torch.zeros(
                        kv_cache_tensor.size,
                        dtype=torch.int8,
                        device=self.device,
                    )
                tensor = packed_backing
            else:
                tensor = torch.zeros(
                    kv_cache_tensor.size, dtype=torch.int8, device=self.device
                )
            for layer_name in kv_cache_tensor.shared_by:
                kv_cache_raw_tensors[layer_name] = tensor
        return kv_cache_raw_tensors

    def _dummy_sampler_run(self):
        return torch.zeros(16, dtype=torch.int8, device=self.device)
'''

V1_LAYOUTS = ("kv_layouts=[(g.layer_names, g.backend.get_kv_cache_shape, "
              "g.backend.get_kv_cache_stride_order) for gs in self.attn_groups for g in gs]")


def test_v1_runner_tensor_and_packed_buffers_pass_the_layouts() -> None:
    hits, _, code = run(TensorKVBuffers, RUNNER_025)
    assert hits == 2
    assert code.count("_kvcached_vllm.kv_tensor_buffer(") == 2
    assert code.count("torch.zeros, kv_cache_tensor.size, dtype=torch.int8, device=self.device, "
                      "kv_cache_config=kv_cache_config, kv_cache_tensor=kv_cache_tensor, "
                      "block_stride=kv_cache_tensor.block_stride, " + V1_LAYOUTS) == 2
    assert "packed_backing = _kvcached_vllm.kv_tensor_buffer(" in code
    assert "tensor = _kvcached_vllm.kv_tensor_buffer(" in code
    assert "return torch.zeros(16, dtype=torch.int8, device=self.device)" in code
    assert code.startswith("import kvcached_core.integration.vllm as _kvcached_vllm\n")
    compile(code, "gpu_model_runner.py", "exec")
    assert_idempotent(TensorKVBuffers, code)


def test_v1_runner_of_another_version_has_no_tensor_site() -> None:
    hits, already, code = run(TensorKVBuffers, UTILS_032)
    assert (hits, already) == (0, 0)
    assert "_kvcached_vllm" not in code


ATTN_UTILS_025 = '''\
import torch


def _allocate_kv_cache(
    kv_cache_config: KVCacheConfig, shared_layers: dict[str, str], device: torch.device
):
    kv_cache_raw_tensors: dict[str, torch.Tensor] = {}
    packed_backing: torch.Tensor | None = None
    for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
        if kv_cache_tensor.block_stride > 0:
            if packed_backing is None:
                packed_backing = torch.zeros(
                    kv_cache_tensor.size, dtype=torch.int8, device=device
                )
            tensor = packed_backing
        else:
            tensor = torch.zeros(kv_cache_tensor.size, dtype=torch.int8, device=device)
        for layer_name in kv_cache_tensor.shared_by:
            kv_cache_raw_tensors[layer_name] = tensor
    return kv_cache_raw_tensors


def init_kv_cache(
    runner_kv_caches,
    forward_context,
    kv_cache_config: KVCacheConfig,
    attn_groups: list[list[AttentionGroup]],
    device: torch.device,
):
    shared_kv_cache_layers = get_shared_kv_cache_layers(vllm_config)
    kv_cache_raw_tensors = _allocate_kv_cache(
        kv_cache_config, shared_kv_cache_layers, device
    )
    return kv_cache_raw_tensors


def _reshape(device):
    return torch.zeros(4, dtype=torch.int8, device=device)
'''


def test_model_runner_v2_buffers_get_the_attention_groups_from_their_caller() -> None:
    hits, _, code = run(ModelRunnerV2KVBuffers, ATTN_UTILS_025)
    assert hits == 4  # two zeros sites, the new parameter, the call that fills it
    assert ("    kv_cache_config: KVCacheConfig, shared_layers: dict[str, str], "
            "device: torch.device, attn_groups=()\n):") in code
    assert ("    kv_cache_raw_tensors = _allocate_kv_cache(\n"
            "        kv_cache_config, shared_kv_cache_layers, device, attn_groups=attn_groups\n"
            "    )") in code
    assert code.count("block_stride=kv_cache_tensor.block_stride, kv_layouts=[(g.layer_names, "
                      "g.backend.get_kv_cache_shape, g.backend.get_kv_cache_stride_order) "
                      "for gs in attn_groups for g in gs]") == 2
    assert "return torch.zeros(4, dtype=torch.int8, device=device)" in code
    compile(code, "attn_utils.py", "exec")
    assert_idempotent(ModelRunnerV2KVBuffers, code)


def test_model_runner_v2_buffers_run_as_stock_when_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewritten module runs: with KVCACHED_ENABLE=0 it allocates what stock does."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    _, _, code = run(ModelRunnerV2KVBuffers, ATTN_UTILS_025)
    namespace: dict[str, object] = {"KVCacheConfig": object, "AttentionGroup": object,
                                    "get_shared_kv_cache_layers": lambda config: {},
                                    "vllm_config": None}
    exec(compile(code, "attn_utils.py", "exec"), namespace)

    class Tensor:
        def __init__(self, size: int, names: list[str], block_stride: int = 0) -> None:
            self.size, self.shared_by, self.block_stride = size, names, block_stride

    class Config:
        kv_cache_tensors = [Tensor(64, ["a"]), Tensor(96, ["b", "c"], 32),
                            Tensor(96, ["d"], 32)]

    init = namespace["init_kv_cache"]
    raw = init([], {}, Config(), [], torch.device("cpu"))  # type: ignore[operator]
    assert {k: v.numel() for k, v in raw.items()} == {"a": 64, "b": 96, "c": 96, "d": 96}
    assert raw["b"] is raw["d"] and raw["a"] is not raw["b"]  # one packed backing
    assert all(v.dtype == torch.int8 and not v.any() for v in raw.values())


def test_model_runner_v2_codemod_needs_the_function() -> None:
    hits, already, code = run(ModelRunnerV2KVBuffers, RUNNER_025)
    assert (hits, already) == (0, 0)
    assert "_kvcached_vllm" not in code


def test_model_runner_v2_partly_rewritten_tree_is_seen() -> None:
    _, _, code = run(ModelRunnerV2KVBuffers, ATTN_UTILS_025)
    undone = code.replace(", attn_groups=attn_groups", "")
    hits, already, _ = run(ModelRunnerV2KVBuffers, undone)
    assert (hits, already) == (1, 3)  # the runner refuses a partly rewritten tree
