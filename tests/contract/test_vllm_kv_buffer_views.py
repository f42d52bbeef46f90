"""vLLM KV buffers on the patched tree: vLLM's own allocation and view code, real attention
backends, elastic against stock, bytes compared (contract venv, host backend).

Each runner's allocation (the V1 runner's `_allocate_kv_cache_tensors`, Model Runner V2's
`_allocate_kv_cache`) and its own view code run as the patched wheel runs them; with
KVCACHED_ENABLE=0 they must give what stock gives, and elastic their views must have the stock
shapes, strides and dtype, and the blocks of a mapped page must hold the same bytes as a stock
buffer after the same writes. Each rewrite variant is proven for the selected cells whose
transform set holds it: vLLM 0.24 - 0.28 (packed tensors; Model Runner V2 given the attention
groups) and vLLM 0.10.1 - 0.23 (one buffer per KVCacheTensor; Model Runner V2 where a 0.22 /
0.23 variant rewrites it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from forge.matrix import Cell
from forge.transforms import select_transforms
from tests.contract.vllm_contract import ROOT, contract_venv, tree_workspace, unpacked_sdist
from tests.proof_cells import proof_registry

pytestmark = pytest.mark.slow

# The 0.24 - 0.28 test runs for the selected cells whose transform set holds both rewrites its
# script exercises; the 0.10.1 - 0.23 test names its own with pytest.mark.cell_needs.
CELL_NEEDS_TRANSFORMS = ("vllm-kv-buffers-tensors", "vllm-kv-buffers-mrv2")

# Model Runner V2 rewrites of 0.22 / 0.23 -> the name the script calls that runner by.
MRV2_UNPACKED = {"vllm-kv-buffers-mrv2-backends": "mrv2-backends",
                 "vllm-kv-buffers-mrv2-groups": "mrv2-groups"}

# One model of three layers in one KV cache group, the backend under test, and where a block
# lies in its layout.
SETUP = r"""
import dataclasses
import importlib
import inspect
import math
import os
from types import SimpleNamespace

import torch

from kvcached_core.integration.vllm import pools
from kvcached_core.integration.vllm.config import pool_name
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        KVCacheTensor)
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import AttentionGroup

# The backend class: the first of the names given that the release's module defines.
_backend_module = importlib.import_module(
    "vllm.v1.attention.backends." + os.environ["KV_BACKEND_MODULE"])
Backend = next(getattr(_backend_module, name)
               for name in os.environ["KV_BACKEND_CLASS"].split(",")
               if hasattr(_backend_module, name))
PAGE = int(os.environ["KVCACHED_PAGE_SIZE"])
names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def _made(cls, **known):
    # A dataclass of this release, given the fields it has (0.10 adds use_mla to the spec and
    # a metadata builder to AttentionGroup; later releases drop both).
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in known.items() if name in fields})


spec = _made(FullAttentionSpec, block_size=16, num_kv_heads=2, head_size=64,
             dtype=torch.bfloat16, use_mla=False)
blocks = 32
config = KVCacheConfig(
    num_blocks=blocks,
    kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * blocks, shared_by=[n])
                      for n in names],
    kv_cache_groups=[KVCacheGroupSpec(names, spec)],
)
group = _made(AttentionGroup, backend=Backend, layer_names=names, kv_cache_spec=spec,
              kv_cache_group_id=0, metadata_builder=None)
shape = Backend.get_kv_cache_shape(1234567, 16, 2, 64)
block_dim = shape.index(1234567)
try:
    order = tuple(Backend.get_kv_cache_stride_order())
except NotImplementedError:
    order = tuple(range(len(shape)))
# The planes laid out outside the blocks (K and V of a (2, B, ...) layout): a block is one
# range of each plane, and a kvcached page holds PAGE bytes of every plane.
planes = math.prod(shape[i] for i in order[:order.index(block_dim)])
CONTIGUOUS = os.environ["KVCACHED_LAYOUT"] != "per-layer" and planes == 1
"""

# vLLM 0.24 - 0.28: both runners, viewed through Model Runner V2's reshape.
PACKED_RUNNERS = r"""
from vllm.v1.worker.gpu import attn_utils

