"""L1 for each selected SGLang cell: the patched allocators, pools and radix cache, run in the
patched engine's venv (the cell's `proof.l1_tests`, files of tests/sglang/inside: alloc, free,
free groups, paged extend and decode, evict, match, the prefix-cache bound, refusals). Every
test must pass, and at least `proof.l1_min_passed` of them (the count the cell was proven with).
"""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from forge.matrix import Cell
from forge.transforms import select_transforms
from tests.proof_cells import ROOT, proof_of, proof_registry, record_result
from tests.sglang._venv import EngineVenv
from tests.sglang.envs import INSIDE, engine_env


def test_patched_mem_cache_contract(cell: Cell, patched_venv: EngineVenv,
                                    tmp_path: Path, pytestconfig: pytest.Config) -> None:
    proof = proof_of(cell)
    files = [ROOT / name for name in proof.l1_tests]
    absent = [str(f) for f in files if not f.is_file() or f.parent != INSIDE]
    assert not absent, f"proof.l1_tests must name files of tests/sglang/inside: {absent}"
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [str(patched_venv.python), "-m", "pytest", "-q", "-c", str(INSIDE / "pytest.ini"),
         "--rootdir", str(INSIDE), "--confcutdir", str(INSIDE), f"--junitxml={report}",
         *map(str, files)],
        env=engine_env(tmp_path, elastic=True), capture_output=True, text=True, timeout=600,
        cwd=INSIDE,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    suite = ElementTree.parse(report).getroot().find("testsuite")
    assert suite is not None
    assert int(suite.get("failures", "1")) == 0 and int(suite.get("errors", "1")) == 0
    assert int(suite.get("skipped", "1")) == 0
    passed = int(suite.get("tests", "0"))
    print(f"\n{cell.name}: {passed} L1 tests passed; floor {proof.l1_min_passed}")
    assert passed >= proof.l1_min_passed, (
        f"{cell.name}: {passed} L1 tests passed, below the recorded floor "
        f"proof.l1_min_passed = {proof.l1_min_passed}")
    assert not (tmp_path / "shim-calls.log").exists()
    # SGLang's L1 runs in the patched engine's venv only: there is no stock-tree count.
    record_result(pytestconfig, cell, "l1", patched_passed=passed, stock_passed=None)


def test_switch_off_exports_sglangs_own_classes(cell: Cell, patched_venv: EngineVenv,
                                                tmp_path: Path) -> None:
    transforms = select_transforms(proof_registry(), cell)
    # The pool-building module: the KV-cache configurator from 0.5.16, the model runner's KV
    # mixin from 0.5.7, the model runner itself before.
    probe = (
        "import importlib, importlib.util\n"
        "c = importlib.import_module(next(n for n in (\n"
        "    'sglang.srt.mem_cache.kv_cache_configurator',\n"
        "    'sglang.srt.model_executor.model_runner_kv_cache_mixin',\n"
        "    'sglang.srt.model_executor.model_runner')\n"
        "    if importlib.util.find_spec(n) is not None))\n"
        "from sglang.srt.mem_cache import allocator as a, memory_pool as m\n"
        "from sglang._kvcached_build import describe\n"
        "names = [a.TokenToKVPoolAllocator, a.PagedTokenToKVPoolAllocator,\n"
        "         m.MHATokenToKVPool, m.MLATokenToKVPool, c.TokenToKVPoolAllocator]\n"
        "print([n.__name__ for n in names], len(describe()['transforms']))\n"
    )
    run = subprocess.run([str(patched_venv.python), "-c", probe],
                         env=engine_env(tmp_path, elastic=False), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip().splitlines()[-1] == (
        "['TokenToKVPoolAllocator', 'PagedTokenToKVPoolAllocator', 'MHATokenToKVPool', "
        f"'MLATokenToKVPool', 'TokenToKVPoolAllocator'] {len(transforms)}"
    )
