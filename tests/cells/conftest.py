"""Per-cell proof (L0, docs/testing.md): every matrix cell builds strictly from its pinned
upstream artifacts, matches its reviewed diff, and yields wheels that install and say which
build they are.

`pytest tests/cells` builds every cell into a temporary dist; `--cell NAME` narrows it and
`--dist DIR` proves wheels an earlier `nox -s build-<cell>` already made.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.build import BuildResult, build_cell
from forge.fetch import default_cache_dir
from forge.matrix import Cell, load_matrix

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "matrix.toml"


def _selected_cells(config: pytest.Config) -> list[Cell]:
    matrix = load_matrix(MATRIX)
    wanted = config.getoption("--cell")
    return [matrix.get_cell(name) for name in wanted] if wanted else list(matrix.cells)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" in metafunc.fixturenames:
        cells = _selected_cells(metafunc.config)
        metafunc.parametrize("cell", cells, ids=[c.name for c in cells], scope="session")


@pytest.fixture(scope="session")
def built(cell: Cell, tmp_path_factory: pytest.TempPathFactory,
          request: pytest.FixtureRequest) -> BuildResult | Path:
    """The cell's built wheels: a fresh build, or the --dist folder of an earlier one."""
    given = request.config.getoption("--dist")
    if given:
        return Path(given)
    dist = tmp_path_factory.mktemp(f"dist-{cell.name}")
    return build_cell(cell.name, matrix_path=MATRIX, dist_dir=dist, cache_dir=default_cache_dir())


@pytest.fixture(scope="session")
def wheel_dir(built: BuildResult | Path) -> Path:
    return built if isinstance(built, Path) else built.out_dir