runner = SimpleNamespace(device=torch.device("cpu"), attn_groups=[[group]],
                         runner_only_attn_layers=set())
RUNNERS = ("mrv2", "v1")


def allocate(which):
    if which == "mrv2":
        return attn_utils._allocate_kv_cache(config, {}, torch.device("cpu"),
                                             attn_groups=[[group]])
    return GPUModelRunner._allocate_kv_cache_tensors(runner, config)


def views(which, raw):
    return attn_utils._reshape_kv_cache([group], raw, "auto", [16], {}, config)
"""

# vLLM 0.10.1 - 0.23: the V1 runner with its own reshape; Model Runner V2 (KV_MRV2) with its.
UNPACKED_RUNNERS = r"""
runner = SimpleNamespace(device=torch.device("cpu"), attn_groups=[[group]],
                         runner_only_attn_layers=set(), kv_cache_config=config,
                         cache_config=SimpleNamespace(cache_dtype="auto"))
runner._kv_cache_spec_attn_group_iterator = (
    lambda: GPUModelRunner._kv_cache_spec_attn_group_iterator(runner))
RUNNERS = ("v1", *filter(None, os.environ["KV_MRV2"].split(",")))
layer_backends = {n: Backend for n in names}


def allocate(which):
    if which == "v1":
        return GPUModelRunner._allocate_kv_cache_tensors(runner, config)
    from vllm.v1.worker.gpu import attn_utils

    if which == "mrv2-backends":
        return attn_utils._allocate_kv_cache(config, {}, torch.device("cpu"),
                                             attn_backends=layer_backends)
    return attn_utils._allocate_kv_cache(config, {}, torch.device("cpu"),
                                         attn_groups=[[group]])


def _call(function, *first, **known):
    # A function of this release, with the arguments its signature names.
    params = list(inspect.signature(function).parameters)[len(first):]
    return function(*first, **{p: known[p] for p in params if p in known})


def views(which, raw):
    if which == "v1":
        return _call(GPUModelRunner._reshape_kv_cache_tensors, runner, kv_cache_config=config,
                     kv_cache_raw_tensors=raw, kernel_block_sizes=[16])
    from vllm.v1.worker.gpu import attn_utils

    return _call(attn_utils._reshape_kv_cache, kv_cache_config=config,
                 kv_cache_raw_tensors=raw, attn_backends=layer_backends, attn_groups=[group],
                 cache_dtype="auto", kernel_block_sizes=[16], shared_kv_cache_layers={})
"""

CHECK = r"""
for which in RUNNERS:
    os.environ["KVCACHED_ENABLE"] = "0"
    stock_raw = allocate(which)
    assert pools.lookup(pool_name()) is None, "switched off, no pool may be made"
    os.environ["KVCACHED_ENABLE"] = "1"
    ours_raw = allocate(which)
    engine_pool = pools.lookup(pool_name())
    assert engine_pool is not None, which
    stock, ours = views(which, stock_raw), views(which, ours_raw)
    k = engine_pool.tiling.min_blocks_per_page
    assert k == PAGE * planes // spec.page_size_bytes, (which, k)
    [page] = engine_pool.pool.alloc(1)
    for n in names:
        assert ours[n].shape == stock[n].shape, (which, n)
        assert ours[n].dtype == stock[n].dtype == spec.dtype, (which, n)
        if not CONTIGUOUS:  # the stock bytes exactly; contiguous interleaves the layers
            assert ours[n].stride() == stock[n].stride(), (which, n)
            assert ours_raw[n].numel() == stock_raw[n].numel()
        for b in range(page * k, (page + 1) * k):
            data = torch.randn(ours[n].select(block_dim, b).shape).to(torch.bfloat16)
            ours[n].select(block_dim, b).copy_(data)
            stock[n].select(block_dim, b).copy_(data)
            if not CONTIGUOUS:
                offset = ours[n].select(block_dim, b).data_ptr() - ours_raw[n].data_ptr()
                assert offset % (spec.page_size_bytes * blocks // planes) // PAGE == page, (
                    which, n, b, offset)
        for b in range(blocks):  # what the kernels read: every block, as stock has it
            assert torch.equal(ours[n].select(block_dim, b), stock[n].select(block_dim, b)), (
                which, n, b)
        if not CONTIGUOUS:
            assert torch.equal(ours_raw[n], stock_raw[n]), (which, n)
    if not CONTIGUOUS:
        # Every plane of every layer has the null block's page and `page` mapped, no more.
        region = spec.page_size_bytes * blocks // planes
        for ftensor in engine_pool.pool.tensors:
            assert sorted(ftensor.mapped_offsets()) == sorted(
                r * region + p * PAGE for r in range(planes) for p in (0, page)), which
    else:
        # One compound tensor: each logical page (the null block's, `page`) is one mapping
        # that holds the page's blocks of every layer.
        [ftensor] = engine_pool.pool.tensors
        assert len(ftensor.mapped_offsets()) == 2, ftensor.mapped_offsets()
    pools.close(pool_name())
