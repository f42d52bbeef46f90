"""codemods/sglang: before/after cases, hit counting, idempotency and fail-closed no-matches.

Each codemod's expected output is a whole file: tests/transforms/fixtures/<transform id>/
before.py is the upstream snippet, after.py exactly what the codemod must make of it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from libcst.codemod import CodemodContext, TransformSuccess, transform_module

from codemods.base import BuildContext, HitCountingCodemod
from codemods.catalog import CODEMODS
from codemods.sglang.allocator_paged import ElasticPagedAllocator
from codemods.sglang.allocator_paged_device_lengths import ElasticPagedAllocatorDeviceLengths
from codemods.sglang.allocator_paged_one_module import ElasticPagedAllocatorOneModule
from codemods.sglang.allocator_paged_release_page_ids import ElasticPagedAllocatorReleasePageIds
from codemods.sglang.allocator_swa import ElasticSWAAllocator, RefusePureSWAAllocator
from codemods.sglang.allocator_swa_before_budget import ElasticSWAAllocatorBeforeBudget
from codemods.sglang.allocator_swa_model_runner import ElasticSWAAllocatorModelRunner
from codemods.sglang.allocator_token import ElasticTokenAllocator
from codemods.sglang.allocator_token_copies_deferred import ElasticTokenAllocatorFreeGroupFlagCopies
from codemods.sglang.allocator_token_free_group_none import ElasticTokenAllocatorFreeGroupNone
from codemods.sglang.allocators_free_group_flag import (
    ElasticPagedAllocatorFreeGroupFlag,
    ElasticTokenAllocatorFreeGroupFlag,
)
from codemods.sglang.allocators_one_module import ElasticPagedAllocatorCountsItsPages
from codemods.sglang.capacity import KVBudgetCapacity
from codemods.sglang.capacity_model_runner import KVBudgetCapacityModelRunner
from codemods.sglang.config_guard_mixin_envs_local import (
    RefuseUnsupportedAtInitMemoryPoolEnvsLocal,
)
from codemods.sglang.config_guard_model_runner import RefuseUnsupportedAtInitMemoryPool
from codemods.sglang.config_guard_model_runner_swa import RefuseUnsupportedAtInitMemoryPoolSwa
from codemods.sglang.config_guard_runner_gdn import RefuseUnsupportedAtRunnerInitMemoryPoolGdn
from codemods.sglang.config_guard_runner_swa import RefuseUnsupportedAtRunnerInitMemoryPoolSwa
from codemods.sglang.config_guard_server_args import RefuseUnsupportedAtConfigureServerArgs
from codemods.sglang.config_guard_swa import RefuseUnsupportedAtConfigureSwa
from codemods.sglang.model_runner_sizing import (
    ElasticKVProfileMemoryRunner,
    KVBudgetCapacityRunner,
    RefuseUnsupportedAtRunnerInitMemoryPool,
    RefuseUnsupportedAtRunnerInitMemoryPoolBeforeMamba,
)
from codemods.sglang.pool_mha import ElasticMHAPool, ElasticMHASeparateKVPool
from codemods.sglang.pool_mha_inline import ElasticMHAInlineBuffersPool
from codemods.sglang.pool_mla import ElasticMLAPool
from codemods.sglang.pool_mla_inline import ElasticInlineMLAPool
from codemods.sglang.prefix_cache_bound import BoundPrefixCacheOnRelease
from codemods.sglang.prefix_cache_bound_tree import BoundRadixTreeOnFinishedRequest
from codemods.sglang.profile_max_num_token import (
    ElasticKVProfileMemoryTokens,
    KVBudgetCapacityTokens,
)
from codemods.sglang.scheduler_capacity import SchedulerCapacityBatchEviction
from codemods.sglang.scheduler_capacity_sides import (
    SchedulerCapacitySidesAllocatorDecodeCheck,
    SchedulerCapacitySidesCheckDecodeMem,
)
from codemods.sglang.startup_memory import ElasticKVProfileMemory, ElasticPreModelLoadMemory
from codemods.sglang.startup_memory_at_init import ElasticPreModelLoadMemoryAtInit
from codemods.sglang.startup_memory_model_runner import (
    ElasticKVProfileMemoryModelRunner,
    ElasticPreModelLoadMemoryModelRunner,
)
from forge.registry import default_registry

BUILD = BuildContext(
    cell="sglang-0.5.23", engine="sglang", package="sglang", upstream_version="0.5.23",
    built_version="0.5.23+kvcached.1", base_artifact="sglang.whl", base_sha256="00" * 32,
    transform_ids=(), fingerprint="11" * 32, toolkit_version="0.1.0",
)
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture(transform_id: str, name: str = "before.py") -> str:
    return (FIXTURES / transform_id / name).read_text(encoding="utf-8")


def run(codemod: type[HitCountingCodemod], source: str) -> tuple[HitCountingCodemod, str]:
    command = codemod(CodemodContext(filename="x.py"), BUILD)
    result = transform_module(command, textwrap.dedent(source))
    assert isinstance(result, TransformSuccess)
    return command, result.code


def assert_rewrites_fixture(codemod: type[HitCountingCodemod], transform_id: str) -> str:
    """The codemod makes exactly after.py of before.py, in one hit, and nothing on a rerun."""
    command, code = run(codemod, fixture(transform_id))
    assert (command.hits, command.already_applied) == (1, 0)
    assert code == fixture(transform_id, "after.py")
    again, same = run(codemod, code)
    assert (again.hits, again.already_applied, same) == (0, 1, code)
    return code


def test_every_fixture_names_a_registered_sglang_transform() -> None:
    registered = {t.id for t in default_registry().codemods}
    for folder in sorted(FIXTURES.glob("sglang-*")):
        assert folder.name in registered, f"fixtures for an unknown transform: {folder.name}"
        assert sorted(p.name for p in folder.glob("*.py")) == ["after.py", "before.py"]


TOKEN = fixture("sglang-token-allocator")
TOKEN_0516 = fixture("sglang-token-allocator-free-group-flag")
PAGED_0516 = fixture("sglang-paged-allocator-free-group-flag")
GUARD_0516 = fixture("sglang-refuse-unsupported-server-args")
INLINE_KV = fixture("sglang-mha-pool-inline-buffers")
TOKEN_0518 = fixture("sglang-token-allocator-copies-deferred")
TOKEN_0519 = fixture("sglang-token-allocator-free-group-none")
PAGED_0518 = fixture("sglang-paged-allocator-release-page-ids")


def test_token_allocator_gets_an_elastic_subclass_and_a_guarded_rebinding() -> None:
    assert_rewrites_fixture(ElasticTokenAllocator, "sglang-token-allocator")


@pytest.mark.parametrize(("codemod", "source"), [
    # upstream renamed a method the mixin overrides: no match, the build stops
    (ElasticTokenAllocator, TOKEN.replace("free_page_ids", "release_ids")),
    # the class is not defined here (moved to another module)
    (ElasticTokenAllocator, "from x import TokenToKVPoolAllocator\n"),
    (ElasticPagedAllocator, TOKEN.replace("TokenToKV", "PagedTokenToKV")),
    (ElasticMHAPool, "class MHATokenToKVPool:\n    def _create_buffers(self): ...\n"),
    # each MHA variant refuses the other's K/V layout
    (ElasticMHAPool, fixture("sglang-mha-pool-separate-kv")),
    (ElasticMHASeparateKVPool, fixture("sglang-mha-pool")),
    # 0.5.21's variant of the pre-load read finds no measure_pre_model_load_memory in 0.5.20
    (ElasticPreModelLoadMemory, fixture("sglang-startup-free-memory-at-init")),
    # a layout neither variant knows (V no longer a per-layer list)
    (ElasticMHAPool, fixture("sglang-mha-pool").replace(
        "self.v_buffer = [buf[1, :rows] for buf in fused]", "self.v_buffer = fused")),
    (ElasticMLAPool, "class MLATokenToKVPool:\n    def __init__(self): ...\n"),
    # each allocator API refuses the other's classes: 0.5.16 has no free_page_ids, 0.5.20
    # no free-group flag
    (ElasticTokenAllocator, TOKEN_0516),
    (ElasticPagedAllocator, PAGED_0516),
    (ElasticTokenAllocatorFreeGroupFlag, TOKEN),
    (ElasticPagedAllocatorFreeGroupFlag, fixture("sglang-paged-allocator")),
    # 0.5.19 replaced the flag by `free_group is None`: the flag variants no longer fit
    (ElasticTokenAllocatorFreeGroupFlag,
     TOKEN_0516.replace("self.is_not_in_free_group = True", "self.free_group = None")),
    (ElasticPagedAllocatorFreeGroupFlag,
     PAGED_0516.replace("self.is_not_in_free_group = True", "self.free_group = None")),
    # a free path the flag mixins do not override (0.5.17's free_segment) would bypass them
    (ElasticPagedAllocatorFreeGroupFlag,
     PAGED_0516 + "\n    def free_segment(self, free_index, *, start_pos): ...\n"),
    (ElasticTokenAllocatorFreeGroupFlag,
     TOKEN_0516 + "\n    def free_page_ids(self, page_ids): ...\n"),
    # 0.5.17 - 0.5.19: the paged variant needs _release_page_ids and free_segment and refuses
    # 0.5.20's free_page_ids; the token variants need their own free group and refuse the others'
    (ElasticPagedAllocatorReleasePageIds, PAGED_0516),
    (ElasticPagedAllocatorReleasePageIds, fixture("sglang-paged-allocator")),
    (ElasticPagedAllocator, PAGED_0518),
    (ElasticPagedAllocatorFreeGroupFlag, PAGED_0518),
    (ElasticTokenAllocatorFreeGroupFlagCopies, TOKEN_0516),
    (ElasticTokenAllocatorFreeGroupFlagCopies, TOKEN_0519),
    (ElasticTokenAllocatorFreeGroupNone, TOKEN_0516),
    (ElasticTokenAllocatorFreeGroupNone, TOKEN_0518),
    (ElasticTokenAllocatorFreeGroupNone, TOKEN),
    (ElasticTokenAllocator, TOKEN_0519),
    (ElasticTokenAllocatorFreeGroupFlag, TOKEN_0519),
    # in mem_cache/allocator.py, alloc_extend with num_new_pages (0.5.12) and without it
    # (0.5.3 - 0.5.11) refuse each other
    (ElasticPagedAllocatorOneModule, fixture("sglang-paged-allocator-counts-its-pages")),
    (ElasticPagedAllocatorCountsItsPages, fixture("sglang-paged-allocator-one-module")),
    # the KV mixin's guard that imports envs itself (0.5.7 - 0.5.9) and the one that finds it
    # imported (0.5.10 on) refuse each other's module
    (RefuseUnsupportedAtInitMemoryPoolEnvsLocal, fixture("sglang-refuse-unsupported-model-runner")),
    (RefuseUnsupportedAtInitMemoryPool, fixture("sglang-refuse-unsupported-mixin-envs-local")),
    # 0.5.2's guard needs is_hybrid_gdn and no mambaish_config: 0.5.1 has neither, 0.5.3 both
    (RefuseUnsupportedAtRunnerInitMemoryPoolGdn,
     fixture("sglang-refuse-unsupported-runner-before-mamba")),
    (RefuseUnsupportedAtRunnerInitMemoryPoolGdn, fixture("sglang-refuse-unsupported-runner")),
    # 0.5.6's guard needs the runner's is_hybrid_swa (is_hybrid up to 0.5.5)
    (RefuseUnsupportedAtRunnerInitMemoryPoolSwa, fixture("sglang-refuse-unsupported-runner")),
    # the ServerArgs guard needs the configurator's server_args and no get_exec() settings
    (RefuseUnsupportedAtConfigureServerArgs, fixture("sglang-refuse-unsupported-swa")),
    (RefuseUnsupportedAtConfigureServerArgs,
     "from sglang.srt.runtime_context import get_exec\n" + GUARD_0516),
    # the inline-buffers pool (0.5.13) and the _create_buffers_normal pools (0.5.16 on) refuse
    # each other's source
    (ElasticMHAInlineBuffersPool, fixture("sglang-mha-pool-separate-kv")),
    (ElasticMHAInlineBuffersPool, fixture("sglang-mha-pool")),
    (ElasticMHASeparateKVPool, INLINE_KV),
    (ElasticMHAPool, INLINE_KV),
    # V no longer a per-layer list of allocations of its own
    (ElasticMHAInlineBuffersPool,
     INLINE_KV.replace("self.v_buffer = [", "self.v_buffer = self.k_buffer or [")),
    # the model runner's variants find nothing in 0.5.16's configurator, and 0.5.16's
    # variants nothing in 0.5.13's model runner
    (KVBudgetCapacityModelRunner, fixture("sglang-kv-budget")),
    (KVBudgetCapacity, fixture("sglang-kv-budget-model-runner")),
    (ElasticKVProfileMemory, fixture("sglang-kv-profile-free-memory-model-runner")),
    (RefuseUnsupportedAtConfigureServerArgs, fixture("sglang-refuse-unsupported-model-runner")),
    (RefuseUnsupportedAtInitMemoryPool, GUARD_0516),
    (ElasticPreModelLoadMemoryAtInit, fixture("sglang-startup-free-memory-model-runner")),
    (ElasticPreModelLoadMemoryModelRunner, fixture("sglang-startup-free-memory-at-init")),
    # a runner that no longer records whether it is a draft worker: the window rule is unknown
    (ElasticPreModelLoadMemoryModelRunner, fixture("sglang-startup-free-memory-model-runner")
     .replace("self.is_draft_worker = is_draft_worker", "self.draft = is_draft_worker")),
    # 0.5.12 gave alloc_extend the batch's new-page count: the 0.5.10 variant no longer fits
    (ElasticPagedAllocatorCountsItsPages, PAGED_0516),
    # the token-count profile (0.5.10) and the byte-budget one (0.5.11 on) refuse each other
    (KVBudgetCapacityTokens, fixture("sglang-kv-budget-model-runner")),
    (KVBudgetCapacityModelRunner, fixture("sglang-kv-budget-tokens")),
    (ElasticKVProfileMemoryTokens, fixture("sglang-kv-profile-free-memory-model-runner")),
    (ElasticKVProfileMemoryModelRunner, fixture("sglang-kv-profile-free-memory-tokens")),
    # a token profile that no longer returns bytes divided by the cell size
    (KVBudgetCapacityTokens, fixture("sglang-kv-budget-tokens").replace(
        "return int(rest_memory * (1 << 30)) // cell_size",
        "return max(0, int(rest_memory * (1 << 30)) // cell_size)")),
    # the inline MLA pool (0.5.5) and the _create_buffers one (0.5.6 on) refuse each other
    (ElasticInlineMLAPool, fixture("sglang-mla-pool")),
    (ElasticMLAPool, fixture("sglang-mla-pool-inline")),
    # ModelRunner's own sizing (0.5.5) and the KV mixin's (0.5.7 on) refuse each other
    (KVBudgetCapacityRunner, fixture("sglang-kv-budget-tokens")),
    (KVBudgetCapacityTokens, fixture("sglang-kv-budget-runner")),
    (ElasticKVProfileMemoryRunner, fixture("sglang-kv-profile-free-memory-tokens")),
    (ElasticKVProfileMemoryTokens, fixture("sglang-kv-profile-free-memory-runner")),
    (RefuseUnsupportedAtInitMemoryPool, fixture("sglang-refuse-unsupported-runner")),
    (RefuseUnsupportedAtRunnerInitMemoryPool, fixture("sglang-refuse-unsupported-model-runner")),
    # a profile that no longer divides by the per-token cell size
    (KVBudgetCapacityRunner, fixture("sglang-kv-budget-runner").replace(
        "// cell_size)", "// (cell_size * 2))")),
    # the tree's release moved to mem_cache/common.py::release_kv_cache (0.5.6 on), and back
    (BoundRadixTreeOnFinishedRequest, fixture("sglang-prefix-cache-bound")),
    (BoundPrefixCacheOnRelease, fixture("sglang-prefix-cache-bound-radix-tree")),
    # the paged allocator with device lengths only (0.5.1) and with CPU lengths (0.5.3 on)
    # refuse each other
    (ElasticPagedAllocatorCountsItsPages, fixture("sglang-paged-allocator-device-lengths")),
    (ElasticPagedAllocatorDeviceLengths, fixture("sglang-paged-allocator-counts-its-pages")),
    # the guard naming Mamba pools and the one before them refuse each other's runner
    (RefuseUnsupportedAtRunnerInitMemoryPool,
     fixture("sglang-refuse-unsupported-runner-before-mamba")),
    (RefuseUnsupportedAtRunnerInitMemoryPoolBeforeMamba,
     fixture("sglang-refuse-unsupported-runner")),
    # the guard's settings moved to get_exec()
    (RefuseUnsupportedAtInitMemoryPool,
     "from sglang.srt.runtime_context import get_exec\n"
     + fixture("sglang-refuse-unsupported-model-runner")),
])
def test_a_moved_or_changed_anchor_matches_nothing(codemod: type[HitCountingCodemod],
                                                   source: str) -> None:
    command, code = run(codemod, source)
    assert (command.hits, command.already_applied) == (0, 0)
    assert code == textwrap.dedent(source)


@pytest.mark.parametrize(("codemod", "transform_id"), [
    (ElasticMHAPool, "sglang-mha-pool"),
    (ElasticMHASeparateKVPool, "sglang-mha-pool-separate-kv"),
    # the MLA pool is rewritten, the MHA pool in the same module is not
    (ElasticMLAPool, "sglang-mla-pool"),
    (ElasticPagedAllocator, "sglang-paged-allocator"),
    (KVBudgetCapacity, "sglang-kv-budget"),
    (BoundPrefixCacheOnRelease, "sglang-prefix-cache-bound"),
    (ElasticPreModelLoadMemoryAtInit, "sglang-startup-free-memory-at-init"),
    (ElasticTokenAllocatorFreeGroupFlag, "sglang-token-allocator-free-group-flag"),
    (ElasticPagedAllocatorFreeGroupFlag, "sglang-paged-allocator-free-group-flag"),
    (RefuseUnsupportedAtConfigureServerArgs, "sglang-refuse-unsupported-server-args"),
    (ElasticMHAInlineBuffersPool, "sglang-mha-pool-inline-buffers"),
    (KVBudgetCapacityModelRunner, "sglang-kv-budget-model-runner"),
    (ElasticKVProfileMemoryModelRunner, "sglang-kv-profile-free-memory-model-runner"),
    (ElasticPreModelLoadMemoryModelRunner, "sglang-startup-free-memory-model-runner"),
    (RefuseUnsupportedAtInitMemoryPool, "sglang-refuse-unsupported-model-runner"),
    (ElasticTokenAllocatorFreeGroupFlag, "sglang-token-allocator-one-module"),
    (ElasticPagedAllocatorCountsItsPages, "sglang-paged-allocator-counts-its-pages"),
    (KVBudgetCapacityTokens, "sglang-kv-budget-tokens"),
    (ElasticKVProfileMemoryTokens, "sglang-kv-profile-free-memory-tokens"),
    (ElasticInlineMLAPool, "sglang-mla-pool-inline"),
    (KVBudgetCapacityRunner, "sglang-kv-budget-runner"),
    (ElasticKVProfileMemoryRunner, "sglang-kv-profile-free-memory-runner"),
    (RefuseUnsupportedAtRunnerInitMemoryPool, "sglang-refuse-unsupported-runner"),
    (BoundRadixTreeOnFinishedRequest, "sglang-prefix-cache-bound-radix-tree"),
    (ElasticPagedAllocatorDeviceLengths, "sglang-paged-allocator-device-lengths"),
    (RefuseUnsupportedAtRunnerInitMemoryPoolBeforeMamba,
     "sglang-refuse-unsupported-runner-before-mamba"),
    (ElasticPagedAllocatorReleasePageIds, "sglang-paged-allocator-release-page-ids"),
    (ElasticTokenAllocatorFreeGroupFlagCopies, "sglang-token-allocator-copies-deferred"),
    (ElasticTokenAllocatorFreeGroupNone, "sglang-token-allocator-free-group-none"),
    (ElasticPagedAllocatorOneModule, "sglang-paged-allocator-one-module"),
    (RefuseUnsupportedAtInitMemoryPoolEnvsLocal, "sglang-refuse-unsupported-mixin-envs-local"),
    (RefuseUnsupportedAtRunnerInitMemoryPoolGdn, "sglang-refuse-unsupported-runner-gdn"),
    (RefuseUnsupportedAtRunnerInitMemoryPoolSwa, "sglang-refuse-unsupported-runner-swa"),
    (RefuseUnsupportedAtConfigureSwa, "sglang-refuse-unsupported-swa"),
    (ElasticSWAAllocator, "sglang-swa-allocator"),
    (ElasticSWAAllocatorBeforeBudget, "sglang-swa-allocator-before-budget"),
    (ElasticSWAAllocatorModelRunner, "sglang-swa-allocator-model-runner"),
    (RefuseUnsupportedAtInitMemoryPoolSwa, "sglang-refuse-unsupported-model-runner-swa"),
    (RefusePureSWAAllocator, "sglang-pure-swa-refused"),
])
def test_codemod_rewrites_its_fixture_whole(codemod: type[HitCountingCodemod],
                                            transform_id: str) -> None:
    assert_rewrites_fixture(codemod, transform_id)


def test_pool_and_allocator_fixtures_hold_every_required_method() -> None:
    """The fixtures' classes carry the full anchor the codemods check for."""
    for codemod, transform_id, cls in [
            (ElasticMHAPool, "sglang-mha-pool", "MHATokenToKVPool"),
            (ElasticMHASeparateKVPool, "sglang-mha-pool-separate-kv", "MHATokenToKVPool"),
            (ElasticMHAInlineBuffersPool, "sglang-mha-pool-inline-buffers", "MHATokenToKVPool"),
            (ElasticMLAPool, "sglang-mla-pool", "MLATokenToKVPool"),
            (ElasticPagedAllocator, "sglang-paged-allocator", "PagedTokenToKVPoolAllocator"),
            (ElasticTokenAllocatorFreeGroupFlag, "sglang-token-allocator-free-group-flag",
             "TokenToKVPoolAllocator"),
            (ElasticPagedAllocatorFreeGroupFlag, "sglang-paged-allocator-free-group-flag",
             "PagedTokenToKVPoolAllocator"),
            (ElasticTokenAllocatorFreeGroupFlag, "sglang-token-allocator-one-module",
             "TokenToKVPoolAllocator"),
            (ElasticPagedAllocatorCountsItsPages, "sglang-paged-allocator-counts-its-pages",
             "PagedTokenToKVPoolAllocator"),
            (ElasticPagedAllocatorDeviceLengths, "sglang-paged-allocator-device-lengths",
             "PagedTokenToKVPoolAllocator"),
            (ElasticPagedAllocatorReleasePageIds, "sglang-paged-allocator-release-page-ids",
             "PagedTokenToKVPoolAllocator"),
            (ElasticTokenAllocatorFreeGroupFlagCopies, "sglang-token-allocator-copies-deferred",
             "TokenToKVPoolAllocator"),
            (ElasticTokenAllocatorFreeGroupNone, "sglang-token-allocator-free-group-none",
             "TokenToKVPoolAllocator"),
            (ElasticSWAAllocator, "sglang-swa-allocator", "SWATokenToKVPoolAllocator"),
            (ElasticSWAAllocatorBeforeBudget, "sglang-swa-allocator-before-budget",
             "SWATokenToKVPoolAllocator"),
            (ElasticSWAAllocatorModelRunner, "sglang-swa-allocator-model-runner",
             "SWATokenToKVPoolAllocator"),
            (RefusePureSWAAllocator, "sglang-pure-swa-refused",
             "PureSWATokenToKVPoolAllocator")]:
        body = fixture(transform_id).split(f"class {cls}", 1)[1].split("\nclass ", 1)[0]
        for name in codemod.REQUIRED_METHODS:
            assert f"def {name}(" in body, (transform_id, name)


