"""Per-cell proof (L0, docs/testing.md): every matrix cell's transforms apply to its pinned
sources and change exactly its reviewed diff (test_cell_sources.py, cheap, every selected cell);
the full build re-packs wheels that install and say which build they are (test_cell_build.py,
heavy: the cells `--heavy` picks).

`pytest tests/cells` proves every cell; `--cell NAME` narrows it and `--built-dist DIR` proves
wheels an earlier `nox -s build-<cell>` already made.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.build import BuildResult, build_cell
from forge.fetch import default_cache_dir
from forge.matrix import Cell, load_matrix
from tests.proof_cells import heavy_cells, proof_matrix_path, proof_registry


def selected_cells(config: pytest.Config) -> list[Cell]:
    matrix = load_matrix(proof_matrix_path())
    wanted = config.getoption("--cell")
    return [matrix.get_cell(name) for name in wanted] if wanted else list(matrix.cells)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" in metafunc.fixturenames:
        cells = selected_cells(metafunc.config)
        # A module whose proof takes seconds per cell runs for every selected cell.
        if not getattr(metafunc.module, "CHEAP_PROOF", False):
            cells = heavy_cells(metafunc.config, cells)
        metafunc.parametrize("cell", cells, ids=[c.name for c in cells], scope="session")


@pytest.fixture(scope="session")
def built(cell: Cell, tmp_path_factory: pytest.TempPathFactory,
          request: pytest.FixtureRequest) -> BuildResult | Path:
    """The cell's built wheels: a fresh build, or the --built-dist folder of an earlier one."""
    given = request.config.getoption("--built-dist")
    if given:
        return Path(given)
    dist = tmp_path_factory.mktemp(f"dist-{cell.name}")
    return build_cell(cell.name, matrix_path=proof_matrix_path(), dist_dir=dist,
                      cache_dir=default_cache_dir(), registry=proof_registry())


@pytest.fixture(scope="session")
def wheel_dir(built: BuildResult | Path) -> Path:
    return built if isinstance(built, Path) else built.out_dir
