"""The catalogue: every codemod with its declaration, and the seams each engine requires.

The transform set of a cell is every codemod here whose engine matches (``*`` matches every
engine) and whose version range contains the cell's version, in this order, then the diffs of
``patches/<engine>/<series>/series`` (their header names their seam). `python -m forge
transforms <cell>` shows the set; `python -m forge check-matrix` checks every cell of the
matrix against ``REQUIRED_SEAMS``: each required seam covered by exactly one transform.
"""

from __future__ import annotations

from codemods.declare import ANY_ENGINE, CodemodDeclaration, RequiredSeam
from codemods.provenance import WriteProvenanceModule
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
from codemods.sglang.config_guard_mixin_envs_local import RefuseUnsupportedAtInitMemoryPoolEnvsLocal
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
from codemods.sglang.scheduler_capacity import (
    SchedulerCapacityAvailableSizeSufficient,
    SchedulerCapacityBatchEviction,
    SchedulerCapacityCheckDecodeMem,
    SchedulerCapacityRetractReads,
)
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
from codemods.vllm import allocate_slots as _vllm_allocate_slots
from codemods.vllm import block_pool as _vllm_block_pool
from codemods.vllm import engine_core as _vllm_engine_core
from codemods.vllm import engine_executor as _vllm_engine_executor
from codemods.vllm import kv_buffers as _vllm_kv_buffers
from codemods.vllm import kv_buffers_attn_groups as _vllm_kv_buffers_attn_groups
from codemods.vllm import kv_buffers_shared_helper as _vllm_kv_buffers_shared_helper
from codemods.vllm import kv_plan as _vllm_kv_plan
from codemods.vllm import kv_plan_older as _vllm_kv_plan_older
from codemods.vllm import kv_plan_unified as _vllm_kv_plan_unified
from codemods.vllm import startup_memory as _vllm_startup_memory

# --- the seams every build of an engine must cover -----------------------------------------
# One row per (engine, seam); `versions` is where the seam is required (empty: in every
# release, so a release older than every transform fails too). A cell with a
# required seam that no transform covers, or with a seam two transforms cover, is refused by
# check-matrix, transforms and build.

REQUIRED_SEAMS: tuple[RequiredSeam, ...] = (
    RequiredSeam(ANY_ENGINE, "provenance",
                 note="every patched build says which build it is"),
    # vLLM
    RequiredSeam("vllm", "block-pool"),
    RequiredSeam("vllm", "allocate-slots-race"),
    RequiredSeam("vllm", "step-end-release"),
    RequiredSeam("vllm", "shutdown"),
    RequiredSeam("vllm", "kv-budget"),
    RequiredSeam("vllm", "engine-executor", ">=0.25",
                 note="the Ray executor's workers are reached through the executor's own RPC "
                      "(proven on the CPU engine, 0.27 - 0.32, and on a GPU, 0.25); older "
                      "cells refuse the Ray executor at start"),
    RequiredSeam("vllm", "startup-free-memory",
                 note="the GPU worker refuses to start when free memory is below its share"),
    RequiredSeam("vllm", "memory-profile-check",
                 note="the profile run asserts that device free memory did not rise"),
    RequiredSeam("vllm", "startup-window",
                 note="the profile charges every device-wide change of used memory between "
                      "the worker's initial snapshot and the end of its profile to itself, so "
                      "elastic engines on one device take that window in turn"),
    RequiredSeam("vllm", "kv-buffers-v1-runner", "<0.34",
                 note="the V1 GPUModelRunner allocates the KV buffers of every release up to "
                      "0.33; 0.34 removed it (vllm/v1/worker/gpu_model_runner.py): Model "
                      "Runner V2 is vLLM's only GPU runner from then on"),
    RequiredSeam("vllm", "kv-buffers-v2-runner", ">=0.22",
                 note="Model Runner V2 exists from 0.12 but is opt-in "
                      "(VLLM_USE_V2_MODEL_RUNNER=1) until 0.22, which makes it the default "
                      "for allow-listed architectures (Llama included); from 0.29 the shared "
                      "allocate_kv_cache serves both runners (vllm-kv-buffers-shared)"),
    # SGLang
    RequiredSeam("sglang", "token-allocator"),
    RequiredSeam("sglang", "paged-allocator"),
    RequiredSeam("sglang", "mha-pool"),
    RequiredSeam("sglang", "mla-pool",
                 note="MLATokenToKVPool exists in every release from 0.4 (buffers built "
                      "inline in __init__ up to 0.5.5, in _create_buffers from 0.5.6)"),
    RequiredSeam("sglang", "capacity"),
    RequiredSeam("sglang", "prefix-cache-bound"),
    RequiredSeam("sglang", "config-guard"),
    RequiredSeam("sglang", "startup-free-memory",
                 note="free memory before the weights load sets the non-KV slack and is "
                      "compared across TP ranks (the memory-balance check)"),
    RequiredSeam("sglang", "kv-profile-free-memory",
                 note="free memory after the weights load is the KV pools' budget, refused "
                      "when nothing is left"),
    RequiredSeam("sglang", "scheduler-capacity", versions="<0.5.21",
                 note="up to 0.5.20 the scheduler reads the free capacity itself for admission, "
                      "the decode check and eviction; from 0.5.21 it asks the allocator"),
    RequiredSeam("sglang", "swa-allocator", versions=">=0.5.13",
                 note="the hybrid sliding-window allocator (mem_cache/allocator/swa.py) gates "
                      "and allocates over its two elastic sides, so a window model is served "
                      "elastic from 0.5.13 and refused by the configuration guard before"),
    RequiredSeam("sglang", "pure-swa-refused", versions=">=0.5.15",
                 note="the all-window allocator (PureSWATokenToKVPoolAllocator) derives from "
                      "the stock composite, above the elastic one in its module"),
)


# --- the codemods, in application order ------------------------------------------------------

CODEMODS: list[CodemodDeclaration] = [
    CodemodDeclaration(
        id="provenance",
        seam="provenance",
        engine=ANY_ENGINE,
        versions="",
        anchor="file {package}/_kvcached_build.py (new module)",
        targets=("{package}/_kvcached_build.py",),
        expected_hits=1,
        why="A running engine must be able to say which patched build it is (cell, base "
            "artifact and sha256, transforms, patch-set fingerprint).",
        retire_when="Never: vendor-specific; it exists because these wheels are ours.",
        codemod=WriteProvenanceModule,
        writes_build_facts=True,
        forwarded="not-needed",
        last_update="2026-11-30",
    ),
]


# --- SGLang (cells sglang-<major.minor.patch>) ------------------------------------------------
# Elastic allocators and pools are subclasses appended to their defining modules (so every
# module importing the name gets them), rebound only with KVCACHED_ENABLE=1.
#
# The scheduler's memory-leak invariant (invariant_checker.py: available + evictable +
# protected + session_held (+ uncached) == max_total_num_tokens) is kept true by the allocator,
# not by rewriting the checker: the elastic allocators report the LOGICAL free capacity
# (SGLang pages not held, times page_size), which is exactly what the stock free lists report,
# so the checker, the prefill budget and eviction see the numbers they always did. This is
# sound because the pools are sized from the kvcached budget (sglang-kv-budget): every token
# the scheduler admits can be mapped. A limit lowered at run time (kvctl) or a spent budget is
# seen through a second size, what an allocation can take now: from 0.5.21 the scheduler asks
# the allocator for its admission budget, eviction and decode check, and the allocator answers
# with it; up to 0.5.20 the scheduler reads the capacity itself, and sglang-scheduler-capacity
# points exactly those reads at it (the leak check keeps the logical size). The start-up seams
# (sglang-startup-free-memory, sglang-kv-profile-free-memory) count the KV elastic neighbours
# hold while this engine starts as memory they give back: if neighbours are in a burst at the
# same time as this engine, the same out-of-memory path is taken until they shrink.