def test_inline_mla_allocation_moves_into_create_buffers_reading_only_kept_fields() -> None:
    inline = fixture("sglang-mla-pool-inline")
    # 0.4.10 - 0.5.2 read the LoRA rank and rope dims, kept as fields of the same name
    older = inline.replace("(size + page_size, 1, self.kv_cache_dim)",
                           "(size + page_size, 1, kv_lora_rank + qk_rope_head_dim)")
    command, code = run(ElasticInlineMLAPool, older)
    assert command.hits == 1
    create = code.split("def _create_buffers(self):", 1)[1].split("def _clear_buffers", 1)[0]
    assert "(self.size + self.page_size, 1, self.kv_lora_rank + self.qk_rope_head_dim)" in create
    assert "device=self.device" in create and "range(self.layer_num)" in create
    init = code.split("def __init__(", 1)[1].split("def _create_buffers", 1)[0]
    assert "torch.zeros" not in init and "self._create_buffers()" in init
    # ... the data pointers are still taken after the buffers exist
    assert init.index("self._create_buffers()") < init.index("self.data_ptrs")
    for changed in [
            # a parameter the class keeps under another name: the method could not read it
            older.replace("self.kv_lora_rank = kv_lora_rank", "self.lora = kv_lora_rank"),
            # a local computed in __init__ before the allocation
            inline.replace("        with self.memory_saver_adapter.region(",
                           "        rows = size + page_size\n"
                           "        with self.memory_saver_adapter.region(", 1)
            .replace("(size + page_size, 1, self.kv_cache_dim)", "(rows, 1, self.kv_cache_dim)"),
            # the buffers allocated outside the memory-saver region
            inline.replace("with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):",
                           "with nullcontext():"),
            # a second region statement
            inline.replace("        self.data_ptrs = torch.tensor(",
                           "        with self.memory_saver_adapter.region(KV):\n"
                           "            self.kv_buffer = []\n"
                           "        self.data_ptrs = torch.tensor(", 1)]:
        assert changed != inline and changed != older
        command, code = run(ElasticInlineMLAPool, changed)
        assert (command.hits, command.already_applied) == (0, 0)
        assert code == textwrap.dedent(changed)


