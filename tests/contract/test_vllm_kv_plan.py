"""The kv-budget seam on the release's own EngineCore (patched sdist tree): vLLM 0.32+, which
plan a worker through the release's planner, and 0.9 - 0.28, which scale its tensors.

The patched `EngineCore._initialize_kv_caches` runs on a stand-in core whose executor reports a
16-layer model's KV specs and layouts, and stops at `initialize_from_config`, where it keeps
the configs the workers would get. For a `kv_cache_memory_bytes` below one kvcached page of
blocks, the elastic engine must plan what stock vLLM plans (the release's own sizing, with
`KVCACHED_ENABLE=0` as the anchor): the same scheduler blocks, the same refusal when the longest
sequence does not fit. Its workers must get the release's own plan for the next whole-page block
count: every layer region whole pages, the layout and every other field the release set kept.
Releases before 0.29 have no layouts to choose from: each layer gets a tensor of its own.

Each CI run proves the variant of the canary cell (the builder's, vLLM 0.33 - 0.34); the other
variants (about a minute each) run in each of their cells' verify-<cell> records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge.matrix import Cell
from tests.contract.fake_hf import build_fake_hf_home
from tests.contract.vllm_contract import (
    contract_venv,
    run_on_patched_tree,
    tree_workspace,
    unpacked_sdist,
)

pytestmark = pytest.mark.slow

PAGE = 2 << 20  # the default KVCACHED_PAGE_SIZE
BLOCK = 16 * 2 * 32 * 2 * 2  # 16 tokens, 2 KV heads of 32, K and V, bf16: 4 KiB a layer

SCRIPT = """
import json, os, sys
os.environ["HF_HOME"] = {hf_home!r}
os.environ["KVCACHED_ENABLE"] = {enable!r}
sys.path.insert(0, {contract_dir!r})
import l1_cpu_platform  # vLLM 0.34's VllmConfig asks for triton-cpu; nothing here runs a kernel
l1_cpu_platform.pytest_configure(None)
import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec
import vllm.v1.engine.core as release

import dataclasses
# vLLM 0.10's spec still says whether it is MLA; later releases dropped the field.
fields = {{f.name for f in dataclasses.fields(FullAttentionSpec)}}
mla = {{"use_mla": False}} if "use_mla" in fields else {{}}
specs = {{f"model.layers.{{i}}.self_attn.attn": FullAttentionSpec(
    block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, **mla)
    for i in range(16)}}


class Planned(Exception):
    pass


class Executor:
    def __init__(self, layout, budget):
        self.layout, self.budget, self.configs, self.scheduler_config = layout, budget, None, None

    def get_kv_cache_specs(self):
        return [specs]

    def get_supported_kv_cache_layouts(self):
        return [[self.layout]]

    def determine_available_memory(self):
        return [self.budget]

    def initialize_from_config(self, configs):
        # The scheduler's config is built just before (every release names it so); before
        # 0.20 the release returns its block count to __init__ rather than setting it.
        self.configs = configs
        self.scheduler_config = sys._getframe(1).f_locals["scheduler_kv_cache_config"]
        raise Planned()

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class Core:
    def collective_rpc(self, *args, **kwargs):  # an auto-fitted max_model_len goes nowhere
        return None


def plan(layout, budget, max_model_len):
    core = Core()
    core.model_executor = Executor(layout, budget)
    # vLLM 0.9 has no user budget: there the executor's profiled figure is the budget.
    user = ({{"kv_cache_memory_bytes": budget}}
            if "kv_cache_memory_bytes" in {{f.name for f in dataclasses.fields(CacheConfig)}}
            else {{}})
    vllm_config = VllmConfig(model_config=ModelConfig(max_model_len=max_model_len),
                             cache_config=CacheConfig(**user))
    try:
        release.EngineCore._initialize_kv_caches(core, vllm_config)
    except Planned:
        pass
    except ValueError as error:
        return {{"refused": str(error)}}
    [config] = core.model_executor.configs
    return {{
        "scheduler_blocks": core.model_executor.scheduler_config.num_blocks,
        "max_model_len": vllm_config.model_config.max_model_len,
        "worker_blocks": config.num_blocks,
        "layout": getattr(config, "kv_cache_layout", None),  # 0.32+
        # Before 0.29 a tensor names its layers `shared_by` and has no layer stride.
        "tensors": [[t.size, len(getattr(t, "layers", None) or t.shared_by),
                     getattr(t, "layer_stride", None), getattr(t, "block_stride", 0),
                     getattr(t, "offset", 0)]
                    for t in config.kv_cache_tensors],
    }}