# From 0.5.9 release_kv_cache (mem_cache/common.py) ends every release and the trees evict by
# EvictParams; 0.5.6 - 0.5.8 return early from it and evict by token count.
_SGLANG_CELLS = ">=0.5.9,<0.5.24"
_SGLANG_MLA_CREATE_BUFFERS = ">=0.5.6,<0.5.24"
# Up to 0.5.5 the MLA pool allocates its latent buffers in __init__ (moved to _create_buffers) and
# each radix tree releases a finished request in its own cache_finished_req (no
# release_kv_cache in mem_cache/common.py).
_SGLANG_INLINE_MLA = ">=0.4.10,<0.5.6"
# 0.5.6 - 0.5.8 still free the request's row in RadixCache.cache_finished_req and evict by token
# count, and return early from release_kv_cache: the tree's own bound serves them.
_SGLANG_TREE_RELEASE = ">=0.4.10,<0.5.9"
# The allocators' API and the configurator's settings: 0.5.10 - 0.5.16 have the free-group
# flag and backup_state / restore_state, and 0.5.16's configurator holds the ServerArgs; from
# 0.5.20 `free_group is None`, free_segment / free_page_ids and get_exec(). 0.5.17 - 0.5.19 mix
# the two: get_exec() and no backup_state from 0.5.17, the paged free_segment and
# _release_page_ids (where every paged free path ends) from 0.5.17, the token allocator's
# deferred frees copied from 0.5.18, `free_group is None` from 0.5.19, free_page_ids only from
# 0.5.20. Both allocators live in mem_cache/allocator.py up to 0.5.12 (a package from 0.5.13),
# and the paged alloc_extend takes the batch's new-page count from 0.5.12.
_SGLANG_NEWER_API = ">=0.5.20,<0.5.24"
_SGLANG_TOKEN_FREE_GROUP_FLAG = ">=0.5.13,<0.5.18"
_SGLANG_TOKEN_FLAG_COPIES = ">=0.5.18,<0.5.19"
_SGLANG_TOKEN_FREE_GROUP_NONE = ">=0.5.19,<0.5.20"
_SGLANG_FREE_GROUP_FLAG = ">=0.5.13,<0.5.17"
_SGLANG_PAGED_RELEASE_PAGE_IDS = ">=0.5.17,<0.5.20"
_SGLANG_ALLOCATOR_MODULE = ">=0.4.10,<0.5.13"
_SGLANG_PAGED_COUNTS_ITS_PAGES = ">=0.5.3,<0.5.12"
_SGLANG_PAGED_ONE_MODULE = ">=0.5.12,<0.5.13"
# Up to 0.5.2 the paged alloc_extend / alloc_decode take the batch's lengths on the device only.
_SGLANG_PAGED_DEVICE_LENGTHS = ">=0.4.10,<0.5.3"
# Who sizes the pools: KVCacheConfigurator (kv_cache_configurator.py) from 0.5.16, the model
# runner's KV mixin (model_runner_kv_cache_mixin.py) before; the capacity, both KV-profile
# reads and the config guard follow it. Up to 0.5.10 the mixin profiles a token count
# (profile_max_num_token), from 0.5.11 a byte budget (_profile_available_bytes). Up to 0.5.6
# ModelRunner itself sizes the pools (model_runner.py); its config guard names the Mamba pools
# that came in 0.5.2 (the runner's mambaish_config) from 0.5.3, sliding-window hybrids alone
# before. The KV mixin of 0.5.7 - 0.5.9 imports no envs (its guard imports it itself); 0.5.6's
# runner calls its sliding-window hybrids is_hybrid_swa.
_SGLANG_CONFIGURATOR = ">=0.5.16,<0.5.24"
_SGLANG_CONFIGURATOR_SERVER_ARGS = ">=0.5.16,<0.5.17"
_SGLANG_MODEL_RUNNER = ">=0.5.10,<0.5.16"
_SGLANG_RUNNER_SIZING = ">=0.4.10,<0.5.7"
# 0.5.2 names its linear-attention (GDN) hybrids with the runner's is_hybrid_gdn (no
# mambaish_config before 0.5.3).
_SGLANG_RUNNER_GUARD = ">=0.5.3,<0.5.6"
# 0.5.6's runner calls them is_hybrid_swa and the custom memory pool setting is envs' string.
_SGLANG_RUNNER_GUARD_SWA = ">=0.5.6,<0.5.7"
_SGLANG_RUNNER_GUARD_GDN = ">=0.5.2,<0.5.3"
_SGLANG_RUNNER_GUARD_BEFORE_MAMBA = ">=0.4.10,<0.5.2"
_SGLANG_RUNNER_PRE_LOAD = ">=0.4.10,<0.5.16"
_SGLANG_MODEL_RUNNER_KV = ">=0.5.11,<0.5.16"
_SGLANG_PROFILE_TOKENS = ">=0.5.7,<0.5.11"
_SGLANG_MIXIN_GUARD_ENVS_LOCAL = ">=0.5.7,<0.5.10"
# K and V of a layer: one fused allocation from 0.5.23, apart before; 0.5.16 - 0.5.22 allocate
# them in _create_buffers_normal, earlier releases inline in _create_buffers (each variant also
# checks the release's source for its layout, codemods/sglang/_kv_layout.py).
_SGLANG_FUSED_KV = ">=0.5.23,<0.5.24"
_SGLANG_SEPARATE_KV = ">=0.5.16,<0.5.23"
_SGLANG_INLINE_KV = ">=0.4.10,<0.5.16"
# The pre-load free-memory read: its own function from 0.5.21, inside bootstrap.py's
# init_torch_distributed from 0.5.16, inside ModelRunner.init_torch_distributed before.
_SGLANG_PRE_LOAD_MEASURE = ">=0.5.21,<0.5.24"
_SGLANG_PRE_LOAD_AT_INIT = ">=0.5.16,<0.5.21"
_SGLANG_DATE = "2026-11-30"
_SGLANG_LAYOUT_DATE = "2026-12-02"
_SGLANG_WINDOW_DATE = "2026-12-02"
_SGLANG_0516_DATE = "2026-12-02"
_SGLANG_0513_DATE = "2026-12-02"
_SGLANG_0510_DATE = "2026-12-02"
_SGLANG_0517_DATE = "2026-12-04"
_SGLANG_055_DATE = "2026-12-02"
_SGLANG_PRESSURE_DATE = "2026-12-06"
_SGLANG_SWA_DATE = "2026-12-06"
_SGLANG_SWA_0517_DATE = "2026-12-07"
# Hybrid sliding-window models are served elastic from 0.5.13 (from 0.5.16 the configurator's
# is_hybrid_swa / mambaish_config, which the guard reads: through get_exec() from 0.5.17, from
# the ServerArgs in 0.5.16). From 0.5.21 the scheduler asks the composite allocator for its
# prefill budget and evictions; 0.5.16 - 0.5.20 read its full and window sizes themselves
# (sglang-scheduler-capacity's side reads).
# Up to 0.5.15 the model runner builds them, with a guard of its own and a composite without
# resize; the all-window allocator exists from 0.5.15. 0.5.12 has the same composite (in
# mem_cache/swa_memory_pool.py) but its CPU engine computes no window model (its torch-native
# attention has no window mask and reads no window slots), so nothing could prove it there.
_SGLANG_SWA = ">=0.5.15,<0.5.24"
_SGLANG_SWA_GET_EXEC = ">=0.5.17,<0.5.24"
_SGLANG_SWA_ASKED = ">=0.5.21,<0.5.24"
_SGLANG_SWA_READ = ">=0.5.16,<0.5.21"
_SGLANG_SWA_MODEL_RUNNER = ">=0.5.13,<0.5.16"
# Where the scheduler reads the allocator's capacity itself (up to 0.5.20):
# codemods/sglang/scheduler_capacity.py names the scopes of each release.
_SGLANG_POLICY = "{package}/srt/managers/schedule_policy.py"
_SGLANG_BATCH = "{package}/srt/managers/schedule_batch.py"
_SGLANG_COMMON = "{package}/srt/mem_cache/common.py"