def test_prefix_bound_needs_release_kv_cache() -> None:
    missing, code = run(BoundPrefixCacheOnRelease, "def release(req):\n    pass\n")
    assert (missing.hits, code) == (0, "def release(req):\n    pass\n")


def test_each_sglang_release_gets_one_variant_per_seam_and_its_own_kv_layout() -> None:
    sglang = {t.id: t for t in CODEMODS if t.engine == "sglang"}
    newer_api = {"sglang-token-allocator", "sglang-paged-allocator"}
    # from 0.5.16 the sliding-window allocator is elastic and the guard lets window models in
    # (0.5.16's guard reads the ServerArgs); up to 0.5.20 the scheduler reads the composite's
    # sides itself
    window = {"sglang-refuse-unsupported-swa", "sglang-pure-swa-refused"}
    window_api = newer_api | window | {"sglang-swa-allocator"}
    window_read = window | {"sglang-swa-allocator-before-budget"}
    older_api = {"sglang-token-allocator-free-group-flag",
                 "sglang-paged-allocator-free-group-flag"}
    configurator = {"sglang-kv-budget", "sglang-kv-profile-free-memory"}
    model_runner = {"sglang-kv-budget-model-runner", "sglang-kv-profile-free-memory-model-runner",
                    "sglang-refuse-unsupported-model-runner",
                    "sglang-startup-free-memory-model-runner"}
    model_runner_window = model_runner - {"sglang-refuse-unsupported-model-runner"} | {
        "sglang-refuse-unsupported-model-runner-swa", "sglang-swa-allocator-model-runner"}
    # every SGLang cell from 0.5.10 takes the same one; the rest are one variant of a seam
    # that moved
    check_decode_mem = "sglang-scheduler-capacity-check-decode-mem"
    sides_check_decode_mem = "sglang-scheduler-capacity-sides-check-decode-mem"
    same_everywhere = {"sglang-mla-pool", "sglang-prefix-cache-bound"}
    variants = {
        "0.5.23": {"sglang-mha-pool", "sglang-startup-free-memory", *window_api,
                   *configurator},
        "0.5.22": {"sglang-mha-pool-separate-kv", "sglang-startup-free-memory", *window_api,
                   *configurator},
        "0.5.21": {"sglang-mha-pool-separate-kv", "sglang-startup-free-memory", *window_api,
                   *configurator},
        "0.5.20": {"sglang-mha-pool-separate-kv", "sglang-startup-free-memory-at-init",
                   "sglang-scheduler-capacity", *newer_api, *window_read, *configurator},
        # 0.5.17 - 0.5.19 mix the two allocator APIs: 0.5.20's guard, a paged variant that
        # ends in _release_page_ids, and the token allocator of their own free group
        "0.5.19": {"sglang-mha-pool-separate-kv", "sglang-startup-free-memory-at-init",
                   "sglang-paged-allocator-release-page-ids",
                   "sglang-token-allocator-free-group-none", "sglang-scheduler-capacity",
                   *window_read, *configurator},
        "0.5.18": {"sglang-mha-pool-separate-kv", "sglang-startup-free-memory-at-init",
                   "sglang-paged-allocator-release-page-ids",
                   "sglang-token-allocator-copies-deferred", sides_check_decode_mem,
                   *window_read, *configurator},
        "0.5.17": {"sglang-mha-pool-separate-kv", "sglang-startup-free-memory-at-init",
                   "sglang-paged-allocator-release-page-ids",
                   "sglang-token-allocator-free-group-flag", sides_check_decode_mem,
                   *window_read, *configurator},
        "0.5.16": {"sglang-mha-pool-separate-kv", "sglang-startup-free-memory-at-init",
                   "sglang-refuse-unsupported-server-args", sides_check_decode_mem, *older_api,
                   "sglang-swa-allocator-before-budget", "sglang-pure-swa-refused",
                   *configurator},
        # 0.5.13 - 0.5.15: the model runner's window guard and composite (the all-window
        # allocator from 0.5.15); 0.5.12 keeps the guard that refuses window models
        "0.5.15.post1": {"sglang-mha-pool-inline-buffers", sides_check_decode_mem, *older_api,
                         *model_runner_window, "sglang-pure-swa-refused"},
        "0.5.13": {"sglang-mha-pool-inline-buffers", sides_check_decode_mem, *older_api,
                   *model_runner_window},
        "0.5.12.post1": {"sglang-mha-pool-inline-buffers", "sglang-token-allocator-one-module",
                         "sglang-paged-allocator-one-module", check_decode_mem, *model_runner},
        "0.5.11": {"sglang-mha-pool-inline-buffers", "sglang-token-allocator-one-module",
                   "sglang-paged-allocator-counts-its-pages", check_decode_mem, *model_runner},
        "0.5.10": {"sglang-mha-pool-inline-buffers", "sglang-token-allocator-one-module",
                   "sglang-paged-allocator-counts-its-pages", "sglang-kv-budget-tokens",
                   "sglang-kv-profile-free-memory-tokens",
                   "sglang-refuse-unsupported-model-runner",
                   "sglang-startup-free-memory-model-runner", check_decode_mem},
        # the KV mixin of 0.5.9 imports no envs: its guard imports it
        "0.5.9": {"sglang-mha-pool-inline-buffers", "sglang-token-allocator-one-module",
                  "sglang-paged-allocator-counts-its-pages", "sglang-kv-budget-tokens",
                  "sglang-kv-profile-free-memory-tokens",
                  "sglang-refuse-unsupported-mixin-envs-local",
                  "sglang-startup-free-memory-model-runner", check_decode_mem},
    }
    # 0.5.6 - 0.5.8: the MLA pool of 0.5.9 on, the tree's own bound of 0.5.5 and before;
    # the runner sizes the pools in 0.5.6 (its guard with 0.5.7's settings), the KV mixin
    # from 0.5.7
    mid = {"sglang-mha-pool-inline-buffers", "sglang-token-allocator-one-module",
           "sglang-paged-allocator-counts-its-pages", "sglang-mla-pool",
           "sglang-startup-free-memory-model-runner", "sglang-prefix-cache-bound-radix-tree"}
    variants["0.5.8.post1"] = variants["0.5.7"] = mid | {
        "sglang-kv-budget-tokens", "sglang-kv-profile-free-memory-tokens",
        "sglang-refuse-unsupported-mixin-envs-local",
        "sglang-scheduler-capacity-available-size-sufficient"}
    variants["0.5.6.post2"] = mid | {"sglang-kv-budget-runner",
                                     "sglang-kv-profile-free-memory-runner",
                                     "sglang-refuse-unsupported-runner-swa",
                                     "sglang-scheduler-capacity-retract-reads"}
    oldest = {"sglang-mha-pool-inline-buffers", "sglang-token-allocator-one-module",
              "sglang-paged-allocator-counts-its-pages", "sglang-mla-pool-inline",
              "sglang-kv-budget-runner", "sglang-kv-profile-free-memory-runner",
              "sglang-refuse-unsupported-runner", "sglang-startup-free-memory-model-runner",
              "sglang-prefix-cache-bound-radix-tree", "sglang-scheduler-capacity-retract-reads"}
    # before 0.5.3 the paged allocator gets device lengths only, before 0.5.2 no Mamba pools
    # (and ScheduleBatch evicts in its own method)
    before_mamba = oldest - {"sglang-paged-allocator-counts-its-pages",
                             "sglang-refuse-unsupported-runner",
                             "sglang-scheduler-capacity-retract-reads"} | {
        "sglang-paged-allocator-device-lengths", "sglang-refuse-unsupported-runner-before-mamba",
        "sglang-scheduler-capacity-batch-eviction"}
    # 0.5.2 has linear-attention (GDN) pools before the runner's mambaish_config
    gdn = before_mamba - {"sglang-refuse-unsupported-runner-before-mamba"} | {
        "sglang-refuse-unsupported-runner-gdn"}
    assert set(sglang) == (same_everywhere | oldest | before_mamba | gdn
                           | set().union(*variants.values()))

    def applying(version: str) -> set[str]:
        return {t.id for t in sglang.values() if t.applies_to("sglang", version)}

    for version, chosen in variants.items():
        expected = chosen if version in ("0.5.8.post1", "0.5.7", "0.5.6.post2") else (
            same_everywhere | chosen)
        assert applying(version) == expected, version
    assert applying("0.5.5") == applying("0.5.4.post3") == applying("0.5.3.post3") == oldest
    assert applying("0.5.2") == gdn
    assert applying("0.5.1") == applying("0.4.10.post2") == before_mamba
    for transform in sglang.values():
        assert not transform.applies_to("sglang", "0.4.9")
        assert not transform.applies_to("sglang", "0.5.24")
        assert not transform.applies_to("vllm", "0.5.23")


