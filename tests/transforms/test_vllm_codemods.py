"""codemods/vllm: before/after for each seam, hit counting, idempotency and no-match cases.

Each codemod's expected output is a whole file: tests/transforms/fixtures/<transform id>/
before.py is the upstream snippet, after.py exactly what the codemod must make of it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from libcst.codemod import CodemodContext, TransformSuccess, transform_module

from codemods.base import BuildContext, HitCountingCodemod
from codemods.vllm.allocate_slots import NoneOnPoolExhausted
from codemods.vllm.block_pool import ElasticBlockPoolConstruction
from codemods.vllm.engine_core import (
    ClosePoolOnShutdown,
    ReleasePagesAfterStep,
)
from codemods.vllm.engine_executor import KVSizedWithExecutor
from codemods.vllm.kv_buffers import (
    ModelRunnerV2KVBuffers,
    PerLayerKVBuffers,
    SharedKVBuffer,
    TensorKVBuffers,
)
from codemods.vllm.kv_buffers_attn_groups import (
    AttentionGroupKVBuffers,
    ModelRunnerV2BackendsKVBuffers,
    ModelRunnerV2GroupsKVBuffers,
)
from codemods.vllm.kv_buffers_shared_helper import SharedKVBufferFromCaller
from codemods.vllm.kv_plan import KVBudgetPlannedByBuilder, KVBudgetPlannedInWholePages
from codemods.vllm.kv_plan_older import KVBudgetPlannedByScaling, KVBudgetPlannedForGroups
from codemods.vllm.kv_plan_unified import KVBudgetPlannedForUnifiedRanks
from forge.registry import default_registry

BUILD = BuildContext(
    cell="vllm-0.32", engine="vllm", package="vllm", upstream_version="0.32.0",
    built_version="0.32.0+kvcached.1", base_artifact="vllm.whl", base_sha256="0" * 64,
    transform_ids=(), fingerprint="1" * 64, toolkit_version="0.1.0",
)
IMPORT = "import kvcached_core.integration.vllm as _kvcached_vllm\n"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture(transform_id: str, name: str = "before.py") -> str:
    return (FIXTURES / transform_id / name).read_text(encoding="utf-8")


def run(codemod: type[HitCountingCodemod], source: str) -> tuple[int, int, str]:
    command = codemod(CodemodContext(filename="x.py"), BUILD)
    result = transform_module(command, textwrap.dedent(source))
    assert isinstance(result, TransformSuccess)
    return command.hits, command.already_applied, result.code


def assert_idempotent(codemod: type[HitCountingCodemod], rewritten: str) -> None:
    hits, already, again = run(codemod, rewritten)
    assert (hits, again) == (0, rewritten)
    assert already >= 1


def assert_rewrites_fixture(codemod: type[HitCountingCodemod], transform_id: str,
                            case: str = "") -> tuple[int, str]:
    """Run `codemod` on the fixture's before{case}.py: the result is after{case}.py, whole."""
    hits, _, code = run(codemod, fixture(transform_id, f"before{case}.py"))
    assert code == fixture(transform_id, f"after{case}.py")
    return hits, code



def test_every_fixture_names_a_registered_vllm_transform() -> None:
    registered = {t.id: t for t in default_registry().codemods}
    for folder in sorted(FIXTURES.glob("vllm-*")):
        assert folder.name in registered, f"fixtures for an unknown transform: {folder.name}"
        cases = sorted(p.name for p in folder.glob("*.py"))
        befores = [c for c in cases if c.startswith("before")]
        assert "before.py" in befores
        assert cases == sorted([*befores, *(b.replace("before", "after") for b in befores)])


def test_block_pool_construction_goes_through_the_adapter() -> None:
    hits, code = assert_rewrites_fixture(ElasticBlockPoolConstruction, "vllm-block-pool")
    assert hits == 1  # Other.pool = BlockPool(3, True) is left alone
    assert_idempotent(ElasticBlockPoolConstruction, code)


def test_block_pool_keyword_arguments_are_forwarded() -> None:
    hits, _ = assert_rewrites_fixture(ElasticBlockPoolConstruction, "vllm-block-pool",
                                      "_keywords")
    assert hits == 1


def test_block_pool_without_the_anchor_has_no_hit() -> None:
    source = "class KVCacheCoordinator:\n    x = 1\n"
    hits, already, code = run(ElasticBlockPoolConstruction, source)
    assert (hits, already) == (0, 0)
    assert IMPORT not in code


def test_engine_steps_release_pages() -> None:
    hits, code = assert_rewrites_fixture(ReleasePagesAfterStep, "vllm-engine-step-release")
    assert hits == 2
    assert_idempotent(ReleasePagesAfterStep, code)