print(json.dumps({{name: plan(*case) for name, case in {cases!r}.items()}}))
"""

BUDGET = 2 << 20  # 32 blocks of 16 layers: stock vLLM plans 32; one page holds 512
SMALL = 1 << 20  # 16 blocks: 256 tokens, too few for a 1,024-token sequence
CASES = {
    "layers-first": ("LBHNC", BUDGET, 256),
    "blocks-first": ("BLHNC", BUDGET, 256),
    "too-small": ("LBHNC", SMALL, 1024),
}


# vLLM 0.9 - 0.28: no layout to choose (the executor's answer is never asked for).
SCALED_CASES = {
    "per-layer": (None, BUDGET, 256),
    "too-small": (None, SMALL, 1024),
}


def plans(cell: Cell, tree: Path, where: Path, *, enable: str,
          cases: dict[str, tuple[str | None, int, int]] = CASES
          ) -> dict[str, dict[str, object]]:
    """The plans of `cases` on the patched release, elastic (`enable` "1") or stock ("0")."""
    where.mkdir()
    script = SCRIPT.format(hf_home=str(build_fake_hf_home(where / "hf")), enable=enable,
                           contract_dir=str(Path(__file__).resolve().parent), cases=cases)
    done = run_on_patched_tree(contract_venv(cell), tree, script, where)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def check_plan(cell: Cell, tmp_path: Path) -> None:
    tree = unpacked_sdist(cell, tmp_path)
    tree_workspace(tree, patched=True, cell=cell)
    stock = plans(cell, tree, tmp_path / "stock", enable="0")
    elastic = plans(cell, tree, tmp_path / "elastic", enable="1")
    # Layers first: the scheduler plans as stock; the workers get the next whole-page count.
    stock_lb, elastic_lb = stock["layers-first"], elastic["layers-first"]
    assert stock_lb["scheduler_blocks"] == stock_lb["worker_blocks"] == BUDGET // (16 * BLOCK)
    assert elastic_lb["scheduler_blocks"] == stock_lb["scheduler_blocks"], (stock, elastic)
    assert elastic_lb["max_model_len"] == stock_lb["max_model_len"]
    assert elastic_lb["layout"] == stock_lb["layout"]
    assert elastic_lb["worker_blocks"] == PAGE // BLOCK, elastic_lb
    tensors: list[list[int]] = elastic_lb["tensors"]  # type: ignore[assignment]
    for size, layers, layer_stride, block_stride, offset in tensors:
        assert layer_stride == PAGE // BLOCK * block_stride  # a layer's region, whole pages
        assert offset % PAGE == 0 and offset + layers * layer_stride <= size
    # Blocks first: the one region is padded by the pool itself; the plan stays vLLM's.
    assert elastic["blocks-first"] == stock["blocks-first"], (stock, elastic)
    # A budget the longest sequence does not fit: the same refusal, in the release's words.
    assert "refused" in stock["too-small"], stock
    assert elastic["too-small"] == stock["too-small"]


@pytest.mark.cell_needs("vllm-kv-budget-planned")
@pytest.mark.verify_only
def test_the_scheduler_plans_as_stock_and_the_workers_get_whole_pages(
        cell: Cell, tmp_path: Path) -> None:
    check_plan(cell, tmp_path)


@pytest.mark.cell_needs("vllm-kv-budget-planned-builder")
def test_the_builder_plans_as_stock_and_the_workers_get_whole_pages(
        cell: Cell, tmp_path: Path) -> None:
    check_plan(cell, tmp_path)


@pytest.mark.cell_needs("vllm-kv-budget-planned-scaled")
@pytest.mark.verify_only
def test_the_scheduler_keeps_stock_blocks_and_the_workers_tensors_scale_to_whole_pages(
        cell: Cell, tmp_path: Path) -> None:
    check_scaled_plan(cell, tmp_path)


@pytest.mark.cell_needs("vllm-kv-budget-planned-unified")
@pytest.mark.verify_only
def test_unified_ranks_keep_stock_blocks_and_the_workers_tensors_scale_to_whole_pages(
        cell: Cell, tmp_path: Path) -> None:
    check_scaled_plan(cell, tmp_path)


def check_scaled_plan(cell: Cell, tmp_path: Path) -> None:
    tree = unpacked_sdist(cell, tmp_path)
    tree_workspace(tree, patched=True, cell=cell)
    stock = plans(cell, tree, tmp_path / "stock", enable="0", cases=SCALED_CASES)
    elastic = plans(cell, tree, tmp_path / "elastic", enable="1", cases=SCALED_CASES)
    stock_pl, elastic_pl = stock["per-layer"], elastic["per-layer"]
    assert stock_pl["scheduler_blocks"] == stock_pl["worker_blocks"] == BUDGET // (16 * BLOCK)
    assert elastic_pl["scheduler_blocks"] == stock_pl["scheduler_blocks"], (stock, elastic)
    assert elastic_pl["max_model_len"] == stock_pl["max_model_len"]
    # A layer's tensor holds its K and V planes (or K and V in each block, as the backend
    # chooses): whole pages under either takes 2 pages of 4 KiB blocks, 1,024 blocks.
    worker_blocks = elastic_pl["worker_blocks"]
    assert worker_blocks == 2 * PAGE // BLOCK, elastic_pl
    tensors: list[list[int]] = elastic_pl["tensors"]  # type: ignore[assignment]
    assert len(tensors) == 16, tensors
    for size, layers, _, block_stride, offset in tensors:
        assert layers == 1 and block_stride == 0 and offset == 0
        assert size == worker_blocks * BLOCK and size % (2 * PAGE) == 0
    # A budget the longest sequence does not fit: the same refusal, in the release's words.
    assert "refused" in stock["too-small"], stock
    assert elastic["too-small"] == stock["too-small"]