@pytest.mark.parametrize(("codemod", "transform_id", "hits"), [
    # the full and window sides' reads (one through a local `allocator`) count too
    (SchedulerCapacitySidesAllocatorDecodeCheck, "sglang-scheduler-capacity", 5),
    (SchedulerCapacitySidesCheckDecodeMem, "sglang-scheduler-capacity-sides-check-decode-mem",
     7),
    # the read in a function nested in retract_decode counts; the import goes in the method
    (SchedulerCapacityBatchEviction, "sglang-scheduler-capacity-batch-eviction", 4),
])
def test_scheduler_capacity_rewrites_the_decisions_and_nothing_else(
        codemod: type[HitCountingCodemod], transform_id: str, hits: int) -> None:
    command, code = run(codemod, fixture(transform_id))
    assert (command.hits, command.already_applied) == (hits, 0)
    assert code == fixture(transform_id, "after.py")
    compile(code, transform_id, "exec")
    again, same = run(codemod, code)
    assert (again.hits, same) == (0, code) and again.already_applied > 0
    if transform_id == "sglang-scheduler-capacity":
        # metrics reads stay as they were
        assert "return allocator.available_size(), allocator.swa_available_size()" in code
    if transform_id == "sglang-scheduler-capacity-sides-check-decode-mem":
        # the stock eviction's own side reads and a metrics read stay as they were
        assert code.count("allocator.full_available_size()") == 2
        assert code.count("allocator.swa_available_size()") == 2
        assert "_kvcached_allocatable_size(self.token_to_kv_pool_allocator) >= num_tokens" in code