print("OK")
"""

# name -> (module, class, VLLM_KV_CACHE_LAYOUT): FlashAttention is what the H200 runs. The CPU
# backend class is TorchSDPABackend up to 0.11.0, CPUAttentionBackend after.
BACKENDS = {
    "cpu-attn": ("cpu_attn", "CPUAttentionBackend,TorchSDPABackend", ""),
    "flash-attn-NHD": ("flash_attn", "FlashAttentionBackend", "NHD"),
    "flash-attn-HND": ("flash_attn", "FlashAttentionBackend", "HND"),
}
KV_LAYOUTS = ("per-layer", "auto")


@pytest.fixture(scope="session")
def patched_tree() -> Iterator[Callable[[Cell], Path]]:
    """The cell's sdist with its transform set applied, made once per cell (the scripts only
    read it), and kvcached_core beside it."""
    made: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="kvviews-trees-") as root:
        def tree_of(cell: Cell) -> Path:
            if cell.name not in made:
                where = Path(root) / cell.name
                tree = where / "patched"
                shutil.copytree(unpacked_sdist(cell, where / "sdist"), tree)
                tree_workspace(tree, patched=True, cell=cell)
                imports = where / "imports"
                imports.mkdir()
                (imports / "kvcached_core").symlink_to(ROOT / "kvcached_core")
                made[cell.name] = tree
            return made[cell.name]

        yield tree_of


# Each variant (backend x layout) of a cell's script runs in a child forked from one process
# that imported torch and the release's model runner once: on a 2-core host that import is
# about 10 s of each variant's 11. The children import kvcached_core and read their settings
# themselves; nothing of vLLM that a variant sets (VLLM_KV_CACHE_LAYOUT, read through an
# lru_cache at the first view) has been read before the fork. One thread: no OpenMP pool is
# running in the parent when it forks.
VARIANT_DRIVER = r"""
import importlib, json, os, signal, sys, traceback

import torch

torch.set_num_threads(1)
for module in ("vllm.v1.kv_cache_interface", "vllm.v1.worker.gpu_model_runner",
               "vllm.v1.worker.utils"):
    importlib.import_module(module)
with open(sys.argv[1]) as handle:
    jobs = json.load(handle)
statuses = {}
for key, job in jobs.items():
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            signal.alarm(job["timeout_s"])  # a hung variant dies; the others still run
            os.environ.update(job["env"])
            exec(compile(job["script"], "<kv-views>", "exec"), {"__name__": "__main__"})
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    statuses[key] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
with open(sys.argv[2], "w") as handle:
    json.dump(statuses, handle)