def test_shutdown_closes_the_pool() -> None:
    hits, code = assert_rewrites_fixture(ClosePoolOnShutdown, "vllm-engine-shutdown")
    assert hits == 1  # EngineCoreProc.shutdown is not EngineCore's
    assert_idempotent(ClosePoolOnShutdown, code)


def test_kv_caches_are_sized_with_the_executor_in_reach() -> None:
    hits, code = assert_rewrites_fixture(KVSizedWithExecutor, "vllm-engine-executor")
    assert hits == 1
    assert_idempotent(KVSizedWithExecutor, code)


def test_engine_core_codemods_in_sequence_share_one_import() -> None:
    _, _, code = run(ReleasePagesAfterStep, fixture("vllm-engine-step-release"))
    hits, _, code = run(ClosePoolOnShutdown, code)
    assert hits == 1
    assert code.count("@_kvcached_vllm.close_on_shutdown") == 1
    assert code.count(IMPORT) == 1


def test_allocate_slots_is_decorated() -> None:
    hits, code = assert_rewrites_fixture(NoneOnPoolExhausted, "vllm-allocate-slots-race")
    assert hits == 1
    assert_idempotent(NoneOnPoolExhausted, code)


def test_per_layer_buffers_pass_the_backend_shape() -> None:
    hits, code = assert_rewrites_fixture(PerLayerKVBuffers, "vllm-kv-buffers-per-layer")
    assert hits == 1  # the profile run's torch.zeros is not a KV buffer
    compile(code, "runner.py", "exec")
    assert_idempotent(PerLayerKVBuffers, code)


def test_shared_buffer_passes_each_tensor_geometry() -> None:
    hits, code = assert_rewrites_fixture(SharedKVBuffer, "vllm-kv-buffers-shared")
    assert hits == 1  # a float32 buffer and another function's zeros are left alone
    assert_idempotent(SharedKVBuffer, code)


def test_shared_buffer_helper_gets_the_regions_from_its_caller() -> None:
    """vLLM 0.34: the zeros moved into a helper that sees no KVCacheTensor; its caller passes
    their regions in, and the caller's own `allocate` hook stays as it was."""
    hits, code = assert_rewrites_fixture(SharedKVBufferFromCaller,
                                         "vllm-kv-buffers-shared-helper")
    assert hits == 3  # the zeros site, the new keyword, the call that fills it
    assert "buf = allocate(raw_size)" in code
    compile(code, "utils.py", "exec")
    assert_idempotent(SharedKVBufferFromCaller, code)


def test_shared_buffer_helper_runs_as_stock_when_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    _, _, code = run(SharedKVBufferFromCaller, fixture("vllm-kv-buffers-shared-helper"))
    namespace: dict[str, object] = {}
    exec(compile(code, "utils.py", "exec"), namespace)

    class Tensor:
        size, layers, offset, layer_stride, block_stride = 96, ["a", "b"], 0, 48, 16

    class Config:
        kv_cache_tensors = [Tensor()]

    caches = namespace["allocate_kv_cache"](Config(), torch.device("cpu"), None)  # type: ignore[operator]
    assert caches["a"] is caches["b"]
    assert caches["a"].dtype == torch.int8 and caches["a"].numel() == 96
    assert not caches["a"].any()


def test_shared_buffer_helper_needs_a_caller_holding_the_config() -> None:
    """A caller that names its config otherwise gets no keyword it could not fill: the seam
    counts fewer places than it declares and the build stops."""
    source = fixture("vllm-kv-buffers-shared-helper").replace("kv_cache_config", "config")
    hits, already, _ = run(SharedKVBufferFromCaller, source)
    assert (hits, already) == (2, 0)


def test_v1_runner_tensor_and_packed_buffers_pass_the_layouts() -> None:
    hits, code = assert_rewrites_fixture(TensorKVBuffers, "vllm-kv-buffers-tensors")
    assert hits == 2
    compile(code, "gpu_model_runner.py", "exec")
    assert_idempotent(TensorKVBuffers, code)


def test_v1_runner_of_another_version_has_no_tensor_site() -> None:
    hits, already, code = run(TensorKVBuffers, fixture("vllm-kv-buffers-shared"))
    assert (hits, already) == (0, 0)
    assert "_kvcached_vllm" not in code


def test_model_runner_v2_buffers_get_the_attention_groups_from_their_caller() -> None:
    hits, code = assert_rewrites_fixture(ModelRunnerV2KVBuffers, "vllm-kv-buffers-mrv2")
    assert hits == 4  # two zeros sites, the new parameter, the call that fills it
    compile(code, "attn_utils.py", "exec")
    assert_idempotent(ModelRunnerV2KVBuffers, code)