def test_scheduler_capacity_helpers_see_the_limit_and_leave_stock_allocators_alone() -> None:
    from kvcached_core.integration.sglang.capacity import allocatable_size, evict_under_limit

    class StockAllocator:
        def available_size(self) -> int:
            return 100

    class ElasticAllocator(StockAllocator):
        allocatable = -8  # the pool holds 8 slots more than a lowered limit allows

        def kvcached_allocatable_size(self) -> int:
            return self.allocatable

    class Tree:
        def __init__(self, allocator: object) -> None:
            self.token_to_kv_pool_allocator = allocator
            self.evicted: list[int] = []

        def evictable_size(self) -> int:
            return 64

        def evict(self, num_tokens: int) -> None:  # the token-count API before 0.5.9
            self.evicted.append(num_tokens)

    assert allocatable_size(StockAllocator()) == 100
    assert allocatable_size(ElasticAllocator()) == -8
    stock = Tree(StockAllocator())
    evict_under_limit(stock, 10)
    assert stock.evicted == []  # SGLang's own eviction is exact for a stock allocator
    elastic = Tree(ElasticAllocator())
    evict_under_limit(elastic, 10)
    assert elastic.evicted == [18]  # the 10 asked for and the 8 the limit withholds
    evict_under_limit(None, 10)  # no tree: nothing to do


