"""vLLM 0.24 - 0.28 KV buffers on the patched tree: vLLM's own allocation and view code, real
attention backends, elastic against stock, bytes compared (contract venv, host backend).

Model Runner V2's `_allocate_kv_cache` / `_reshape_kv_cache` and the V1 runner's
`_allocate_kv_cache_tensors` run as the patched wheel runs them; with KVCACHED_ENABLE=0 they
must give what stock gives, and elastic their views must have the same shapes and strides, and
the blocks of a mapped page must hold the same bytes as a stock buffer after the same writes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from forge.matrix import Cell
from tests.contract.vllm_contract import ROOT, contract_venv, tree_workspace, unpacked_sdist

pytestmark = pytest.mark.slow

# Runs for the selected cells whose transform set holds both rewrites the script exercises.
CELL_NEEDS_TRANSFORMS = ("vllm-kv-buffers-tensors", "vllm-kv-buffers-mrv2")

SCRIPT = r"""
import os
from types import SimpleNamespace

import torch

from kvcached_core.integration.vllm import pools
from kvcached_core.integration.vllm.config import pool_name
from vllm.v1.attention.backends.{backend_module} import {backend_class} as Backend
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        KVCacheTensor)
from vllm.v1.worker.gpu import attn_utils
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import AttentionGroup

PAGE = int(os.environ["KVCACHED_PAGE_SIZE"])
PER_LAYER = os.environ["KVCACHED_LAYOUT"] == "per-layer"
names = [f"model.layers.{{i}}.self_attn.attn" for i in range(3)]
spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
blocks = 32
config = KVCacheConfig(
    num_blocks=blocks,
    kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * blocks, shared_by=[n])
                      for n in names],
    kv_cache_groups=[KVCacheGroupSpec(names, spec)],
)
group = AttentionGroup(Backend, names, spec, 0)
block_dim = Backend.get_kv_cache_shape(1234567, 16, 2, 64).index(1234567)
runner = SimpleNamespace(device=torch.device("cpu"), attn_groups=[[group]],
                         runner_only_attn_layers=set())


def allocate(which):
    if which == "mrv2":
        return attn_utils._allocate_kv_cache(config, {{}}, torch.device("cpu"),
                                             attn_groups=[[group]])
    return GPUModelRunner._allocate_kv_cache_tensors(runner, config)


def views(raw):
    return attn_utils._reshape_kv_cache([group], raw, "auto", [16], {{}}, config)


for which in ("mrv2", "v1"):
    os.environ["KVCACHED_ENABLE"] = "0"
    stock_raw = allocate(which)
    assert pools.lookup(pool_name()) is None, "switched off, no pool may be made"
    os.environ["KVCACHED_ENABLE"] = "1"
    ours_raw = allocate(which)
    engine_pool = pools.lookup(pool_name())
    assert engine_pool is not None
    stock, ours = views(stock_raw), views(ours_raw)
    k = engine_pool.blocks_per_page
    assert k == PAGE // spec.page_size_bytes, k
    [page] = engine_pool.pool.alloc(1)
    for n in names:
        assert ours[n].shape == stock[n].shape, n
        if PER_LAYER:  # the stock bytes exactly; contiguous interleaves the layers of a page
            assert ours[n].stride() == stock[n].stride(), n
            assert ours_raw[n].numel() == stock_raw[n].numel()
        for b in range(page * k, (page + 1) * k):
            data = torch.randn(ours[n].select(block_dim, b).shape).to(torch.bfloat16)
            ours[n].select(block_dim, b).copy_(data)
            stock[n].select(block_dim, b).copy_(data)
            if PER_LAYER:
                offset = ours[n].select(block_dim, b).data_ptr() - ours_raw[n].data_ptr()
                assert offset // PAGE == page, (n, b, offset)
        for b in range(blocks):  # what the kernels read: every block, as stock has it
            assert torch.equal(ours[n].select(block_dim, b), stock[n].select(block_dim, b)), (n, b)
        if PER_LAYER:
            assert torch.equal(ours_raw[n], stock_raw[n]), n
    if PER_LAYER:
        for ftensor in engine_pool.pool.tensors:
            assert sorted(ftensor.mapped_offsets()) == [0, page * PAGE]
    else:
        # One compound tensor: each logical page (the null block's, `page`) is one mapping
        # that holds the page's blocks of every layer.
        [ftensor] = engine_pool.pool.tensors
        assert len(ftensor.mapped_offsets()) == 2, ftensor.mapped_offsets()
    pools.close(pool_name())
print("OK")
"""

# name -> (module, class, VLLM_KV_CACHE_LAYOUT): FlashAttention is what the H200 runs.
BACKENDS = {
    "cpu-attn": ("cpu_attn", "CPUAttentionBackend", ""),
    "flash-attn-NHD": ("flash_attn", "FlashAttentionBackend", "NHD"),
    "flash-attn-HND": ("flash_attn", "FlashAttentionBackend", "HND"),
}


@pytest.mark.parametrize("kv_layout", ["per-layer", "auto"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_patched_kv_buffers_read_like_stock_ones(cell: Cell, backend: str, kv_layout: str,
                                                 tmp_path: Path) -> None:
    """Per layer, and with the default layout choice (`auto`: one compound page for all
    layers wherever the backend's layout is blocks-first, as all three here are)."""
    python = contract_venv(cell)
    tree = tmp_path / "patched"
    shutil.copytree(unpacked_sdist(cell, tmp_path / "sdist"), tree)
    tree_workspace(tree, patched=True, cell=cell)
    imports = tmp_path / "imports"
    imports.mkdir()
    (imports / "kvcached_core").symlink_to(ROOT / "kvcached_core")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "VLLM_"))}
    env.update({
        "PYTHONPATH": f"{tree}{os.pathsep}{imports}", "VLLM_TARGET_DEVICE": "cpu",
        "KVCACHED_PAGE_SIZE": str(32 << 10), "KVCACHED_MIN_RESERVED_PAGES": "0",
        "KVCACHED_MAX_RESERVED_PAGES": "0", "KVCACHED_PREALLOC": "0",
        "KVCACHED_LAYOUT": kv_layout,
        "KVCACHED_POOL_NAME": f"kvviews-{os.getpid()}", "KVCACHED_SHM_DIR": str(tmp_path),
    })
    module, cls, layout = BACKENDS[backend]
    if layout:
        env["VLLM_KV_CACHE_LAYOUT"] = layout
    done = subprocess.run(
        [str(python), "-c", SCRIPT.format(backend_module=module, backend_class=cls)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-4000:]