def test_model_runner_v2_buffers_run_as_stock_when_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewritten module runs: with KVCACHED_ENABLE=0 it allocates what stock does."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    _, _, code = run(ModelRunnerV2KVBuffers, fixture("vllm-kv-buffers-mrv2"))
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
    hits, already, code = run(ModelRunnerV2KVBuffers, fixture("vllm-kv-buffers-tensors"))
    assert (hits, already) == (0, 0)
    assert "_kvcached_vllm" not in code


def test_model_runner_v2_partly_rewritten_tree_is_seen() -> None:
    _, _, code = run(ModelRunnerV2KVBuffers, fixture("vllm-kv-buffers-mrv2"))
    undone = code.replace(", attn_groups=attn_groups", "")
    hits, already, _ = run(ModelRunnerV2KVBuffers, undone)
    assert (hits, already) == (1, 3)  # the runner refuses a partly rewritten tree


# --- vLLM 0.10.1 - 0.23: one unpacked buffer per KVCacheTensor, layouts from the runner --------


class _Tensor:
    def __init__(self, size: int, names: list[str]) -> None:
        self.size, self.shared_by = size, names


class _Group:
    def __init__(self, names: list[str]) -> None:
        self.layer_names = names


class _Config:
    kv_cache_tensors = [_Tensor(64, ["a"]), _Tensor(96, ["b", "c"])]
    kv_cache_groups = [_Group(["a", "b", "c"])]


def test_v1_runner_attention_groups_pass_their_layouts() -> None:
    hits, code = assert_rewrites_fixture(AttentionGroupKVBuffers, "vllm-kv-buffers-attn-groups")
    assert hits == 1  # the sampler's int8 zeros is not a KV buffer
    assert "block_stride=0" in code and "self.attn_groups" in code
    compile(code, "gpu_model_runner.py", "exec")
    assert_idempotent(AttentionGroupKVBuffers, code)


def test_v1_runner_attention_groups_run_as_stock_when_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    _, _, code = run(AttentionGroupKVBuffers, fixture("vllm-kv-buffers-attn-groups"))
    namespace: dict[str, object] = {"KVCacheConfig": object}
    exec(compile(code, "gpu_model_runner.py", "exec"), namespace)
    runner_class = namespace["GPUModelRunner"]
    runner = runner_class()  # type: ignore[operator]
    runner.device, runner.attn_groups, runner.runner_only_attn_layers = (
        torch.device("cpu"), [], set())
    raw = runner._allocate_kv_cache_tensors(_Config())
    assert {k: v.numel() for k, v in raw.items()} == {"a": 64, "b": 96, "c": 96}
    assert raw["b"] is raw["c"]
    assert all(v.dtype == torch.int8 and not v.any() for v in raw.values())


@pytest.mark.parametrize(("codemod", "transform_id", "passed"), [
    (ModelRunnerV2BackendsKVBuffers, "vllm-kv-buffers-mrv2-backends",
     "attn_backends=attn_backends"),
    (ModelRunnerV2GroupsKVBuffers, "vllm-kv-buffers-mrv2-groups", "attn_groups=attn_groups"),
])
def test_model_runner_v2_of_0_22_and_0_23_gets_the_layouts_from_its_caller(
        codemod: type[HitCountingCodemod], transform_id: str, passed: str) -> None:
    hits, code = assert_rewrites_fixture(codemod, transform_id)
    assert hits == 3  # the zeros site, the new parameter, the call that fills it
    assert passed in code and "block_stride=0" in code
    compile(code, "attn_utils.py", "exec")
    assert_idempotent(codemod, code)