def test_side_reads_see_each_sides_limit_and_evict_each_sides_shortfall() -> None:
    """0.5.16 - 0.5.20: the admission reads of a sliding-window model's full and window
    sides, and the eviction before an allocation, under each side's own limit."""
    from kvcached_core.integration.sglang.capacity import evict_under_limit, side_allocatable_size

    class Side:
        def __init__(self, allocatable: int) -> None:
            self.allocatable = allocatable

        def kvcached_allocatable_size(self) -> int:
            return self.allocatable

    class Composite:  # the elastic composite's shape (swa.py)
        def __init__(self) -> None:
            self.full_attn_allocator, self.swa_attn_allocator = Side(40), Side(-3)
            self.evicted_for: list[int] = []

        def full_available_size(self) -> int:
            return 500  # logical: what SGLang's leak check conserves

        def swa_available_size(self) -> int:
            return 200

        def kvcached_allocatable_size(self) -> int:
            return min(self.full_attn_allocator.allocatable, self.swa_attn_allocator.allocatable)

        def evict_to_free_tokens(self, tree_cache: object, num_tokens: int) -> None:
            self.evicted_for.append(num_tokens)

    class StockComposite:
        full_attn_allocator = swa_attn_allocator = object()

        def full_available_size(self) -> int:
            return 500

        def swa_available_size(self) -> int:
            return 200

    elastic = Composite()
    assert side_allocatable_size(elastic, "full") == 40
    assert side_allocatable_size(elastic, "swa") == -3  # 3 slots over a lowered window limit
    assert side_allocatable_size(StockComposite(), "full") == 500
    assert side_allocatable_size(StockComposite(), "swa") == 200

    class Tree:
        token_to_kv_pool_allocator = elastic

        def evictable_size(self) -> int:
            raise AssertionError("a composite's eviction is its own, side by side")

    evict_under_limit(Tree(), 16)
    assert elastic.evicted_for == [16]
