"""Every transform, registered and justified.

A codemod is registered below with all its metadata. A diff is registered by its file: the line
naming it in ``patches/<engine>/<series>/series`` plus the DEP-3 style header at its top
(see ``patches/README.md``). The transform set of a cell is every registered transform whose
engine matches (``*`` matches every engine) and whose version range contains the cell's version:
codemods in registry order, then the diffs in the order of the cell's series file.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version
from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from codemods.base import HitCountingCodemod
from codemods.provenance import WriteProvenanceModule
from codemods.sglang.allocator_paged import ElasticPagedAllocator
from codemods.sglang.allocator_token import ElasticTokenAllocator
from codemods.sglang.capacity import KVBudgetCapacity
from codemods.sglang.config_guard import RefuseUnsupportedAtConfigure
from codemods.sglang.pool_mha import ElasticMHAPool
from codemods.sglang.pool_mla import ElasticMLAPool
from codemods.sglang.prefix_cache_bound import BoundPrefixCacheOnRelease
from forge.errors import TransformError

ANY_ENGINE = "*"
PATCHES_ROOT = Path(__file__).resolve().parent.parent / "patches"
REQUIRED_PATCH_FIELDS = ("Description", "Why", "Anchor", "Expected-Hits", "Retire-When",
                         "Last-Update")
_ID = re.compile(r"[a-z0-9][a-z0-9._-]*")


class Kind(StrEnum):
    CODEMOD = "codemod"
    DIFF = "diff"


@dataclass(frozen=True)
class ExpectedHits:
    """An exact count (``1``) or an inclusive range (``2..4``)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int) -> ExpectedHits:
        raw = str(text).strip()
        match = re.fullmatch(r"(\d+)(?:\.\.(\d+))?", raw)
        if not match:
            raise ValueError(f"expected hits must be N or MIN..MAX, got {raw!r}")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if low < 1 or high < low:
            raise ValueError(f"expected hits must be >= 1 and MIN <= MAX, got {raw!r}")
        return cls(low, high)

    def __contains__(self, hits: object) -> bool:
        return isinstance(hits, int) and self.low <= hits <= self.high

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}..{self.high}"


@dataclass(frozen=True)
class Transform:
    id: str
    engine: str
    versions: SpecifierSet
    kind: Kind
    anchor: str
    targets: tuple[str, ...]          # paths in the wheel; "{package}" is the engine package
    expected_hits: ExpectedHits
    why: str
    retire_when: str
    codemod: type[HitCountingCodemod] | None = None
    patch: Path | None = None
    forwarded: str = ""
    last_update: str = ""
    description: str = ""

    def applies_to(self, engine: str, version: str) -> bool:
        return self.engine in (ANY_ENGINE, engine) and Version(version) in self.versions

    def target_paths(self, package: str) -> tuple[str, ...]:
        return tuple(t.replace("{package}", package) for t in self.targets)

    def source_bytes(self) -> bytes:
        """The text this transform is made of: its patch file, or its codemod module together
        with every `codemods` module that module imports (helpers shape the output too)."""
        if self.patch is not None:
            return self.patch.read_bytes()
        if self.codemod is None:
            raise TransformError(f"transform {self.id} has neither a codemod nor a patch")
        source_file = inspect.getsourcefile(self.codemod)
        if source_file is None:
            raise TransformError(f"transform {self.id}: source of {self.codemod!r} not found")
        files = _codemod_sources(Path(source_file).resolve())
        return b"".join(f"{_label(path)}\n".encode() + path.read_bytes() for path in files)


CODEMODS_ROOT = Path(__file__).resolve().parent