CODEMODS += [
    CodemodDeclaration(
        id="sglang-token-allocator",
        seam="token-allocator",
        engine="sglang",
        versions=_SGLANG_NEWER_API,
        anchor="sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator",
        targets=("{package}/srt/mem_cache/allocator/token.py",),
        expected_hits=1,
        why="Page-size-1 slots must come from the kvcached ledger so KV pages map on demand "
            "and unmap when empty; rebinding in the defining module reaches the 4 modules "
            "that capture the name (allocator/__init__, swa, kv_cache_configurator, mlx).",
        retire_when="SGLang lets a platform supply the page-size-1 allocator (0.5.23 "
                    "hard-codes TokenToKVPoolAllocator in kv_cache_configurator.py).",
        codemod=ElasticTokenAllocator,
        forwarded="no",
        last_update=_SGLANG_DATE,
    ),
    CodemodDeclaration(
        id="sglang-token-allocator-free-group-flag",
        seam="token-allocator",
        engine="sglang",
        versions=_SGLANG_TOKEN_FREE_GROUP_FLAG,
        anchor="sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator (clear resets "
               "is_not_in_free_group)",
        targets=("{package}/srt/mem_cache/allocator/token.py",),
        expected_hits=1,
        why="The same elastic slots as sglang-token-allocator for 0.5.16's API: a free group "
            "is the is_not_in_free_group flag, free is the only free path and the base class "
            "has backup_state / restore_state, each of which touches the free lists; the "
            "mixin routes all of them through the ledger (a restore gives back what was "
            "allocated since its backup).",
        retire_when="The oldest SGLang cell has free_page_ids and `free_group is None` (0.5.20).",
        codemod=ElasticTokenAllocatorFreeGroupFlag,
        forwarded="no",
        last_update=_SGLANG_0516_DATE,
    ),
    CodemodDeclaration(
        id="sglang-token-allocator-copies-deferred",
        seam="token-allocator",
        engine="sglang",
        versions=_SGLANG_TOKEN_FLAG_COPIES,
        anchor="sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator (clear resets "
               "is_not_in_free_group; free defers self._copy_for_free_group(...))",
        targets=("{package}/srt/mem_cache/allocator/token.py",),
        expected_hits=1,
        why="sglang-token-allocator-free-group-flag where a free inside a group keeps a copy "
            "of its indices (0.5.18 groups the frees of a whole prefill result, and the caller "
            "may reuse the freed row before the group ends): the elastic class copies a "
            "deferred free before the flag mixin defers it, or the ledger would take back "
            "the slots the row holds at the group's end.",
        retire_when="The oldest SGLang cell has `free_group is None` (0.5.19).",
        codemod=ElasticTokenAllocatorFreeGroupFlagCopies,
        forwarded="no",
        last_update=_SGLANG_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-token-allocator-free-group-none",
        seam="token-allocator",
        engine="sglang",
        versions=_SGLANG_TOKEN_FREE_GROUP_NONE,
        anchor="sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator (clear sets "
               "free_group = None; no free_page_ids)",
        targets=("{package}/srt/mem_cache/allocator/token.py",),
        expected_hits=1,
        why="sglang-token-allocator where free_page_ids does not exist yet (0.5.19): the "
            "same free group (`free_group is None`), the same copied deferred frees, the same "
            "mixin.",
        retire_when="The oldest SGLang cell has free_page_ids (0.5.20).",
        codemod=ElasticTokenAllocatorFreeGroupNone,
        forwarded="no",
        last_update=_SGLANG_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-token-allocator-one-module",
        seam="token-allocator",
        engine="sglang",
        versions=_SGLANG_ALLOCATOR_MODULE,
        anchor="sglang.srt.mem_cache.allocator.TokenToKVPoolAllocator (clear resets "
               "is_not_in_free_group)",
        targets=("{package}/srt/mem_cache/allocator.py",),
        expected_hits=1,
        why="sglang-token-allocator-free-group-flag where both allocators live in "
            "mem_cache/allocator.py (a package from 0.5.13): the same API, the same mixin.",
        retire_when="The oldest SGLang cell has the mem_cache/allocator package (0.5.13).",
        codemod=ElasticTokenAllocatorFreeGroupFlag,
        forwarded="no",
        last_update=_SGLANG_0510_DATE,
    ),
    CodemodDeclaration(
        id="sglang-paged-allocator",
        seam="paged-allocator",
        engine="sglang",
        versions=_SGLANG_NEWER_API,
        anchor="sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator",
        targets=("{package}/srt/mem_cache/allocator/paged.py",),
        expected_hits=1,
        why="Paged extend/decode must take their new pages from the kvcached ledger (SGLang's "
            "own location kernels still place the tokens); every free path ends in "
            "_release_page_ids, which returns pages to the ledger.",
        retire_when="An out-of-tree platform allocator (get_paged_allocator_cls) is honoured "
                    "for every construction site and can be shipped as a plugin.",
        codemod=ElasticPagedAllocator,
        forwarded="no",
        last_update=_SGLANG_DATE,
    ),
    CodemodDeclaration(
        id="sglang-paged-allocator-free-group-flag",
        seam="paged-allocator",
        engine="sglang",
        versions=_SGLANG_FREE_GROUP_FLAG,
        anchor="sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator (clear "
               "resets is_not_in_free_group)",
        targets=("{package}/srt/mem_cache/allocator/paged.py",),
        expected_hits=1,
        why="The same elastic pages as sglang-paged-allocator for 0.5.16's API: free stages "
            "freed pages in release_pages (no free_segment, free_page_ids or "
            "_release_page_ids yet), a free group is the is_not_in_free_group flag and the "
            "base class has backup_state / restore_state; the mixin frees whole pages to the "
            "ledger and routes the group and the backup through it.",
        retire_when="The oldest SGLang cell has free_page_ids and `free_group is None` (0.5.20).",
        codemod=ElasticPagedAllocatorFreeGroupFlag,
        forwarded="no",
        last_update=_SGLANG_0516_DATE,
    ),
    CodemodDeclaration(
        id="sglang-paged-allocator-release-page-ids",
        seam="paged-allocator",
        engine="sglang",
        versions=_SGLANG_PAGED_RELEASE_PAGE_IDS,
        anchor="sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator (free, "
               "free_segment and free_group_end end in _release_page_ids; no free_page_ids)",
        targets=("{package}/srt/mem_cache/allocator/paged.py",),
        expected_hits=1,
        why="The same elastic pages as sglang-paged-allocator where free_page_ids does not "
            "exist yet (0.5.17 - 0.5.19): every free path already ends in _release_page_ids, "
            "so the same mixin returns freed pages to the ledger, while free, free_segment "
            "and the group methods stay the release's own (its flag or `free_group is None`, "
            "its copied deferred frees).",
        retire_when="The oldest SGLang cell has free_page_ids (0.5.20).",
        codemod=ElasticPagedAllocatorReleasePageIds,
        forwarded="no",
        last_update=_SGLANG_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-paged-allocator-one-module",
        seam="paged-allocator",
        engine="sglang",
        versions=_SGLANG_PAGED_ONE_MODULE,
        anchor="sglang.srt.mem_cache.allocator.PagedTokenToKVPoolAllocator (clear resets "
               "is_not_in_free_group; alloc_extend takes num_new_pages)",
        targets=("{package}/srt/mem_cache/allocator.py",),
        expected_hits=1,
        why="sglang-paged-allocator-free-group-flag where the paged allocator still lives in "
            "mem_cache/allocator.py (0.5.12: alloc_extend already takes num_new_pages, the "
            "package came in 0.5.13): the same API, the same mixin.",
        retire_when="The oldest SGLang cell has the mem_cache/allocator package (0.5.13).",
        codemod=ElasticPagedAllocatorOneModule,
        forwarded="no",
        last_update=_SGLANG_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-paged-allocator-counts-its-pages",
        seam="paged-allocator",
        engine="sglang",
        versions=_SGLANG_PAGED_COUNTS_ITS_PAGES,
        anchor="sglang.srt.mem_cache.allocator.PagedTokenToKVPoolAllocator (clear resets "
               "is_not_in_free_group; alloc_extend without num_new_pages)",
        targets=("{package}/srt/mem_cache/allocator.py",),
        expected_hits=1,
        why="sglang-paged-allocator-free-group-flag where the paged allocator lives in "
            "mem_cache/allocator.py and its alloc_extend counts the batch's new pages itself "
            "(no num_new_pages parameter before 0.5.12): the mixin stages that many ledger "
            "pages and calls the stock method without the count.",
        retire_when="The oldest SGLang cell's alloc_extend takes num_new_pages (0.5.12).",
        codemod=ElasticPagedAllocatorCountsItsPages,
        forwarded="no",
        last_update=_SGLANG_0510_DATE,
    ),
    CodemodDeclaration(
        id="sglang-paged-allocator-device-lengths",
        seam="paged-allocator",
        engine="sglang",
        versions=_SGLANG_PAGED_DEVICE_LENGTHS,
        anchor="sglang.srt.mem_cache.allocator.PagedTokenToKVPoolAllocator (clear resets "
               "is_not_in_free_group; alloc_extend(prefix_lens, seq_lens, last_loc, "
               "extend_num_tokens))",
        targets=("{package}/srt/mem_cache/allocator.py",),
        expected_hits=1,
        why="sglang-paged-allocator-counts-its-pages where extend and decode get the batch's "
            "lengths on the device only (their kernels count the new pages, before 0.5.3): "
            "the mixin counts them from the same tensors to stage that many ledger pages, "
            "then calls the stock method with its own arguments.",
        retire_when="The oldest SGLang cell passes the CPU lengths to alloc_extend (0.5.3).",
        codemod=ElasticPagedAllocatorDeviceLengths,
        forwarded="no",
        last_update=_SGLANG_055_DATE,
    ),
    CodemodDeclaration(
        id="sglang-mha-pool",
        seam="mha-pool",
        engine="sglang",
        versions=_SGLANG_FUSED_KV,
        anchor="sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal "
               "(K and V fused)",
        targets=("{package}/srt/mem_cache/memory_pool.py",),
        expected_hits=1,
        why="The fused per-layer (2, rows, H, D) K/V buffers of 0.5.23 must be views of "
            "VMM-backed tensors (same shapes and strides, data pointers fixed for the pool's "
            "life); quantized, HND and post-capture layouts are refused.",
        retire_when="SGLang's kv_vmm_backing can unmap by allocator page, or "
                    "get_kv_pool_cls('mha') covers every MHA construction site.",
        codemod=ElasticMHAPool,
        forwarded="no",
        last_update=_SGLANG_LAYOUT_DATE,
    ),
    CodemodDeclaration(
        id="sglang-mha-pool-separate-kv",
        seam="mha-pool",
        engine="sglang",
        versions=_SGLANG_SEPARATE_KV,
        anchor="sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal "
               "(K and V allocated apart)",
        targets=("{package}/srt/mem_cache/memory_pool.py",),
        expected_hits=1,
        why="Up to 0.5.22 the pool allocates each layer's K and V buffers apart, (rows, H, D) "
            "each; they must be views of VMM-backed tensors with those shapes and strides, "
            "each a tensor of its own as in the release, data pointers fixed for the pool's "
            "life; quantized, HND and post-capture layouts are refused.",
        retire_when="The oldest SGLang cell fuses K and V (0.5.23 or later).",
        codemod=ElasticMHASeparateKVPool,
        forwarded="no",
        last_update=_SGLANG_LAYOUT_DATE,
    ),
    CodemodDeclaration(
        id="sglang-mha-pool-inline-buffers",
        seam="mha-pool",
        engine="sglang",
        versions=_SGLANG_INLINE_KV,
        anchor="sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers (K and V "
               "allocated apart, inline; no _create_buffers_normal)",
        targets=("{package}/srt/mem_cache/memory_pool.py",),
        expected_hits=1,
        why="Up to 0.5.15 _create_buffers allocates each layer's K and V, (rows, H, D) each, "
            "and derives the pointer and stride tables SGLang's copy kernels read; the "
            "buffers must be views of VMM-backed tensors with those shapes and strides and "
            "the tables must describe them; the AITER vectorized layout is refused.",
        retire_when="The oldest SGLang cell has _create_buffers_normal (0.5.16).",
        codemod=ElasticMHAInlineBuffersPool,
        forwarded="no",
        last_update=_SGLANG_0513_DATE,
    ),
    CodemodDeclaration(
        id="sglang-mla-pool",
        seam="mla-pool",
        engine="sglang",
        versions=_SGLANG_MLA_CREATE_BUFFERS,
        anchor="sglang.srt.mem_cache.memory_pool.MLATokenToKVPool._create_buffers",
        targets=("{package}/srt/mem_cache/memory_pool.py",),
        expected_hits=1,
        why="MLA latent buffers (rows, 1, kv_lora_rank + rope) must be views of VMM-backed "
            "tensors like the MHA ones.",
        retire_when="get_kv_pool_cls('mla') is honoured and can be shipped as a plugin.",
        codemod=ElasticMLAPool,
        forwarded="no",
        last_update=_SGLANG_DATE,
    ),
    CodemodDeclaration(
        id="sglang-mla-pool-inline",
        seam="mla-pool",
        engine="sglang",
        versions=_SGLANG_INLINE_MLA,
        anchor="sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.__init__ (its one "
               "memory_saver_adapter.region statement assigns self.kv_buffer; no "
               "_create_buffers)",
        targets=("{package}/srt/mem_cache/memory_pool.py",),
        expected_hits=1,
        why="Up to 0.5.5 the MLA pool allocates its latent buffers inside __init__; moved into "
            "_create_buffers as 0.5.6 has it, they are views of VMM-backed tensors like the "
            "later releases' (the same mixin), and the pointer table __init__ builds next "
            "describes them.",
        retire_when="The oldest SGLang cell has MLATokenToKVPool._create_buffers (0.5.6).",
        codemod=ElasticInlineMLAPool,
        forwarded="not-needed",
        last_update="2026-12-07",
    ),
    CodemodDeclaration(
        id="sglang-kv-budget",
        seam="capacity",
        engine="sglang",
        versions=_SGLANG_CONFIGURATOR,
        anchor="sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
               "._profile_available_bytes (each return)",
        targets=("{package}/srt/mem_cache/kv_cache_configurator.py",),
        expected_hits=1,
        why="Pool capacity must come from the kvcached budget (KVCACHED_PHYSICAL_LIMIT), so "
            "the logical capacity the allocator reports can always be backed.",
        retire_when="SGLang accepts a KV byte budget from a platform hook.",
        codemod=KVBudgetCapacity,
        forwarded="no",
        last_update=_SGLANG_DATE,
    ),
    CodemodDeclaration(
        id="sglang-kv-budget-model-runner",
        seam="capacity",
        engine="sglang",
        versions=_SGLANG_MODEL_RUNNER_KV,
        anchor="sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
               "._profile_available_bytes (each return)",
        targets=("{package}/srt/model_executor/model_runner_kv_cache_mixin.py",),
        expected_hits=1,
        why="The same budget as sglang-kv-budget where the model runner's KV mixin profiles "
            "it (before 0.5.16's KVCacheConfigurator).",
        retire_when="The oldest SGLang cell has KVCacheConfigurator (0.5.16).",
        codemod=KVBudgetCapacityModelRunner,
        forwarded="no",
        last_update=_SGLANG_0513_DATE,
    ),
    CodemodDeclaration(
        id="sglang-kv-budget-tokens",
        seam="capacity",
        engine="sglang",
        versions=_SGLANG_PROFILE_TOKENS,
        anchor="sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
               ".profile_max_num_token (return <bytes> // cell_size)",
        targets=("{package}/srt/model_executor/model_runner_kv_cache_mixin.py",),
        expected_hits=1,
        why="The same budget as sglang-kv-budget where the model runner profiles a token "
            "count: the bytes it divides by the per-token cell size go through the budget.",
        retire_when="The oldest SGLang cell profiles a byte budget (0.5.11).",
        codemod=KVBudgetCapacityTokens,
        forwarded="no",
        last_update=_SGLANG_0510_DATE,
    ),
    CodemodDeclaration(
        id="sglang-kv-budget-runner",
        seam="capacity",
        engine="sglang",
        versions=_SGLANG_RUNNER_SIZING,
        anchor="sglang.srt.model_executor.model_runner.ModelRunner.profile_max_num_token "
               "(<bytes> // cell_size)",
        targets=("{package}/srt/model_executor/model_runner.py",),
        expected_hits=1,
        why="The same budget as sglang-kv-budget where ModelRunner profiles the token count "
            "itself (before 0.5.7's KV mixin).",
        retire_when="The oldest SGLang cell has ModelRunnerKVCacheMixin (0.5.7).",
        codemod=KVBudgetCapacityRunner,
        forwarded="no",
        last_update=_SGLANG_055_DATE,
    ),
    # Start-up free-memory figures: next to elastic neighbours whose memory moves while this
    # engine starts (adapter: integration/sglang/startup.py, elastic_free_memory_gb).
    CodemodDeclaration(
        id="sglang-startup-free-memory",
        seam="startup-free-memory",
        engine="sglang",
        versions=_SGLANG_PRE_LOAD_MEASURE,
        anchor="sglang.srt.distributed.bootstrap.measure_pre_model_load_memory: "
               "get_available_gpu_memory(..., distributed=..., cpu_group=...)",
        targets=("{package}/srt/distributed/bootstrap.py",),
        expected_hits=1,
        why="The pre-load figure sets the slack subtracted from the KV budget and is compared "
            "with this rank's free memory by the TP memory-balance check (an error by "
            "default); KV that elastic neighbours hold while this engine starts must count as "
            "memory they give back, or a burst next door refuses or shrinks the engine. The read "
            "opens the device's start-up window (startup_window=\"begin\", none for a draft "
            "worker, whose pools reuse the target's sizing), so that no elastic neighbour's "
            "weight load is charged to this engine.",
        retire_when="SGLang lets a KV-cache allocator report the memory it needs at start, or "
                    "measures start-up memory per process instead of device-wide.",
        codemod=ElasticPreModelLoadMemory,
        forwarded="no",
        last_update=_SGLANG_WINDOW_DATE,
    ),
    CodemodDeclaration(
        id="sglang-startup-free-memory-at-init",
        seam="startup-free-memory",
        engine="sglang",
        versions=_SGLANG_PRE_LOAD_AT_INIT,
        anchor="sglang.srt.distributed.bootstrap.init_torch_distributed: "
               "get_available_gpu_memory(..., distributed=..., cpu_group=...)",
        targets=("{package}/srt/distributed/bootstrap.py",),
        expected_hits=1,
        why="The same pre-load figure as sglang-startup-free-memory, read where 0.5.16 - "
            "0.5.20 read it (0.5.21 moved it to measure_pre_model_load_memory); it opens the "
            "device's start-up window the same way.",
        retire_when="The oldest SGLang cell reads it in measure_pre_model_load_memory.",
        codemod=ElasticPreModelLoadMemoryAtInit,
        forwarded="no",
        last_update=_SGLANG_WINDOW_DATE,
    ),
    CodemodDeclaration(
        id="sglang-startup-free-memory-model-runner",
        seam="startup-free-memory",
        engine="sglang",
        versions=_SGLANG_RUNNER_PRE_LOAD,
        anchor="sglang.srt.model_executor.model_runner.ModelRunner.init_torch_distributed: "
               "get_available_gpu_memory(..., distributed=..., cpu_group=...)",
        targets=("{package}/srt/model_executor/model_runner.py",),
        expected_hits=1,
        why="The same pre-load figure as sglang-startup-free-memory, read where 0.5.13 - "
            "0.5.15 read it (the model runner's own init_torch_distributed; a draft worker is "
            "self.is_draft_worker there); it opens the device's start-up window the same way.",
        retire_when="The oldest SGLang cell reads it in srt/distributed/bootstrap.py (0.5.16).",
        codemod=ElasticPreModelLoadMemoryModelRunner,
        forwarded="no",
        last_update=_SGLANG_0513_DATE,
    ),
    CodemodDeclaration(
        id="sglang-kv-profile-free-memory",
        seam="kv-profile-free-memory",
        engine="sglang",
        versions=_SGLANG_CONFIGURATOR,
        anchor="sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
               "._profile_available_bytes: get_available_gpu_memory(..., distributed=...)",
        targets=("{package}/srt/mem_cache/kv_cache_configurator.py",),
        expected_hits=1,
        why="The KV pools are sized once, from free memory after the weights load, and start-up "
            "is refused when none is left ('Loaded weights leave no GPU memory', 'Not enough "
            "memory'); an elastic neighbour's burst at that moment must neither refuse the "
            "engine nor fix its capacity for life to what the neighbour left free. The read "
            "closes the start-up window the pre-load read opened (startup_window=\"end\"), "
            "also when it raises, so the next elastic engine on the device may measure.",
        retire_when="SGLang accepts a KV byte budget from a platform hook (then the capacity "
                    "seam supplies the whole budget).",
        codemod=ElasticKVProfileMemory,
        forwarded="no",
        last_update=_SGLANG_WINDOW_DATE,
    ),
    CodemodDeclaration(
        id="sglang-kv-profile-free-memory-model-runner",
        seam="kv-profile-free-memory",
        engine="sglang",
        versions=_SGLANG_MODEL_RUNNER_KV,
        anchor="sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
               "._profile_available_bytes: get_available_gpu_memory(..., distributed=...)",
        targets=("{package}/srt/model_executor/model_runner_kv_cache_mixin.py",),
        expected_hits=1,
        why="The same KV-profile figure as sglang-kv-profile-free-memory where the model "
            "runner's KV mixin reads it (before 0.5.16); it closes the start-up window the "
            "same way.",
        retire_when="The oldest SGLang cell has KVCacheConfigurator (0.5.16).",
        codemod=ElasticKVProfileMemoryModelRunner,
        forwarded="no",
        last_update=_SGLANG_0513_DATE,
    ),
    CodemodDeclaration(
        id="sglang-kv-profile-free-memory-tokens",
        seam="kv-profile-free-memory",
        engine="sglang",
        versions=_SGLANG_PROFILE_TOKENS,
        anchor="sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
               ".profile_max_num_token: get_available_gpu_memory(..., distributed=...)",
        targets=("{package}/srt/model_executor/model_runner_kv_cache_mixin.py",),
        expected_hits=1,
        why="The same KV-profile figure as sglang-kv-profile-free-memory where the model "
            "runner profiles a token count (before 0.5.11); it closes the start-up window the "
            "same way.",
        retire_when="The oldest SGLang cell profiles a byte budget (0.5.11).",
        codemod=ElasticKVProfileMemoryTokens,
        forwarded="no",
        last_update=_SGLANG_0510_DATE,
    ),
    CodemodDeclaration(
        id="sglang-kv-profile-free-memory-runner",
        seam="kv-profile-free-memory",
        engine="sglang",
        versions=_SGLANG_RUNNER_SIZING,
        anchor="sglang.srt.model_executor.model_runner.ModelRunner.profile_max_num_token: "
               "get_available_gpu_memory(..., distributed=...)",
        targets=("{package}/srt/model_executor/model_runner.py",),
        expected_hits=1,
        why="The same KV-profile figure as sglang-kv-profile-free-memory where ModelRunner "
            "profiles it itself (before 0.5.7); it closes the start-up window the same way.",
        retire_when="The oldest SGLang cell has ModelRunnerKVCacheMixin (0.5.7).",
        codemod=ElasticKVProfileMemoryRunner,
        forwarded="no",
        last_update=_SGLANG_055_DATE,
    ),
    CodemodDeclaration(
        id="sglang-refuse-unsupported-swa",
        seam="config-guard",
        engine="sglang",
        versions=_SGLANG_SWA_GET_EXEC,
        anchor="sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure "
               "(hybrid sliding-window models served)",
        targets=("{package}/srt/mem_cache/kv_cache_configurator.py",),
        expected_hits=1,
        why="The guard of sglang-refuse-unsupported where the sliding-window allocator is "
            "elastic (sglang-swa-allocator): a hybrid window model starts, a Mamba model and "
            "a window model with unified memory, the hierarchical cache, an MLA backend or a "
            "speculative draft (other pools or allocators around the window layers) stop "
            "start-up.",
        retire_when="Mamba and those window shapes are made elastic.",
        codemod=RefuseUnsupportedAtConfigureSwa,
        forwarded="not-needed",
        last_update=_SGLANG_SWA_DATE,
    ),
    CodemodDeclaration(
        id="sglang-swa-allocator",
        seam="swa-allocator",
        engine="sglang",
        versions=_SGLANG_SWA_ASKED,
        anchor="sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator",
        targets=("{package}/srt/mem_cache/allocator/swa.py",),
        expected_hits=1,
        why="The composite over the two elastic sides answers SGLang's admission, eviction and "
            "decode checks from logical sizes and asserts that its second allocation "
            "succeeded: under a limit on either side it would admit what it cannot allocate "
            "and stop the engine. The mixin gates on what each side can allocate and takes "
            "both sides' pages before either allocation.",
        retire_when="SGLang's composite asks its sub-allocators for their allocatable size.",
        codemod=ElasticSWAAllocator,
        forwarded="no",
        last_update=_SGLANG_SWA_DATE,
    ),
    CodemodDeclaration(
        id="sglang-swa-allocator-before-budget",
        seam="swa-allocator",
        engine="sglang",
        versions=_SGLANG_SWA_READ,
        anchor="sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator (no "
               "create_prefill_budget / evict_to_free_tokens yet)",
        targets=("{package}/srt/mem_cache/allocator/swa.py",),
        expected_hits=1,
        why="sglang-swa-allocator where the composite has no prefill budget or eviction of its "
            "own: its scheduler reads the full and window sizes itself, pointed at each side's "
            "limit by sglang-scheduler-capacity; allocations take both sides' pages or neither.",
        retire_when="The oldest SGLang cell asks the composite for its prefill budget (0.5.21).",
        codemod=ElasticSWAAllocatorBeforeBudget,
        forwarded="no",
        last_update=_SGLANG_SWA_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-pure-swa-refused",
        seam="pure-swa-refused",
        engine="sglang",
        versions=_SGLANG_SWA,
        anchor="sglang.srt.mem_cache.allocator.swa.PureSWATokenToKVPoolAllocator",
        targets=("{package}/srt/mem_cache/allocator/swa.py",),
        expected_hits=1,
        why="A model whose every layer has a window gets the stock composite's subclass, "
            "defined above the elastic one: with elastic sides but stock gates it would run "
            "half elastic, so it is refused when built.",
        retire_when="The all-window allocator is made elastic.",
        codemod=RefusePureSWAAllocator,
        forwarded="not-needed",
        last_update=_SGLANG_SWA_DATE,
    ),
    CodemodDeclaration(
        id="sglang-refuse-unsupported-server-args",
        seam="config-guard",
        engine="sglang",
        versions=_SGLANG_CONFIGURATOR_SERVER_ARGS,
        anchor="sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure "
               "(server_args field, no get_exec)",
        targets=("{package}/srt/mem_cache/kv_cache_configurator.py",),
        expected_hits=1,
        why="The guard of sglang-refuse-unsupported-swa (hybrid sliding-window models pass) "
            "where the configurator still holds the ServerArgs: 0.5.16 has no get_exec() or "
            "get_memory(), so the memory saver, unified memory and the hierarchical cache are "
            "read from self.server_args.",
        retire_when="The oldest SGLang cell reads its settings through get_exec() (0.5.17).",
        codemod=RefuseUnsupportedAtConfigureServerArgs,
        forwarded="not-needed",
        last_update=_SGLANG_SWA_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-refuse-unsupported-model-runner",
        seam="config-guard",
        engine="sglang",
        versions=">=0.5.10,<0.5.13",
        anchor="sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
               ".init_memory_pool (envs imported, no get_exec)",
        targets=("{package}/srt/model_executor/model_runner_kv_cache_mixin.py",),
        expected_hits=1,
        why="The guard of sglang-refuse-unsupported where the model runner builds the pools "
            "(before 0.5.16's KVCacheConfigurator): the memory saver, custom memory pools "
            "and hybrid pools stop start-up with one message (post-capture KV sizing does "
            "not exist yet).",
        retire_when="The oldest SGLang cell has KVCacheConfigurator (0.5.16).",
        codemod=RefuseUnsupportedAtInitMemoryPool,
        forwarded="not-needed",
        last_update=_SGLANG_0513_DATE,
    ),
    CodemodDeclaration(
        id="sglang-refuse-unsupported-model-runner-swa",
        seam="config-guard",
        engine="sglang",
        versions=_SGLANG_SWA_MODEL_RUNNER,
        anchor="sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
               ".init_memory_pool (hybrid sliding-window models served)",
        targets=("{package}/srt/model_executor/model_runner_kv_cache_mixin.py",),
        expected_hits=1,
        why="The guard of sglang-refuse-unsupported-swa where the model runner builds the pools "
            "(before 0.5.16) and the sliding-window allocator is elastic "
            "(sglang-swa-allocator-model-runner): a hybrid window model starts, a Mamba model "
            "and a window model with the features that build other pools around its window "
            "layers stop start-up.",
        retire_when="The oldest SGLang cell has KVCacheConfigurator (0.5.16).",
        codemod=RefuseUnsupportedAtInitMemoryPoolSwa,
        forwarded="not-needed",
        last_update=_SGLANG_SWA_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-swa-allocator-model-runner",
        seam="swa-allocator",
        engine="sglang",
        versions=_SGLANG_SWA_MODEL_RUNNER,
        anchor="sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator (no resize yet)",
        targets=("{package}/srt/mem_cache/allocator/swa.py",),
        expected_hits=1,
        why="sglang-swa-allocator-before-budget where the composite has no resize (no "
            "post-capture KV sizing before 0.5.16) and, up to 0.5.14, checks both sides inline "
            "in its extend.",
        retire_when="The oldest SGLang cell has KVCacheConfigurator (0.5.16).",
        codemod=ElasticSWAAllocatorModelRunner,
        forwarded="no",
        last_update=_SGLANG_SWA_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-refuse-unsupported-mixin-envs-local",
        seam="config-guard",
        engine="sglang",
        versions=_SGLANG_MIXIN_GUARD_ENVS_LOCAL,
        anchor="sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
               ".init_memory_pool (no envs, get_exec or get_bool_env_var imported)",
        targets=("{package}/srt/model_executor/model_runner_kv_cache_mixin.py",),
        expected_hits=1,
        why="The guard of sglang-refuse-unsupported-model-runner where the KV mixin's module "
            "does not import envs (0.5.7 - 0.5.9): the guard imports it itself to read the "
            "custom memory pool setting.",
        retire_when="The oldest SGLang cell's KV mixin imports envs (0.5.10).",
        codemod=RefuseUnsupportedAtInitMemoryPoolEnvsLocal,
        forwarded="not-needed",
        last_update=_SGLANG_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-refuse-unsupported-runner",
        seam="config-guard",
        engine="sglang",
        versions=_SGLANG_RUNNER_GUARD,
        anchor="sglang.srt.model_executor.model_runner.ModelRunner.init_memory_pool "
               "(get_bool_env_var imported, no envs)",
        targets=("{package}/srt/model_executor/model_runner.py",),
        expected_hits=1,
        why="The guard of sglang-refuse-unsupported where ModelRunner builds the pools itself "
            "(before 0.5.7): the custom memory pool is a boolean environment variable there "
            "and hybrid layers are `is_hybrid`.",
        retire_when="The oldest SGLang cell has ModelRunnerKVCacheMixin (0.5.7).",
        codemod=RefuseUnsupportedAtRunnerInitMemoryPool,
        forwarded="not-needed",
        last_update=_SGLANG_055_DATE,
    ),
    CodemodDeclaration(
        id="sglang-refuse-unsupported-runner-swa",
        seam="config-guard",
        engine="sglang",
        versions=_SGLANG_RUNNER_GUARD_SWA,
        anchor="sglang.srt.model_executor.model_runner.ModelRunner.init_memory_pool "
               "(get_bool_env_var imported, no envs; self.is_hybrid_swa and "
               "self.mambaish_config)",
        targets=("{package}/srt/model_executor/model_runner.py",),
        expected_hits=1,
        why="The guard of sglang-refuse-unsupported-runner where the runner names its "
            "sliding-window hybrids is_hybrid_swa and the custom memory pool setting is the "
            "pool type in envs (0.5.6): the 0.5.5 guard would fail on self.is_hybrid and "
            "read the setting as a boolean.",
        retire_when="The oldest SGLang cell has ModelRunnerKVCacheMixin (0.5.7).",
        codemod=RefuseUnsupportedAtRunnerInitMemoryPoolSwa,
        forwarded="not-needed",
        last_update=_SGLANG_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-refuse-unsupported-runner-gdn",
        seam="config-guard",
        engine="sglang",
        versions=_SGLANG_RUNNER_GUARD_GDN,
        anchor="sglang.srt.model_executor.model_runner.ModelRunner.init_memory_pool "
               "(get_bool_env_var imported, no envs; self.is_hybrid_gdn, no "
               "self.mambaish_config)",
        targets=("{package}/srt/model_executor/model_runner.py",),
        expected_hits=1,
        why="The guard of sglang-refuse-unsupported-runner where the runner names its "
            "linear-attention (GDN, Qwen3-Next) hybrids with is_hybrid_gdn and has no "
            "mambaish_config yet (0.5.2): both hybrids own their pools and are refused when "
            "elastic.",
        retire_when="The oldest SGLang cell has the runner's mambaish_config (0.5.3).",
        codemod=RefuseUnsupportedAtRunnerInitMemoryPoolGdn,
        forwarded="not-needed",
        last_update=_SGLANG_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-refuse-unsupported-runner-before-mamba",
        seam="config-guard",
        engine="sglang",
        versions=_SGLANG_RUNNER_GUARD_BEFORE_MAMBA,
        anchor="sglang.srt.model_executor.model_runner.ModelRunner.init_memory_pool "
               "(get_bool_env_var imported, no envs, no self.mambaish_config)",
        targets=("{package}/srt/model_executor/model_runner.py",),
        expected_hits=1,
        why="sglang-refuse-unsupported-runner for releases before the Mamba pools (0.5.2): "
            "their runner has no mambaish_config, so the guard names the sliding-window "
            "hybrids (is_hybrid) alone.",
        retire_when="The oldest SGLang cell has the runner's mambaish_config.",
        codemod=RefuseUnsupportedAtRunnerInitMemoryPoolBeforeMamba,
        forwarded="not-needed",
        last_update=_SGLANG_055_DATE,
    ),
    CodemodDeclaration(
        id="sglang-prefix-cache-bound",
        seam="prefix-cache-bound",
        engine="sglang",
        versions=_SGLANG_CELLS,
        anchor="sglang.srt.mem_cache.common.release_kv_cache",
        targets=("{package}/srt/mem_cache/common.py",),
        expected_hits=1,
        why="A finished request's KV stays in the prefix cache (UnifiedRadixCache or "
            "RadixCache) and pins its pages; bounding the evictable part after every release "
            "lets idle memory return to the pool.",
        retire_when="SGLang offers a prefix-cache size cap.",
        codemod=BoundPrefixCacheOnRelease,
        forwarded="no",
        last_update=_SGLANG_DATE,
    ),
    CodemodDeclaration(
        id="sglang-prefix-cache-bound-radix-tree",
        seam="prefix-cache-bound",
        engine="sglang",
        versions=_SGLANG_TREE_RELEASE,
        anchor="sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req (end)",
        targets=("{package}/srt/mem_cache/radix_cache.py",),
        expected_hits=1,
        why="The bound of sglang-prefix-cache-bound where the radix tree releases a finished "
            "request in its own cache_finished_req (no release_kv_cache yet) and evicts by "
            "token count.",
        retire_when="The oldest SGLang cell has mem_cache/common.py::release_kv_cache.",
        codemod=BoundRadixTreeOnFinishedRequest,
        forwarded="no",
        last_update=_SGLANG_055_DATE,
    ),
    CodemodDeclaration(
        id="sglang-scheduler-capacity",
        seam="scheduler-capacity",
        engine="sglang",
        versions=">=0.5.19,<0.5.21",
        anchor="sglang.srt.managers.schedule_policy.PrefillAdder.rem_total_tokens / "
               "cur_rem_tokens / rem_swa_tokens; sglang.srt.mem_cache.common."
               "evict_from_tree_cache (start)",
        targets=(_SGLANG_POLICY, _SGLANG_COMMON),
        expected_hits="10..11",
        why=("SGLang up to 0.5.20 admits requests and evicts before an allocation by reading the "
            "logical free capacity (a sliding-window model's full and window sides apart); "
            "under a lowered limit or a spent budget the refused allocation stops the engine. "
            "The reads see what the pool, or each side, can allocate now and the eviction "
            "frees what the limit withholds, so requests wait instead."),
        retire_when="The oldest SGLang cell asks the allocator for its capacity (0.5.21).",
        codemod=SchedulerCapacitySidesAllocatorDecodeCheck,
        forwarded="no",
        last_update=_SGLANG_SWA_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-scheduler-capacity-check-decode-mem",
        seam="scheduler-capacity",
        engine="sglang",
        versions=">=0.5.9,<0.5.13",
        anchor="sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem, and "
               "sglang-scheduler-capacity's places",
        targets=(_SGLANG_POLICY, _SGLANG_BATCH, _SGLANG_COMMON),
        expected_hits=6,
        why=("sglang-scheduler-capacity where the decode check reads the capacity itself "
            "(ScheduleBatch.check_decode_mem), so decode retracts under the limit."),
        retire_when="The oldest SGLang cell asks the allocator for its capacity (0.5.21).",
        codemod=SchedulerCapacityCheckDecodeMem,
        forwarded="no",
        last_update=_SGLANG_PRESSURE_DATE,
    ),
    CodemodDeclaration(
        id="sglang-scheduler-capacity-sides-check-decode-mem",
        seam="scheduler-capacity",
        engine="sglang",
        versions=">=0.5.13,<0.5.19",
        anchor="sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem, and "
               "sglang-scheduler-capacity's places",
        targets=(_SGLANG_POLICY, _SGLANG_BATCH, _SGLANG_COMMON),
        expected_hits="7..11",
        why=("sglang-scheduler-capacity (with a sliding-window model's side reads, served from "
            "0.5.13) where the decode check reads the capacity itself "
            "(ScheduleBatch.check_decode_mem)."),
        retire_when="The oldest SGLang cell asks the allocator for its capacity (0.5.21).",
        codemod=SchedulerCapacitySidesCheckDecodeMem,
        forwarded="no",
        last_update=_SGLANG_SWA_0517_DATE,
    ),
    CodemodDeclaration(
        id="sglang-scheduler-capacity-available-size-sufficient",
        seam="scheduler-capacity",
        engine="sglang",
        versions=">=0.5.7,<0.5.9",
        anchor="sglang.srt.managers.schedule_batch.ScheduleBatch."
               "_is_available_size_sufficient, and sglang-scheduler-capacity's places",
        targets=(_SGLANG_POLICY, _SGLANG_BATCH, _SGLANG_COMMON),
        expected_hits=6,
        why=("sglang-scheduler-capacity where the decode check's read is "
            "ScheduleBatch._is_available_size_sufficient."),
        retire_when="The oldest SGLang cell asks the allocator for its capacity (0.5.21).",
        codemod=SchedulerCapacityAvailableSizeSufficient,
        forwarded="no",
        last_update=_SGLANG_PRESSURE_DATE,
    ),
    CodemodDeclaration(
        id="sglang-scheduler-capacity-retract-reads",
        seam="scheduler-capacity",
        engine="sglang",
        versions=">=0.5.3,<0.5.7",
        anchor="sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode, "
               "ScheduleBatch._is_available_size_sufficient, and sglang-scheduler-capacity's "
               "places",
        targets=(_SGLANG_POLICY, _SGLANG_BATCH, _SGLANG_COMMON),
        expected_hits=8,
        why=("sglang-scheduler-capacity-available-size-sufficient where retract_decode also "
            "reads the capacity itself (its one-request floor)."),
        retire_when="The oldest SGLang cell asks the allocator for its capacity (0.5.21).",
        codemod=SchedulerCapacityRetractReads,
        forwarded="no",
        last_update=_SGLANG_PRESSURE_DATE,
    ),
    CodemodDeclaration(
        id="sglang-scheduler-capacity-batch-eviction",
        seam="scheduler-capacity",
        engine="sglang",
        versions=">=0.4.10,<0.5.3",
        anchor="sglang.srt.managers.schedule_policy.PrefillAdder.rem_total_tokens / "
               "cur_rem_tokens; ScheduleBatch._is_available_size_sufficient, retract_decode, "
               "_evict_tree_cache_if_needed (start)",
        targets=(_SGLANG_POLICY, _SGLANG_BATCH),
        expected_hits="6..7",
        why=("sglang-scheduler-capacity-retract-reads where ScheduleBatch evicts before an "
            "allocation in its own _evict_tree_cache_if_needed (no "
            "mem_cache/common.py::evict_from_tree_cache yet); retract_decode reads through "
            "a nested _get_available_size up to 0.5.1."),
        retire_when="The oldest SGLang cell asks the allocator for its capacity (0.5.21).",
        codemod=SchedulerCapacityBatchEviction,
        forwarded="no",
        last_update=_SGLANG_PRESSURE_DATE,
    ),
]
# --- end of SGLang ----------------------------------------------------------------------------


