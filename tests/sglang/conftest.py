"""SGLang L1/L2 environments, built once per selected cell (`--cell`, default every SGLang
cell).

`patched_venv` holds the sglang wheel this checkout builds for the cell plus the kvcached-core
wheel built from this checkout (tests/sglang/envs.py, shared with the soak); `stock_venv` holds
the cell's pinned upstream wheel. Both are layered on the cell's cached base venv
(tests/sglang/_venv.py). Set KVCACHED_CORE_WHEEL to use an already built kvcached-core wheel
instead of building one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.fetch import default_cache_dir, fetch_artifact, resolve_index_url
from forge.matrix import Cell, load_matrix
from tests.proof_cells import parametrize_cells, proof_matrix_path
from tests.sglang import _venv
from tests.sglang.envs import core_wheel_for, patched_venv_for

collect_ignore = ["inside", "shims"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_cells(metafunc, "sglang")


@pytest.fixture(scope="session")
def stock_wheel(cell: Cell) -> Path:
    matrix = load_matrix(proof_matrix_path())
    (artifact,) = cell.wheel_artifacts
    return fetch_artifact(artifact, index_url=resolve_index_url(matrix, None),
                          cache_dir=default_cache_dir())


@pytest.fixture(scope="session")
def core_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return core_wheel_for(tmp_path_factory)


@pytest.fixture(scope="session")
def base_venv(cell: Cell) -> Path:
    return _venv.base_venv(cell)


@pytest.fixture(scope="session")
def patched_venv(tmp_path_factory: pytest.TempPathFactory, cell: Cell) -> _venv.EngineVenv:
    return patched_venv_for(cell, tmp_path_factory)


@pytest.fixture(scope="session")
def stock_venv(tmp_path_factory: pytest.TempPathFactory, base_venv: Path, stock_wheel: Path,
               core_wheel: Path) -> _venv.EngineVenv:
    # kvcached-core is there only so the engine script can look for (absent) pool records.
    return _venv.engine_venv(tmp_path_factory.mktemp("venv") / "stock", base_venv,
                             [stock_wheel, core_wheel])