def _codemod_sources(module: Path) -> list[Path]:
    """`module` and the `codemods` modules it imports, transitively, in a stable order."""
    seen: set[Path] = set()
    pending = [module]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        package = (path.parent.relative_to(CODEMODS_ROOT.parent).parts
                   if path.is_relative_to(CODEMODS_ROOT) else ())
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (package or not node.level):
                base = package[:len(package) - node.level + 1] if node.level else ()
                module_name = ".".join((*base, *(node.module or "").split("."))).strip(".")
                names = [module_name] + [f"{module_name}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] != CODEMODS_ROOT.name:
                    continue
                candidate = CODEMODS_ROOT.parent.joinpath(*parts)
                for found in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                    if found.is_file():
                        pending.append(found)
    return sorted(seen)


def _label(path: Path) -> str:
    return str(path.relative_to(CODEMODS_ROOT.parent)) if path.is_relative_to(
        CODEMODS_ROOT.parent) else path.name


def codemod(*, id: str, engine: str, versions: str, anchor: str, targets: Sequence[str],
            expected_hits: str | int, why: str, retire_when: str,
            codemod: type[HitCountingCodemod], forwarded: str = "",
            last_update: str = "") -> Transform:
    """Register a codemod (the metadata is checked again by ``Registry.lint``)."""
    return Transform(
        id=id, engine=engine, versions=SpecifierSet(versions), kind=Kind.CODEMOD,
        anchor=anchor, targets=tuple(targets), expected_hits=ExpectedHits.parse(expected_hits),
        why=why, retire_when=retire_when, codemod=codemod, forwarded=forwarded,
        last_update=last_update, description=(codemod.__doc__ or "").strip().splitlines()[0]
        if codemod.__doc__ else "",
    )


@dataclass
class Registry:
    codemods: list[Transform]
    patches_root: Path = PATCHES_ROOT
    _diff_cache: dict[tuple[str, str], list[Transform]] = field(default_factory=dict, repr=False)

    def transforms_for(self, engine: str, series: str, version: str) -> list[Transform]:
        """The transform set of a cell, in application order."""
        selected = [t for t in self.codemods if t.applies_to(engine, version)]
        selected += [t for t in self.diffs(engine, series) if t.applies_to(engine, version)]
        return selected

    def series_file(self, engine: str, series: str) -> Path:
        return self.patches_root / engine / series / "series"

    def diffs(self, engine: str, series: str) -> list[Transform]:
        """The diffs of ``patches/<engine>/<series>/series``, in series order."""
        key = (engine, series)
        if key not in self._diff_cache:
            self._diff_cache[key] = [
                load_patch(path, engine, series)
                for path in _series_entries(self.series_file(engine, series))
            ]
        return self._diff_cache[key]

    def all_series(self) -> list[tuple[str, str]]:
        if not self.patches_root.is_dir():
            return []
        return sorted(
            (path.parent.parent.name, path.parent.name)
            for path in self.patches_root.glob("*/*/series")
        )

    def lint(self) -> list[str]:
        """Problems in the registry, one line each; empty when every transform is complete."""
        problems: list[str] = []
        transforms: list[Transform] = list(self.codemods)
        for engine, series in self.all_series():
            try:
                transforms += self.diffs(engine, series)
            except TransformError as exc:
                problems.append(str(exc))
        seen: set[str] = set()
        for transform in transforms:
            where = f"transform {transform.id or '<no id>'}"
            if not _ID.fullmatch(transform.id):
                problems.append(f"{where}: id must be lower-case letters, digits, '.', '_', '-'")
            if transform.id in seen:
                problems.append(f"{where}: id registered twice")
            seen.add(transform.id)
            for name in ("engine", "anchor", "why", "retire_when"):
                if not str(getattr(transform, name)).strip():
                    problems.append(f"{where}: field {name!r} is empty")
            if not transform.targets:
                problems.append(f"{where}: no target files")
            if transform.kind is Kind.CODEMOD and not (
                isinstance(transform.codemod, type)
                and issubclass(transform.codemod, HitCountingCodemod)
            ):
                problems.append(f"{where}: codemod must subclass HitCountingCodemod")
        return problems


def _series_entries(series_file: Path) -> list[Path]:
    if not series_file.exists():
        return []
    entries: list[Path] = []
    for number, line in enumerate(series_file.read_text(encoding="utf-8").splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        path = series_file.parent / name
        if not path.is_file():
            raise TransformError(f"{series_file}:{number}: patch {name!r} does not exist")
        entries.append(path)
    return entries


def parse_patch_header(text: str) -> dict[str, str]:
    """DEP-3 style ``Field: value`` lines (indented lines continue a value) before the diff."""
    fields: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith(("diff --git ", "--- ", "Index: ")):
            break
        if line[:1] in (" ", "\t") and current is not None:
            fields[current] += "\n" + line.strip()
            continue
        match = re.match(r"([A-Za-z][A-Za-z0-9-]*):\s*(.*)", line)
        if match:
            current = match.group(1)
            fields[current] = match.group(2).strip()
        else:
            current = None
    return fields


def load_patch(path: Path, engine: str, series: str) -> Transform:
    """Register one diff from its header; every fault names the file."""
    raw = path.read_bytes()
    text = raw.decode("utf-8")
    where = f"patch {path}"
    if b"\r\n" in raw:
        raise TransformError(f"{where}: has CRLF line endings")
    if not text.endswith("\n"):
        raise TransformError(f"{where}: does not end with a newline")
    header = parse_patch_header(text)
    missing = [name for name in REQUIRED_PATCH_FIELDS if not header.get(name, "").strip()]
    if missing:
        raise TransformError(f"{where}: header lacks {', '.join(missing)}")
    try:
        expected = ExpectedHits.parse(header["Expected-Hits"])
        versions = SpecifierSet(header.get("Applies-To") or f"=={series}.*")
    except (ValueError, InvalidSpecifier) as exc:
        raise TransformError(f"{where}: {exc}") from None
    try:
        patch_set = PatchSet.from_string(text)
    except UnidiffParseError as exc:
        raise TransformError(f"{where}: not a valid unified diff: {exc}") from None
    targets = tuple(_strip_prefix(f.target_file if not f.is_removed_file else f.source_file)
                    for f in patch_set)
    if not targets:
        raise TransformError(f"{where}: contains no file changes")
    hunks = sum(len(f) for f in patch_set)
    if hunks not in expected:
        raise TransformError(f"{where}: has {hunks} hunks, header Expected-Hits says {expected}")
    return Transform(
        id=path.stem, engine=engine, versions=versions, kind=Kind.DIFF,
        anchor=header["Anchor"], targets=targets, expected_hits=expected,
        why=header["Why"], retire_when=header["Retire-When"], patch=path,
        forwarded=header.get("Forwarded", ""), last_update=header["Last-Update"],
        description=header["Description"],
    )


def _strip_prefix(name: str) -> str:
    return name[2:] if name.startswith(("a/", "b/")) else name


# --- the registered codemods, in application order -------------------------------------------

CODEMODS: list[Transform] = [
    codemod(
        id="provenance",
        engine=ANY_ENGINE,
        versions="",
        anchor="file {package}/_kvcached_build.py (new module)",
        targets=["{package}/_kvcached_build.py"],
        expected_hits=1,
        why="A running engine must be able to say which patched build it is (cell, base "
            "artifact and sha256, transforms, patch-set fingerprint).",
        retire_when="Never: vendor-specific; it exists because these wheels are ours.",
        codemod=WriteProvenanceModule,
        forwarded="not-needed",
        last_update="2026-11-30",
    ),
]


# --- SGLang (cell sglang-0.5, 0.5.23) ---------------------------------------------------------
# Elastic allocators and pools are subclasses appended to their defining modules (so every
# module importing the name gets them), rebound only with KVCACHED_ENABLE=1.
#
# The scheduler's memory-leak invariant (invariant_checker.py: available + evictable +
# protected + session_held (+ uncached) == max_total_num_tokens) is kept true by the allocator,
# not by rewriting the checker: the elastic allocators report the LOGICAL free capacity
# (SGLang pages not held, times page_size), which is exactly what the stock free lists report,
# so the checker, the prefill budget and eviction see the numbers they always did. This is
# sound because the pools are sized from the kvcached budget (sglang-kv-budget): every token
# the scheduler admits can be mapped. What it gives up: a shared limit lowered below the
# engine's capacity at run time (kvctl) is not seen by the scheduler; an allocation the ledger
# then refuses returns None and takes SGLang's out-of-memory path. Honouring run-time limits
# would need a physical available_size plus a checker transform.

_SGLANG_05 = ">=0.5.23,<0.5.24"
_SGLANG_DATE = "2026-11-30"

CODEMODS += [
    codemod(
        id="sglang-token-allocator",
        engine="sglang",
        versions=_SGLANG_05,
        anchor="sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator",
        targets=["{package}/srt/mem_cache/allocator/token.py"],
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
    codemod(
        id="sglang-paged-allocator",
        engine="sglang",
        versions=_SGLANG_05,
        anchor="sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator",
        targets=["{package}/srt/mem_cache/allocator/paged.py"],
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
    codemod(
        id="sglang-mha-pool",
        engine="sglang",
        versions=_SGLANG_05,
        anchor="sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal",
        targets=["{package}/srt/mem_cache/memory_pool.py"],
        expected_hits=1,
        why="The fused per-layer (2, rows, H, D) K/V buffers of 0.5.23 must be views of "
            "VMM-backed tensors (same shapes and strides, data pointers fixed for the pool's "
            "life); quantized, HND and post-capture layouts are refused.",
        retire_when="SGLang's kv_vmm_backing can unmap by allocator page, or "
                    "get_kv_pool_cls('mha') covers every MHA construction site.",
        codemod=ElasticMHAPool,
        forwarded="no",
        last_update=_SGLANG_DATE,
    ),
    codemod(
        id="sglang-mla-pool",
        engine="sglang",
        versions=_SGLANG_05,
        anchor="sglang.srt.mem_cache.memory_pool.MLATokenToKVPool._create_buffers",
        targets=["{package}/srt/mem_cache/memory_pool.py"],
        expected_hits=1,
        why="MLA latent buffers (rows, 1, kv_lora_rank + rope) must be views of VMM-backed "
            "tensors like the MHA ones.",
        retire_when="get_kv_pool_cls('mla') is honoured and can be shipped as a plugin.",
        codemod=ElasticMLAPool,
        forwarded="no",
        last_update=_SGLANG_DATE,
    ),
    codemod(
        id="sglang-kv-budget",
        engine="sglang",
        versions=_SGLANG_05,
        anchor="sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
               "._profile_available_bytes (each return)",
        targets=["{package}/srt/mem_cache/kv_cache_configurator.py"],
        expected_hits=1,
        why="Pool capacity must come from the kvcached budget (KVCACHED_PHYSICAL_LIMIT), so "
            "the logical capacity the allocator reports can always be backed.",
        retire_when="SGLang accepts a KV byte budget from a platform hook.",
        codemod=KVBudgetCapacity,
        forwarded="no",
        last_update=_SGLANG_DATE,
    ),
    codemod(
        id="sglang-refuse-unsupported",
        engine="sglang",
        versions=_SGLANG_05,
        anchor="sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure",
        targets=["{package}/srt/mem_cache/kv_cache_configurator.py"],
        expected_hits=1,
        why="The memory saver, custom memory pools, post-capture KV sizing and hybrid pools "
            "own or resize KV memory themselves; with elastic memory they must stop start-up "
            "with a clear message instead of failing later.",
        retire_when="Each of those paths is made elastic.",
        codemod=RefuseUnsupportedAtConfigure,
        forwarded="not-needed",
        last_update=_SGLANG_DATE,
    ),
    codemod(
        id="sglang-prefix-cache-bound",
        engine="sglang",
        versions=_SGLANG_05,
        anchor="sglang.srt.mem_cache.common.release_kv_cache",
        targets=["{package}/srt/mem_cache/common.py"],
        expected_hits=1,
        why="A finished request's KV stays in the prefix cache (UnifiedRadixCache or "
            "RadixCache) and pins its pages; bounding the evictable part after every release "
            "lets idle memory return to the pool.",
        retire_when="SGLang offers a prefix-cache size cap.",
        codemod=BoundPrefixCacheOnRelease,
        forwarded="no",
        last_update=_SGLANG_DATE,
    ),
]
# --- end of SGLang ----------------------------------------------------------------------------


# --- vLLM: elastic block pool and KV buffers (cells vllm-0.9, vllm-0.25, vllm-0.32) ---------
# One transform set; where vLLM versions differ, the registry selects the codemod by version
# range and the rewritten call site passes what differs. The adapter they call is
# kvcached_core/integration/vllm.

from codemods.vllm import allocate_slots as _vllm_allocate_slots  # noqa: E402
from codemods.vllm import block_pool as _vllm_block_pool  # noqa: E402
from codemods.vllm import engine_core as _vllm_engine_core  # noqa: E402
from codemods.vllm import kv_buffers as _vllm_kv_buffers  # noqa: E402

_VLLM_REVIEWED = "2026-12-01"

CODEMODS += [
    codemod(
        id="vllm-block-pool",
        engine="vllm",
        versions=">=0.9.2,<0.33",
        anchor="vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.__init__: BlockPool(...)",
        targets=["{package}/v1/core/kv_cache_coordinator.py"],
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
    codemod(
        id="vllm-allocate-slots-race",
        engine="vllm",
        versions=">=0.9.2,<0.33",
        anchor="vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots (decorator)",
        targets=["{package}/v1/core/kv_cache_manager.py"],
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
    codemod(
        id="vllm-engine-step-release",
        engine="vllm",
        versions=">=0.9.2,<0.33",
        anchor="vllm.v1.engine.core.EngineCore.step, EngineCore.step_with_batch_queue "
               "(decorators)",
        targets=["{package}/v1/engine/core.py"],
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
    codemod(
        id="vllm-engine-shutdown",
        engine="vllm",
        versions=">=0.9.2,<0.33",
        anchor="vllm.v1.engine.core.EngineCore.shutdown (decorator)",
        targets=["{package}/v1/engine/core.py"],
        expected_hits=1,
        why="Shutdown must release every page and remove the pool's shared-memory limit record.",
        retire_when="vLLM calls a KV-cache allocator's close hook on shutdown.",
        codemod=_vllm_engine_core.ClosePoolOnShutdown,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    codemod(
        id="vllm-kv-budget",
        engine="vllm",
        versions=">=0.9.2,<0.10.2",
        anchor="vllm.v1.engine.core.EngineCore._initialize_kv_caches: "
               "self.model_executor.determine_available_memory()",
        targets=["{package}/v1/engine/core.py"],
        expected_hits=1,
        why="The virtual KV size (what vLLM sizes its block table from) and the physical limit "
            "are separate kvcached settings; num_gpu_blocks_override wins; blocks are rounded "
            "to whole kvcached pages; multi-process workers are refused at start.",
        retire_when="Never for this range: it predates kv_cache_memory_bytes (0.10.2).",
        codemod=_vllm_engine_core.KVCacheBudget,
        forwarded="not-needed",
        last_update=_VLLM_REVIEWED,
    ),
    codemod(
        id="vllm-kv-budget-user-bytes",
        engine="vllm",
        versions=">=0.10.2,<0.33",
        anchor="vllm.v1.engine.core.EngineCore._initialize_kv_caches: "
               "self.model_executor.determine_available_memory()",
        targets=["{package}/v1/engine/core.py"],
        expected_hits=1,
        why="As vllm-kv-budget, and the user's kv_cache_memory_bytes (new in 0.10.2) wins too.",
        retire_when="vLLM sizes KV from a pluggable capacity provider (then kvcached supplies "
                    "the virtual size through it).",
        codemod=_vllm_engine_core.KVCacheBudgetWithUserBytes,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
    codemod(
        id="vllm-kv-buffers-per-layer",
        engine="vllm",
        versions=">=0.9.2,<0.12",
        anchor="vllm.v1.worker.gpu_model_runner.GPUModelRunner._allocate_kv_cache_tensors: "
               "torch.zeros(..., dtype=torch.int8, ...)",
        targets=["{package}/v1/worker/gpu_model_runner.py"],
        expected_hits=1,
        why="The attention kernels must read VMM-backed KV buffers with exactly the stock byte "
            "layout (K/V planes per layer), mapped page by page as blocks are used.",
        retire_when="Retired by vLLM 0.29's single allocate_kv_cache (vllm-kv-buffers-shared).",
        codemod=_vllm_kv_buffers.PerLayerKVBuffers,
        forwarded="not-needed",
        last_update=_VLLM_REVIEWED,
    ),
    codemod(
        id="vllm-kv-buffers-tensors",
        engine="vllm",
        versions=">=0.24,<0.29",
        anchor="vllm.v1.worker.gpu_model_runner.GPUModelRunner._allocate_kv_cache_tensors: "
               "torch.zeros(..., dtype=torch.int8, ...) (per KVCacheTensor, packed backing)",
        targets=["{package}/v1/worker/gpu_model_runner.py"],
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
    codemod(
        id="vllm-kv-buffers-mrv2",
        engine="vllm",
        versions=">=0.24,<0.29",
        anchor="vllm.v1.worker.gpu.attn_utils._allocate_kv_cache: torch.zeros(..., "
               "dtype=torch.int8, ...) x2, its new attn_groups parameter, and the call in "
               "init_kv_cache",
        targets=["{package}/v1/worker/gpu/attn_utils.py"],
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
    codemod(
        id="vllm-kv-buffers-shared",
        engine="vllm",
        versions=">=0.29,<0.33",
        anchor="vllm.v1.worker.utils.allocate_kv_cache: torch.zeros(..., dtype=torch.int8, ...)",
        targets=["{package}/v1/worker/utils.py"],
        expected_hits=1,
        why="The one backing buffer of every layer must be VMM-backed with the byte layout the "
            "resolved KVCacheLayout expects (layer- or block-outermost), mapped by page.",
        retire_when="vLLM's kv_cache_allocation_context can supply a page-on-demand allocator "
                    "for the backing buffer (then pass it instead of rewriting the call).",
        codemod=_vllm_kv_buffers.SharedKVBuffer,
        forwarded="no",
        last_update=_VLLM_REVIEWED,
    ),
]


# --- vLLM: start-up memory checks next to elastic neighbours (cells vllm-0.9, -0.25, -0.32) --
# One contiguous block: the two comparisons of the GPU worker that refuse an engine whose
# neighbours' memory moves while it starts. Adapter: integration/vllm/startup_memory.py.

from codemods.vllm import startup_memory as _vllm_startup_memory  # noqa: E402

_VLLM_STARTUP_REVIEWED = "2026-12-01"

CODEMODS += [
    codemod(
        id="vllm-startup-free-memory-worker",
        engine="vllm",
        versions=">=0.9.2,<0.10",
        anchor="vllm.v1.worker.gpu_worker.Worker.init_device: "
               "self.init_snapshot.free_memory < self.requested_memory",
        targets=["{package}/v1/worker/gpu_worker.py"],
        expected_hits=1,
        why="An elastic engine claims neither its KV share nor its neighbours' idle KV up "
            "front: the start-up check must count what elastic neighbours give back and leave "
            "the engine's own unbacked KV out, and stay the stock comparison when not elastic.",
        retire_when="vLLM lets a KV-cache allocator report the memory it needs at start "
                    "(or drops the free-memory check for engines that do not preallocate KV).",
        codemod=_vllm_startup_memory.ElasticStartupFreeMemoryCheck,
        forwarded="no",
        last_update=_VLLM_STARTUP_REVIEWED,
    ),
    codemod(
        id="vllm-startup-free-memory",
        engine="vllm",
        versions=">=0.25,<0.33",
        anchor="vllm.v1.worker.utils.request_memory: init_snapshot.free_memory < "
               "requested_memory (and < engine_memory where weights are held outside, 0.32)",
        targets=["{package}/v1/worker/utils.py"],
        expected_hits="1..2",
        why="As vllm-startup-free-memory-worker; the check moved into request_memory, and 0.32 "
            "compares a second time when weights are held outside the process.",
        retire_when="vLLM lets a KV-cache allocator report the memory it needs at start "
                    "(or drops the free-memory check for engines that do not preallocate KV).",
        codemod=_vllm_startup_memory.ElasticStartupFreeMemoryCheck,
        forwarded="no",
        last_update=_VLLM_STARTUP_REVIEWED,
    ),
    codemod(
        id="vllm-memory-profile-check",
        engine="vllm",
        versions=">=0.9.2,<0.33",
        anchor="vllm.v1.worker.gpu_worker.Worker.determine_available_memory: "
               "assert <initial free> >= free_gpu_memory ('Error in memory profiling')",
        targets=["{package}/v1/worker/gpu_worker.py"],
        expected_hits=1,
        why="An elastic neighbour that gives pages back (or finishes its own profile run) "
            "while this engine profiles raises free memory, which the stock assertion takes for "
            "a profiling error and stops the engine; the elastic profile only sizes KV address "
            "space, so the rise is accepted while room for the first KV pages is still required.",
        retire_when="vLLM measures the profile run with per-process memory instead of "
                    "device-wide free memory.",
        codemod=_vllm_startup_memory.ElasticMemoryProfileCheck,
        forwarded="no",
        last_update=_VLLM_STARTUP_REVIEWED,
    ),
]
# --- end of vLLM start-up memory checks -------------------------------------------------------


def default_registry(patches_root: Path = PATCHES_ROOT,
                     extra: Iterable[Transform] = ()) -> Registry:
    return Registry(codemods=[*CODEMODS, *extra], patches_root=patches_root)
