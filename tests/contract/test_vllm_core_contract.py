"""L1: vLLM's own tests/v1/core tests, from the pinned sdist, on the patched tree (elastic on).

For each cell the stock and the patched tree run in the same test, in the cell's contract venv,
offline. Every test that fails on the patched tree must also fail on the stock tree; those are
listed with their reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.contract.fake_hf import build_fake_hf_home
from tests.contract.vllm_contract import (
    ROOT,
    contract_cell,
    contract_venv,
    tree_workspace,
    unpacked_sdist,
)

pytestmark = pytest.mark.slow

CORE_TESTS = {
    "vllm-0.9": ["test_prefix_caching.py", "test_specialized_manager.py",
                 "test_kv_cache_utils.py", "test_scheduler.py"],
    "vllm-0.25": ["test_prefix_caching.py", "test_single_type_kv_cache_manager.py",
                  "test_kv_cache_utils.py", "test_scheduler.py"],
    "vllm-0.32": ["test_prefix_caching.py", "test_single_type_kv_cache_manager.py",
                  "test_kv_cache_utils.py", "test_scheduler.py"],
}


def _outcomes(junit: Path) -> dict[str, str]:
    """test id -> "passed" or the first line of its failure."""
    results: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if case.find("skipped") is not None:
            results[name] = "skipped"
        elif problem is None:
            results[name] = "passed"
        else:
            results[name] = (problem.get("message") or "failed").splitlines()[0][:160]
    return results


def _run_core_tests(python: Path, tree: Path, files: list[str], hf_home: Path,
                    junit: Path) -> dict[str, str]:
    imports = tree.parent / f"{tree.name}-imports"
    imports.mkdir(exist_ok=True)
    link = imports / "kvcached_core"
    if not link.exists():
        link.symlink_to(ROOT / "kvcached_core")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "VLLM_"))}
    env.update({
        "PYTHONPATH": f"{tree}{os.pathsep}{imports}",
        "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "KVCACHED_ENABLE": "1", "VLLM_TARGET_DEVICE": "cpu",
    })
    subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
         f"--junitxml={junit}", "-o", "addopts=", *[f"tests/v1/core/{f}" for f in files]],
        cwd=tree, env=env, check=False, capture_output=True, timeout=1200,
    )
    assert junit.exists(), f"pytest wrote no report for {tree}"
    return _outcomes(junit)


@pytest.mark.parametrize("cell_name", ["vllm-0.9", "vllm-0.25", "vllm-0.32"])
def test_core_tests_pass_on_the_patched_tree(cell_name: str, tmp_path: Path) -> None:
    cell = contract_cell(cell_name)
    python = contract_venv(cell)
    sdist = unpacked_sdist(cell, tmp_path / "sdist")
    hf_home = build_fake_hf_home(tmp_path / "hf")
    results: dict[str, dict[str, str]] = {}
    for flavour in ("stock", "patched"):
        tree = tmp_path / flavour
        shutil.copytree(sdist, tree)
        tree_workspace(tree, patched=flavour == "patched", cell=cell)
        results[flavour] = _run_core_tests(python, tree, CORE_TESTS[cell_name], hf_home,
                                           tmp_path / f"{flavour}.xml")

    patched_source = (tmp_path / "patched" / "vllm" / "v1" / "core" /
                      "kv_cache_coordinator.py").read_text(encoding="utf-8")
    assert "_kvcached_vllm.make_block_pool(" in patched_source

    stock, patched = results["stock"], results["patched"]
    assert set(stock) == set(patched), "both trees must collect the same tests"
    failed_patched = {t for t, r in patched.items() if r not in ("passed", "skipped")}
    failed_stock = {t for t, r in stock.items() if r not in ("passed", "skipped")}
    passed = sum(r == "passed" for r in patched.values())
    print(f"\n{cell_name}: patched tree {passed}/{len(patched)} passed; "
          f"stock tree {sum(r == 'passed' for r in stock.values())}/{len(stock)}")
    for test in sorted(failed_patched):
        print(f"  fails on both trees: {test}: {stock[test]}")
    assert passed > 0
    new_failures = {t: patched[t] for t in failed_patched - failed_stock}
    assert not new_failures, f"fail only on the patched tree: {new_failures}"
