"""L1: vLLM's own tests/v1/core tests, from the pinned sdist, on the patched tree (elastic on).

For each selected cell (`--cell`, default every vLLM cell) the stock and the patched tree run
the cell's `proof.l1_tests` in the same test, in the cell's contract venv, offline. Every test
that passes on the stock tree must pass on the patched tree, and the patched tree must pass at
least `proof.l1_min_passed` tests (the count measured when the cell was proven), so a suite
that shrinks fails. Tests failing on both trees are printed with their reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from forge.matrix import Cell
from tests.contract.fake_hf import build_fake_hf_home
from tests.contract.vllm_contract import (
    ROOT,
    contract_venv,
    l1_verdict,
    tree_workspace,
    unpacked_sdist,
)
from tests.proof_cells import proof_of, record_result

pytestmark = pytest.mark.slow


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


def _run_core_tests(python: Path, tree: Path, files: tuple[str, ...], hf_home: Path,
                    junit: Path) -> dict[str, str]:
    absent = [f for f in files if not (tree / f).is_file()]
    assert not absent, f"proof.l1_tests names files the sdist does not have: {absent}"
    imports = tree.parent / f"{tree.name}-imports"
    imports.mkdir(exist_ok=True)
    link = imports / "kvcached_core"
    if not link.exists():
        link.symlink_to(ROOT / "kvcached_core")
    # vLLM 0.34's CPU platform asks for triton-cpu, which no test here uses (the plugin says why).
    plugin = imports / "kvcached_l1_cpu_platform.py"
    if not plugin.exists():
        plugin.symlink_to(Path(__file__).resolve().parent / "l1_cpu_platform.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "VLLM_"))}
    env.update({
        "PYTHONPATH": f"{tree}{os.pathsep}{imports}",
        "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "KVCACHED_ENABLE": "1", "VLLM_TARGET_DEVICE": "cpu",
        # vLLM's scheduler tests build schedulers with no KV buffers: declare that, or an
        # elastic scheduler without VMM-backed KV refuses to start.
        "KVCACHED_SCHEDULER_ONLY": "1",
    })
    subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "kvcached_l1_cpu_platform", "--noconftest",
         f"--junitxml={junit}", "-o", "addopts=", *files],
        cwd=tree, env=env, check=False, capture_output=True, timeout=1200,
    )
    assert junit.exists(), f"pytest wrote no report for {tree}"
    return _outcomes(junit)


def test_core_tests_pass_on_the_patched_tree(cell: Cell, tmp_path: Path,
                                             pytestconfig: pytest.Config) -> None:
    proof = proof_of(cell)
    python = contract_venv(cell)
    sdist = unpacked_sdist(cell, tmp_path / "sdist")
    hf_home = build_fake_hf_home(tmp_path / "hf")
    results: dict[str, dict[str, str]] = {}
    for flavour in ("stock", "patched"):
        tree = tmp_path / flavour
        shutil.copytree(sdist, tree)
        tree_workspace(tree, patched=flavour == "patched", cell=cell)
        results[flavour] = _run_core_tests(python, tree, proof.l1_tests, hf_home,
                                           tmp_path / f"{flavour}.xml")

    patched_source = (tmp_path / "patched" / "vllm" / "v1" / "core" /
                      "kv_cache_coordinator.py").read_text(encoding="utf-8")
    assert "_kvcached_vllm.make_block_pool(" in patched_source

    stock, patched = results["stock"], results["patched"]
    passed = sum(r == "passed" for r in patched.values())
    stock_passed = sum(r == "passed" for r in stock.values())
    print(f"\n{cell.name}: patched tree {passed}/{len(patched)} passed; "
          f"stock tree {stock_passed}/{len(stock)}; floor {proof.l1_min_passed}")
    for test in sorted(t for t, r in patched.items() if r not in ("passed", "skipped")):
        print(f"  fails on the patched tree: {test}: {patched[test]} "
              f"(stock: {stock.get(test)})")
    problems = l1_verdict(cell.name, stock, patched, proof.l1_min_passed)
    assert not problems, "\n".join(problems)
    record_result(pytestconfig, cell, "l1", patched_passed=passed, stock_passed=stock_passed,
                  collected=len(patched))
