"""Which matrix cells a proof suite runs for: `--cell NAME` (repeatable), every cell by default.

The contract suites (tests/contract, tests/sglang) read each cell's proof facts from
matrix.toml's [cell.proof] table; nothing about a particular release is written in a test file.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from forge.matrix import Cell, Proof, load_matrix
from forge.registry import default_registry
from forge.transforms import select_transforms

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "matrix.toml"


def selected_cells(config: pytest.Config, engine: str,
                   needs_transforms: Iterable[str] = ()) -> list[Cell]:
    """The cells of `engine` that `--cell` selects (all when none is given).

    `needs_transforms` narrows them to cells whose transform set holds every one of those
    transform ids (a test of one transform variant runs where that variant applies).
    An unknown cell name is an error that lists the known ones.
    """
    matrix = load_matrix(MATRIX)
    wanted = config.getoption("--cell")
    cells = [matrix.get_cell(name) for name in wanted] if wanted else list(matrix.cells)
    cells = [cell for cell in cells if cell.engine == engine]
    needed = set(needs_transforms)
    if needed:
        registry = default_registry()
        cells = [cell for cell in cells
                 if needed <= {t.id for t in select_transforms(registry, cell)}]
    return cells


def parametrize_cells(metafunc: pytest.Metafunc, engine: str) -> None:
    """Give a test's `cell` argument one value per selected cell of `engine`.

    A test module narrows the cells by naming the transforms it exercises in
    `CELL_NEEDS_TRANSFORMS`; a test marked `pytest.mark.cell_needs(*ids)` names its own
    instead (one module may prove several variants of a seam).
    """
    if "cell" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("cell_needs")
    needs = marker.args if marker else getattr(metafunc.module, "CELL_NEEDS_TRANSFORMS", ())
    cells = selected_cells(metafunc.config, engine, needs)
    metafunc.parametrize("cell", cells, ids=[c.name for c in cells], scope="session")


def proof_of(cell: Cell) -> Proof:
    """The cell's [cell.proof] table; a cell asked to be proven without one fails."""
    if cell.proof is None:
        pytest.fail(f"{cell.name}: matrix.toml has no [cell.proof] table for this cell",
                    pytrace=False)
    return cell.proof
