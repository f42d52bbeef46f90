"""The cell proofs take their matrix and transforms from a named trial (KVCACHED_PROOF_TRIAL),
the repository's otherwise; a named trial that lacks its files stops the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest

from forge.registry import PATCHES_ROOT, default_registry
from forge.transforms import select_transforms
from forge.trial import PROOF_TRIAL_ENV, write_trial
from tests.proof_cells import (
    REPO_MATRIX,
    ROOT,
    proof_matrix_path,
    proof_registry,
    selected_cells,
)

TRIAL_MATRIX = """schema = 1
index_url = "https://pypi.org/simple"
"""
TRIAL_ENTRY = """[[cell]]
engine = "vllm"
series = "0.24"
version = "0.24.0"
build = 1
python = ">=3.10,<3.15"
torch = "2.9.0"
status = "experimental"
reason = "proposed by an upgrade check"

[[cell.artifact]]
role = "wheel"
filename = "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl"
sha256 = "{sha}"
""".format(sha="2" * 64)


class _Options:
    """What the proof selection reads of pytest's configuration."""

    def __init__(self, **options: object) -> None:
        self.options = {"--cell": [], "--heavy": "newest", **options}

    def getoption(self, name: str) -> object:
        return self.options[name]


def _config(**options: object) -> pytest.Config:
    return cast(pytest.Config, _Options(**options))


@pytest.fixture
def trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A trial of one vLLM cell whose transforms are vllm-0.32's set, named in the env."""
    chosen = default_registry().select("vllm-0.32", "vllm", "0.32", "0.32.0")
    write_trial(tmp_path, matrix_text=TRIAL_MATRIX, entry=TRIAL_ENTRY, cell="vllm-0.24",
                version="0.24.0", transforms=chosen)
    monkeypatch.setenv(PROOF_TRIAL_ENV, str(tmp_path))
    return tmp_path


def test_without_a_trial_the_proofs_use_the_repository_matrix_and_registry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROOF_TRIAL_ENV, raising=False)
    assert proof_matrix_path() == REPO_MATRIX
    assert proof_registry().patches_root == PATCHES_ROOT
    assert "vllm-0.32" in {c.name for c in selected_cells(_config(), "vllm")}


def test_a_named_trial_selects_its_cells_and_its_transforms(trial: Path) -> None:
    assert proof_matrix_path() == trial / "trial-matrix.toml"
    (cell,) = selected_cells(_config(), "vllm")
    assert (cell.name, cell.version) == ("vllm-0.24", "0.24.0")
    registry = proof_registry()
    assert registry.patches_root == trial / "trial-patches"
    expected = [t.id for t in default_registry().select("vllm-0.32", "vllm", "0.32", "0.32.0")]
    assert [t.id for t in select_transforms(registry, cell)] == expected
    # A test of a transform variant the trial did not choose has no cell to run on.
    assert selected_cells(_config(), "vllm", needs_transforms=("vllm-block-pool",)) == [cell]
    assert selected_cells(_config(), "vllm",
                          needs_transforms=("vllm-kv-buffers-attn-groups",)) == []
    assert selected_cells(_config(), "sglang") == []


def test_a_named_trial_without_its_files_stops_the_run_with_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "no-trial"
    empty.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/cells/test_heavy_selection.py", "-q",
         "-p", "no:cacheprovider"],
        cwd=ROOT, env={"PATH": "/usr/bin:/bin", PROOF_TRIAL_ENV: str(empty)},
        capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR
    assert run.stderr.strip() == (f"ERROR: {PROOF_TRIAL_ENV}: proof trial {empty}: no "
                                  "trial-matrix.toml (an upgrade-check trial build writes it)")
    assert "passed" not in run.stdout