@pytest.mark.parametrize(("codemod", "transform_id", "layouts"), [
    (ModelRunnerV2BackendsKVBuffers, "vllm-kv-buffers-mrv2-backends", {}),
    (ModelRunnerV2GroupsKVBuffers, "vllm-kv-buffers-mrv2-groups", []),
])
def test_model_runner_v2_of_0_22_and_0_23_runs_as_stock_when_switched_off(
        codemod: type[HitCountingCodemod], transform_id: str, layouts: object,
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    _, _, code = run(codemod, fixture(transform_id))
    namespace: dict[str, object] = {
        "KVCacheConfig": object, "AttentionGroup": object, "AttentionBackend": object,
        "Any": object, "VllmConfig": object, "get_shared_kv_cache_layers": lambda config: {},
        "_reshape_kv_cache": lambda *args, **kwargs: kwargs.get("kv_cache_raw_tensors",
                                                                 args[1] if args else None),
        "bind_kv_cache": lambda *args: None,
    }
    exec(compile(code, "attn_utils.py", "exec"), namespace)
    init = namespace["init_kv_cache"]
    raw = init([], {}, _Config(), layouts,  # type: ignore[operator]
               torch.device("cpu"), "auto", [16], None)
    assert {k: v.numel() for k, v in raw.items()} == {"a": 64, "b": 96, "c": 96}
    assert raw["b"] is raw["c"] and raw["a"] is not raw["b"]
    assert all(v.dtype == torch.int8 and not v.any() for v in raw.values())


@pytest.mark.parametrize(("codemod", "other_release"), [
    (ModelRunnerV2BackendsKVBuffers, "vllm-kv-buffers-mrv2-groups"),
    (ModelRunnerV2GroupsKVBuffers, "vllm-kv-buffers-mrv2-backends"),
])
def test_model_runner_v2_variant_does_not_match_a_caller_without_its_layouts(
        codemod: type[HitCountingCodemod], other_release: str) -> None:
    # 0.22's caller holds `attn_backends`, 0.23's `attn_groups`: each variant passing a name the
    # other release's caller does not bind would compile and fail only at start (NameError),
    # so it must fall short of its expected hits there instead of matching.
    hits, _, code = run(codemod, fixture(other_release))
    assert hits < 3
    assert f"{codemod.GROUPS}={codemod.GROUPS}" not in code


@pytest.mark.parametrize(("codemod", "transform_id"), [
    (KVBudgetPlannedInWholePages, "vllm-kv-budget-planned"),
    (KVBudgetPlannedByBuilder, "vllm-kv-budget-planned-builder"),
    # 0.10: the ranks unified without resizing, each tensor scaled by the model's page
    (KVBudgetPlannedForUnifiedRanks, "vllm-kv-budget-planned-unified"),
])
def test_kv_budget_is_sized_as_stock_and_the_workers_plan_is_whole_pages(
        codemod: type[HitCountingCodemod], transform_id: str) -> None:
    hits, code = assert_rewrites_fixture(codemod, transform_id)
    assert hits == 2  # the budget and EngineCore's initialize_from_config, not Other's
    compile(code, "core.py", "exec")
    assert_idempotent(codemod, code)


@pytest.mark.parametrize(("codemod", "plan"), [
    # 0.29 - 0.31: the planner of 0.32, whose bytes-per-block helper takes the groups only
    (KVBudgetPlannedForGroups,
     "plan=lambda groups, num_blocks: _kvcached_get_kv_cache_config_from_groups(vllm_config, "
     "groups, num_blocks * _kvcached__pool_bytes_per_block(groups))"),
    # 0.27 - 0.28: no planner call, kvcached scales the tensors as the release scales ranks
    (KVBudgetPlannedByScaling, "plan=None"),
])
def test_older_kv_budget_plans_differ_from_0_32_in_the_plan_only(
        codemod: type[HitCountingCodemod], plan: str) -> None:
    # Their EngineCore._initialize_kv_caches has 0.32's shape (the same fixture).
    hits, _, code = run(codemod, fixture("vllm-kv-budget-planned"))
    assert hits == 2
    assert f"kv_cache_configs_in_whole_pages(kv_cache_configs, vllm_config=vllm_config, {plan})" \
        in code
    assert "planned_in_whole_pages=True" in code
    assert ("_kvcached_get_kv_cache_config_from_groups" in code) == (plan != "plan=None")
    compile(code, "core.py", "exec")
    assert_idempotent(codemod, code)


@pytest.mark.parametrize(("codemod", "other_release"), [
    (KVBudgetPlannedInWholePages, "vllm-kv-budget-planned-builder"),
    (KVBudgetPlannedByBuilder, "vllm-kv-budget-planned"),
    (KVBudgetPlannedForGroups, "vllm-kv-budget-planned-builder"),
    (KVBudgetPlannedByScaling, "vllm-kv-budget-planned-builder"),
    (KVBudgetPlannedByScaling, "vllm-kv-budget-planned-unified"),
    (KVBudgetPlannedForUnifiedRanks, "vllm-kv-budget-planned"),
])
def test_kv_budget_plan_variant_leaves_a_release_planning_elsewhere(
        codemod: type[HitCountingCodemod], other_release: str) -> None:
    # The workers' plan is rewritten only where EngineCore imports get_kv_cache_configs from
    # the variant's planner module: one hit instead of two, which the build refuses.
    hits, _, code = run(codemod, fixture(other_release))
    assert hits == 1
    assert "kv_cache_configs_in_whole_pages" not in code
