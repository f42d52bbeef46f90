"""The contract venv is shared by cells with the same pins, and the vLLM version each tree
reports comes from the stub beside that tree (no engine or venv needed)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from forge.matrix import load_matrix
from tests.contract.vllm_contract import venv_pins_key, write_version_stub
from tests.proof_cells import REPO_MATRIX as MATRIX  # facts of the repository's own cells


def test_cells_that_differ_only_in_their_release_share_one_venv() -> None:
    matrix = load_matrix(MATRIX)
    newer, older = matrix.get_cell("vllm-0.32"), matrix.get_cell("vllm-0.25")
    assert newer.version != older.version
    assert dict(newer.test_pins) == dict(older.test_pins)
    assert venv_pins_key(newer) == venv_pins_key(older)


def test_cells_with_other_test_pins_get_their_own_venv() -> None:
    matrix = load_matrix(MATRIX)
    cell = matrix.get_cell("vllm-0.9")
    assert dict(cell.test_pins) != dict(matrix.get_cell("vllm-0.32").test_pins)
    assert venv_pins_key(cell) != venv_pins_key(matrix.get_cell("vllm-0.32"))


def test_the_tree_on_the_path_reports_its_own_cpu_version(tmp_path: Path) -> None:
    cell = load_matrix(MATRIX).get_cell("vllm-0.32")
    write_version_stub(cell, tmp_path)
    write_version_stub(cell, tmp_path)  # a second write (a reused tree) is harmless
    probe = "import importlib.metadata as m; print(m.version('vllm'))"
    done = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"{cell.version}+cpu"
    found = importlib.metadata.distributions(path=[str(tmp_path)])
    assert [d.version for d in found] == [f"{cell.version}+cpu"]