"""


@dataclass(frozen=True)
class VariantResult:
    status: int
    output: str

    @property
    def passed(self) -> bool:
        return self.status == 0 and self.output.strip().endswith("OK")


def run_variants(cell: Cell, tree: Path, script: str, where: Path,
                 **extra_env: str) -> dict[tuple[str, str], VariantResult]:
    """The script under every backend and layout of BACKENDS, in one process's children."""
    python = contract_venv(cell)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "VLLM_"))}
    env.update({
        "PYTHONPATH": f"{tree}{os.pathsep}{tree.parent / 'imports'}",
        "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
        "KVCACHED_PAGE_SIZE": str(32 << 10), "KVCACHED_MIN_RESERVED_PAGES": "0",
        "KVCACHED_MAX_RESERVED_PAGES": "0", "KVCACHED_PREALLOC": "0", **extra_env,
    })
    # The parent's environment has no VLLM_KV_CACHE_LAYOUT (no VLLM_ setting passes above):
    # a variant without one runs with vLLM's own choice.
    jobs = {}
    variants = {}
    for backend, (module, cls, layout) in sorted(BACKENDS.items()):
        for kv_layout in KV_LAYOUTS:
            key = f"{backend}-{kv_layout}"
            variants[key] = (backend, kv_layout)
            shm = where / key
            shm.mkdir(parents=True)
            variant = {"KVCACHED_LAYOUT": kv_layout, "KVCACHED_SHM_DIR": str(shm),
                       "KVCACHED_POOL_NAME": f"kvviews-{os.getpid()}-{len(jobs)}",
                       "KV_BACKEND_MODULE": module, "KV_BACKEND_CLASS": cls}
            if layout:
                variant["VLLM_KV_CACHE_LAYOUT"] = layout
            jobs[key] = {"env": variant, "script": script, "out": str(shm / "output.txt"),
                         "timeout_s": 300}
    (where / "jobs.json").write_text(json.dumps(jobs), encoding="utf-8")
    done = subprocess.run([str(python), "-c", VARIANT_DRIVER, str(where / "jobs.json"),
                           str(where / "statuses.json")], env=env, capture_output=True,
                          text=True, timeout=1800, cwd=where)
    assert done.returncode == 0, done.stderr[-4000:]
    statuses = json.loads((where / "statuses.json").read_text(encoding="utf-8"))
    return {variants[key]: VariantResult(statuses[key],
                                         Path(job["out"]).read_text(errors="replace"))
            for key, job in jobs.items()}


@pytest.fixture(scope="session")
def variant_results(patched_tree: Callable[[Cell], Path],
                    tmp_path_factory: pytest.TempPathFactory
                    ) -> Callable[..., dict[tuple[str, str], VariantResult]]:
    """Every variant's result of one cell and script, run on the first test that asks."""
    made: dict[tuple[str, str], dict[tuple[str, str], VariantResult]] = {}

    def results_of(cell: Cell, runners: str, **extra_env: str
                   ) -> dict[tuple[str, str], VariantResult]:
        if (cell.name, runners) not in made:
            script = SETUP + (PACKED_RUNNERS if runners == "packed" else UNPACKED_RUNNERS) + CHECK
            where = tmp_path_factory.mktemp(f"kvviews-{cell.name}-{runners}")
            made[cell.name, runners] = run_variants(cell, patched_tree(cell), script, where,
                                                    **extra_env)
        return made[cell.name, runners]

    return results_of


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_patched_kv_buffers_read_like_stock_ones(
        cell: Cell, variant_results: Callable[..., dict[tuple[str, str], VariantResult]],
        backend: str, kv_layout: str) -> None:
    """Per layer, and with the default layout choice (`auto`: one compound page for all
    layers wherever the backend's layout is blocks-first, as all three here are)."""
    result = variant_results(cell, "packed")[backend, kv_layout]
    assert result.passed, result.output[-4000:]


@pytest.mark.cell_needs("vllm-kv-buffers-attn-groups")
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_unpacked_kv_buffers_of_0_10_to_0_23_read_like_stock_ones(
        cell: Cell, variant_results: Callable[..., dict[tuple[str, str], VariantResult]],
        backend: str, kv_layout: str) -> None:
    """The V1 runner through its attention groups, and Model Runner V2 where the cell rewrites
    it (0.22, 0.23). Up to 0.22 the three backends keep K and V in two planes outside the
    blocks (`auto` stays per layer), from 0.23 they are blocks-first."""
    transforms = {t.id for t in select_transforms(proof_registry(), cell)}
    mrv2 = [name for tid, name in MRV2_UNPACKED.items() if tid in transforms]
    result = variant_results(cell, "unpacked", KV_MRV2=",".join(mrv2))[backend, kv_layout]
    assert result.passed, result.output[-4000:]