# --- vLLM: elastic block pool and KV buffers (cells vllm-0.9 ... vllm-0.33) --------------------
# One transform set; where vLLM versions differ, the registry selects the codemod by version
# range and the rewritten call site passes what differs. The adapter they call is
# kvcached_core/integration/vllm.

_VLLM_REVIEWED = "2026-12-01"

CODEMODS += [
    CodemodDeclaration(
        id="vllm-block-pool",
        seam="block-pool",
        engine="vllm",
        versions=">=0.9.2,<0.35",
        anchor="vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.__init__: BlockPool(...)",
        targets=("{package}/v1/core/kv_cache_coordinator.py",),
        expected_hits=1,
        why="The scheduler's blocks must be physically backed page by page by kvcached_core: "
            "the coordinator builds the adapter's elastic subclass of the BlockPool class it "
            "passes in (prefix caching, eviction order and KV events stay vLLM's own).",
        retire_when="vLLM lets a plugin choose the BlockPool class (a block-pool factory or "
                    "registry in KVCacheCoordinator), so the class can be configured instead.",
        codemod=_vllm_block_pool.ElasticBlockPoolConstruction,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-allocate-slots-race",
        seam="allocate-slots-race",
        engine="vllm",
        versions=">=0.9.2,<0.35",
        anchor="vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots (decorator)",
        targets=("{package}/v1/core/kv_cache_manager.py",),
        expected_hits=1,
        why="Another engine may take the last physical page between the capacity check and the "
            "allocation; PoolExhausted must end as a rolled-back None (preempt or wait), while "
            "every other error stays fatal.",
        retire_when="vLLM's allocate_slots treats an allocation failure of the block pool as "
                    "'no free blocks' and rolls back partial group allocations itself.",
        codemod=_vllm_allocate_slots.NoneOnPoolExhausted,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-engine-step-release",
        seam="step-end-release",
        engine="vllm",
        versions=">=0.9.2,<0.35",
        anchor="vllm.v1.engine.core.EngineCore.step, EngineCore.step_with_batch_queue "
               "(decorators)",
        targets=("{package}/v1/engine/core.py",),
        expected_hits=2,
        why="Pages may be unmapped only after every queued batch that may read them finished: "
            "idle pages are retired and released by epoch at the end of each engine step, and "
            "the prefix cache is trimmed page-aware so idle memory returns.",
        retire_when="vLLM offers a post-step hook for the scheduler/block pool (or releases "
                    "blocks through a completion fence itself).",
        codemod=_vllm_engine_core.ReleasePagesAfterStep,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-engine-shutdown",
        seam="shutdown",
        engine="vllm",
        versions=">=0.9.2,<0.35",
        anchor="vllm.v1.engine.core.EngineCore.shutdown (decorator)",
        targets=("{package}/v1/engine/core.py",),
        expected_hits=1,
        why="Shutdown must release every page and remove the pool's shared-memory limit record.",
        retire_when="vLLM calls a KV-cache allocator's close hook on shutdown.",
        codemod=_vllm_engine_core.ClosePoolOnShutdown,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-engine-executor",
        seam="engine-executor",
        engine="vllm",
        versions=">=0.25,<0.35",
        anchor="vllm.v1.engine.core.EngineCore._initialize_kv_caches (decorator)",
        targets=("{package}/v1/engine/core.py",),
        expected_hits=1,
        why="The Ray executor's workers may run on other nodes, out of reach of the sockets "
            "the mp executor's workers are served on: while the KV caches are sized, kvcached "
            "is handed the engine's executor, whose own collective_rpc then tells each worker "
            "its job and carries every page map and unmap. Cells without this seam refuse the "
            "Ray executor at start.",
        retire_when="vLLM lets a KV-cache allocator reach the workers through the executor "
                    "(a worker-side allocator hook or an RPC handle on the scheduler).",
        codemod=_vllm_engine_executor.KVSizedWithExecutor,
        forwarded="no",
        last_update="2026-12-06",
    ),
    CodemodDeclaration(
        id="vllm-kv-budget-planned-unified",
        seam="kv-budget",
        engine="vllm",
        versions=">=0.9.2,<0.11",
        anchor="vllm.v1.engine.core.EngineCore._initialize_kv_caches: "
               "self.model_executor.determine_available_memory() and "
               "self.model_executor.initialize_from_config(kv_cache_configs)",
        targets=("{package}/v1/engine/core.py",),
        expected_hits=2,
        why="The virtual KV size (what vLLM sizes its block table from) and the physical "
            "limit are separate kvcached settings; the user's kv_cache_memory_bytes (new in "
            "0.10.2) and num_gpu_blocks_override win. As vllm-kv-budget-planned-scaled, the "
            "scheduler keeps stock vLLM's blocks and the workers' tensors are scaled to whole "
            "kvcached pages; these releases bring their ranks to one block count without "
            "resizing them (unify_kv_cache_configs), so each is scaled by the model's page.",
        retire_when="Never for this range: get_kv_cache_configs, which resizes ranks, arrived "
                    "in 0.11.",
        codemod=_vllm_kv_plan_unified.KVBudgetPlannedForUnifiedRanks,
        forwarded="not-needed",
        last_update="2026-12-07",
    ),
    CodemodDeclaration(
        id="vllm-kv-budget-planned-scaled",
        seam="kv-budget",
        engine="vllm",
        versions=">=0.11,<0.29",
        anchor="vllm.v1.engine.core.EngineCore._initialize_kv_caches: "
               "self.model_executor.determine_available_memory() and "
               "self.model_executor.initialize_from_config(kv_cache_configs)",
        targets=("{package}/v1/engine/core.py",),
        expected_hits=2,
        why="As vllm-kv-budget-planned; these releases have no bytes-per-block helper to plan "
            "with, so each rank's KV tensors are scaled to whole kvcached pages as the release "
            "itself scales ranks to a common block count.",
        retire_when="Never for this range: the planning helper arrived in 0.29.",
        codemod=_vllm_kv_plan_older.KVBudgetPlannedByScaling,
        forwarded="not-needed",
        last_update="2026-12-07",
    ),
    CodemodDeclaration(
        id="vllm-kv-budget-planned-groups",
        seam="kv-budget",
        engine="vllm",
        versions=">=0.29,<0.32",
        anchor="vllm.v1.engine.core.EngineCore._initialize_kv_caches: "
               "self.model_executor.determine_available_memory() and "
               "self.model_executor.initialize_from_config(kv_cache_configs)",
        targets=("{package}/v1/engine/core.py",),
        expected_hits=2,
        why="As vllm-kv-budget-planned; these releases' bytes-per-block helper "
            "(kv_cache_utils._pool_bytes_per_block) takes the KV cache groups only.",
        retire_when="vLLM sizes KV from a pluggable capacity provider (then kvcached supplies "
                    "the virtual size through it).",
        codemod=_vllm_kv_plan_older.KVBudgetPlannedForGroups,
        forwarded="no",
        last_update="2026-12-07",
    ),
    CodemodDeclaration(
        id="vllm-kv-budget-planned",
        seam="kv-budget",
        engine="vllm",
        versions="==0.32.*",
        anchor="vllm.v1.engine.core.EngineCore._initialize_kv_caches: "
               "self.model_executor.determine_available_memory() and "
               "self.model_executor.initialize_from_config(kv_cache_configs)",
        targets=("{package}/v1/engine/core.py",),
        expected_hits=2,
        why="The virtual KV size and the physical limit are separate kvcached settings; the "
            "user's kv_cache_memory_bytes wins; the scheduler keeps exactly stock vLLM's "
            "blocks (its capacity, its refusal, its fitted max_model_len for every budget): "
            "only the workers' KV caches are re-planned, by vLLM's own planner, to whole "
            "kvcached pages.",
        retire_when="vLLM sizes KV from a pluggable capacity provider (then kvcached supplies "
                    "the virtual size through it).",
        codemod=_vllm_kv_plan.KVBudgetPlannedInWholePages,
        forwarded="no",
        last_update="2026-12-06",
    ),
    CodemodDeclaration(
        id="vllm-kv-budget-planned-builder",
        seam="kv-budget",
        engine="vllm",
        versions=">=0.33,<0.35",
        anchor="vllm.v1.engine.core.EngineCore._initialize_kv_caches: "
               "self.model_executor.determine_available_memory() and "
               "self.model_executor.initialize_from_config(kv_cache_configs)",
        targets=("{package}/v1/engine/core.py",),
        expected_hits=2,
        why="As vllm-kv-budget-planned; these releases plan through a KV cache config builder "
            "(vllm/v1/core/kv_cache_config_builder.py).",
        retire_when="vLLM sizes KV from a pluggable capacity provider (then kvcached supplies "
                    "the virtual size through it).",
        codemod=_vllm_kv_plan.KVBudgetPlannedByBuilder,
        forwarded="no",
        last_update="2026-12-06",
    ),
    CodemodDeclaration(
        id="vllm-kv-buffers-per-layer",
        seam="kv-buffers-v1-runner",
        engine="vllm",
        versions=">=0.9.2,<0.10.1",
        anchor="vllm.v1.worker.gpu_model_runner.GPUModelRunner._allocate_kv_cache_tensors: "
               "torch.zeros(..., dtype=torch.int8, ...)",
        targets=("{package}/v1/worker/gpu_model_runner.py",),
        expected_hits=1,
        why="The attention kernels must read VMM-backed KV buffers with exactly the stock byte "
            "layout (K/V planes per layer), mapped page by page as blocks are used.",
        retire_when="Retired by vLLM 0.29's single allocate_kv_cache (vllm-kv-buffers-shared).",
        codemod=_vllm_kv_buffers.PerLayerKVBuffers,
        forwarded="not-needed",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-kv-buffers-attn-groups",
        seam="kv-buffers-v1-runner",
        engine="vllm",
        versions=">=0.10.1,<0.24",
        anchor="vllm.v1.worker.gpu_model_runner.GPUModelRunner._allocate_kv_cache_tensors: "
               "torch.zeros(..., dtype=torch.int8, ...) (per KVCacheTensor, self.attn_groups)",
        targets=("{package}/v1/worker/gpu_model_runner.py",),
        expected_hits=1,
        why="As vllm-kv-buffers-per-layer, for the runners that replaced their attn_backends "
            "list with attention groups (0.10.1): the call site passes each group's shape and "
            "stride order, and block_stride=0 (no packed backings before 0.24).",
        retire_when="Retired by vLLM 0.29's single allocate_kv_cache (vllm-kv-buffers-shared).",
        codemod=_vllm_kv_buffers_attn_groups.AttentionGroupKVBuffers,
        forwarded="not-needed",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-kv-buffers-mrv2-backends",
        seam="kv-buffers-v2-runner",
        engine="vllm",
        versions=">=0.22,<0.23",
        anchor="vllm.v1.worker.gpu.attn_utils._allocate_kv_cache: torch.zeros(..., "
               "dtype=torch.int8, ...), its new attn_backends parameter, and the call in "
               "init_kv_cache",
        targets=("{package}/v1/worker/gpu/attn_utils.py",),
        expected_hits=3,
        why="Model Runner V2 is the default runner for allow-listed architectures from 0.22; "
            "its KV buffers must be VMM-backed like the V1 runner's. In 0.22 its caller "
            "init_kv_cache holds each layer's backend class (attn_backends), which it passes "
            "in.",
        retire_when="Retired by vLLM 0.29's single allocate_kv_cache (vllm-kv-buffers-shared).",
        codemod=_vllm_kv_buffers_attn_groups.ModelRunnerV2BackendsKVBuffers,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-kv-buffers-mrv2-groups",
        seam="kv-buffers-v2-runner",
        engine="vllm",
        versions=">=0.23,<0.24",
        anchor="vllm.v1.worker.gpu.attn_utils._allocate_kv_cache: torch.zeros(..., "
               "dtype=torch.int8, ...), its new attn_groups parameter, and the call in "
               "init_kv_cache",
        targets=("{package}/v1/worker/gpu/attn_utils.py",),
        expected_hits=3,
        why="As vllm-kv-buffers-mrv2-backends; from 0.23 init_kv_cache holds the attention "
            "groups, as in 0.24, but nothing is packed yet (block_stride=0).",
        retire_when="Retired by vLLM 0.29's single allocate_kv_cache (vllm-kv-buffers-shared).",
        codemod=_vllm_kv_buffers_attn_groups.ModelRunnerV2GroupsKVBuffers,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-kv-buffers-tensors",
        seam="kv-buffers-v1-runner",
        engine="vllm",
        versions=">=0.24,<0.29",
        anchor="vllm.v1.worker.gpu_model_runner.GPUModelRunner._allocate_kv_cache_tensors: "
               "torch.zeros(..., dtype=torch.int8, ...) (per KVCacheTensor, packed backing)",
        targets=("{package}/v1/worker/gpu_model_runner.py",),
        expected_hits=2,
        why="The V1 runner's KV buffers (one per KVCacheTensor, or the one packed backing of "
            "every layer when block_stride > 0) must be VMM-backed with exactly the stock bytes "
            "and mapped by page; the call site passes each attention group's shape and stride "
            "order, so the adapter knows where a block lies without knowing the version.",
        retire_when="Retired by vLLM 0.29's single allocate_kv_cache (vllm-kv-buffers-shared).",
        codemod=_vllm_kv_buffers.TensorKVBuffers,
        forwarded="not-needed",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-kv-buffers-mrv2",
        seam="kv-buffers-v2-runner",
        engine="vllm",
        versions=">=0.24,<0.29",
        anchor="vllm.v1.worker.gpu.attn_utils._allocate_kv_cache: torch.zeros(..., "
               "dtype=torch.int8, ...) x2, its new attn_groups parameter, and the call in "
               "init_kv_cache",
        targets=("{package}/v1/worker/gpu/attn_utils.py",),
        expected_hits=4,
        why="Model Runner V2 (the default runner for allow-listed architectures, Llama "
            "included, from 0.22) allocates its own KV buffers; they must be VMM-backed like "
            "the V1 runner's. _allocate_kv_cache is not given the attention groups, so its one "
            "caller passes them in.",
        retire_when="Retired by vLLM 0.29's single allocate_kv_cache (vllm-kv-buffers-shared), "
                    "or by a KV-allocation context both runners honour.",
        codemod=_vllm_kv_buffers.ModelRunnerV2KVBuffers,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-kv-buffers-shared",
        seam="kv-buffers-v1-runner",
        also_covers=("kv-buffers-v2-runner",),
        engine="vllm",
        versions=">=0.29,<0.34",
        anchor="vllm.v1.worker.utils.allocate_kv_cache: torch.zeros(..., dtype=torch.int8, ...)",
        targets=("{package}/v1/worker/utils.py",),
        expected_hits=1,
        why="The one backing buffer of every layer must be VMM-backed with the byte layout the "
            "resolved KVCacheLayout expects (layer- or block-outermost), mapped by page.",
        retire_when="vLLM's kv_cache_allocation_context can supply a page-on-demand allocator "
                    "for the backing buffer (then pass it instead of rewriting the call).",
        codemod=_vllm_kv_buffers.SharedKVBuffer,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-kv-buffers-shared-helper",
        seam="kv-buffers-v2-runner",
        engine="vllm",
        versions=">=0.34,<0.35",
        anchor="vllm.v1.worker.utils._allocate_kv_cache_buffer: torch.zeros(..., "
               "dtype=torch.int8, ...), its new kvcached_regions parameter, and the call in "
               "allocate_kv_cache",
        targets=("{package}/v1/worker/utils.py",),
        expected_hits=3,
        why="As vllm-kv-buffers-shared: in 0.34 the int8 zeros of the one backing buffer moved "
            "into _allocate_kv_cache_buffer(raw_size, device), which is not given the "
            "KVCacheTensors, so its one caller allocate_kv_cache passes their regions in. "
            "allocate_kv_cache's new allocate= hook (vLLM's own extensible KV cache) is left "
            "alone: with elastic mode on it yields no VMM pool and the engine refuses to start.",
        retire_when="vLLM's allocate= hook is given the KVCacheTensors' regions (then pass an "
                    "elastic allocate instead of rewriting the helper).",
        codemod=_vllm_kv_buffers_shared_helper.SharedKVBufferFromCaller,
        forwarded="no",
        last_update="2026-12-04",
    ),
    # Start-up memory checks of the GPU worker: next to elastic neighbours whose memory moves
    # while this engine starts (adapter: integration/vllm/startup_memory.py).
    CodemodDeclaration(
        id="vllm-startup-free-memory-worker",
        seam="startup-free-memory",
        engine="vllm",
        versions=">=0.9.2,<0.14",
        anchor="vllm.v1.worker.gpu_worker.Worker.init_device: "
               "self.init_snapshot.free_memory < self.requested_memory",
        targets=("{package}/v1/worker/gpu_worker.py",),
        expected_hits=1,
        why="An elastic engine claims neither its KV share nor its neighbours' idle KV up "
            "front: the start-up check must count what elastic neighbours give back and leave "
            "the engine's own unbacked KV out, and stay the stock comparison when not elastic.",
        retire_when="vLLM lets a KV-cache allocator report the memory it needs at start "
                    "(or drops the free-memory check for engines that do not preallocate KV).",
        codemod=_vllm_startup_memory.ElasticStartupFreeMemoryCheck,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-startup-free-memory",
        seam="startup-free-memory",
        engine="vllm",
        versions=">=0.14,<0.35",
        anchor="vllm.v1.worker.utils.request_memory: init_snapshot.free_memory < "
               "requested_memory (and < engine_memory where weights are held outside, 0.32)",
        targets=("{package}/v1/worker/utils.py",),
        expected_hits="1..2",
        why="As vllm-startup-free-memory-worker; the check moved into request_memory, and 0.32 "
            "compares a second time when weights are held outside the process.",
        retire_when="vLLM lets a KV-cache allocator report the memory it needs at start "
                    "(or drops the free-memory check for engines that do not preallocate KV).",
        codemod=_vllm_startup_memory.ElasticStartupFreeMemoryCheck,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    CodemodDeclaration(
        id="vllm-memory-profile-check",
        seam="memory-profile-check",
        engine="vllm",
        versions=">=0.9.2,<0.35",
        anchor="vllm.v1.worker.gpu_worker.Worker.determine_available_memory: "
               "assert <initial free> >= free_gpu_memory ('Error in memory profiling')",
        targets=("{package}/v1/worker/gpu_worker.py",),
        expected_hits=1,
        why="An elastic neighbour that gives pages back (or finishes its own profile run) "
            "while this engine profiles raises free memory, which the stock assertion takes for "
            "a profiling error and stops the engine; the elastic profile only sizes KV address "
            "space, so the rise is accepted while room for the first KV pages is still required.",
        retire_when="vLLM measures the profile run with per-process memory instead of "
                    "device-wide free memory.",
        codemod=_vllm_startup_memory.ElasticMemoryProfileCheck,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    # The start-up window: one elastic engine at a time between its initial snapshot and the
    # end of its profile on one device. The snapshot is `self.init_snapshot = MemorySnapshot()`
    # up to 0.13 and `self.init_snapshot = init_snapshot = MemorySnapshot(device=self.device)`
    # from 0.14, in Worker.init_device after self.device is set, in every release; the same
    # codemod matches both shapes. The window ends when determine_available_memory returns (any
    # path: kv_cache_memory_bytes skips the profile) or initialize_from_config does, not when
    # the first KV buffer is created: from 0.18 profile_cudagraph_memory allocates a minimal KV
    # cache inside the profile, before its figures are final.
    CodemodDeclaration(
        id="vllm-startup-window",
        seam="startup-window",
        engine="vllm",
        versions=">=0.9.2,<0.35",
        anchor="vllm.v1.worker.gpu_worker.Worker.init_device: self.init_snapshot = "
               "MemorySnapshot(...); Worker.determine_available_memory, "
               "Worker.initialize_from_config (decorators)",
        targets=("{package}/v1/worker/gpu_worker.py",),
        expected_hits=3,
        why="The profile charges every device-wide change of used memory between the initial "
            "snapshot and its end that this process's allocator did not make to this engine; "
            "an elastic engine whose window holds a neighbour's weight load sizes its KV "
            "address space too small for a burst (measured: 6.63 GiB where the neighbour got "
            "22.05 GiB). Elastic engines on one device take the window in turn (a per-device "
            "lock, released when the profile is done or the process exits).",
        retire_when="vLLM measures the profile with per-process memory instead of device-wide "
                    "used memory.",
        codemod=_vllm_startup_memory.StartupWindowAroundSnapshot,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
]
