"""upgrade-scan: the releases on the index that no cell covers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from packaging.version import Version

from forge.fetch import project_files
from forge.matrix import Matrix
from forge.upgrade.release import final_versions

# --- upgrade-scan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanLine:
    engine: str
    newest_cell: str
    newest_cell_version: str
    newer: tuple[str, ...]               # every final release newer than the newest cell
    # One release per series that needs a check (the series' newest release) -> why: newer
    # than the newest cell, inside the span with no cell, or a newer release of a cell's
    # series. The skipped series are not in it.
    why: Mapping[str, str] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)   # series -> reason

    @property
    def unchecked(self) -> tuple[str, ...]:
        """The releases that need a check, oldest series first."""
        return tuple(self.why)

    def to_json(self) -> dict[str, object]:
        return {"engine": self.engine, "newest_cell": self.newest_cell,
                "newest_cell_version": self.newest_cell_version, "newer": list(self.newer),
                "unchecked": list(self.unchecked), "why": dict(self.why),
                "skipped": dict(self.skipped)}


def scan(matrix: Matrix, index_url: str) -> list[ScanLine]:
    """Per engine of the matrix: the final releases on the index newer than its newest cell,
    and every release that needs a check: from the series of its oldest cell on, the newest
    release of each series that is neither its cell's release nor skipped
    ([engine.<name>] skipped in the matrix)."""
    lines: list[ScanLine] = []
    for engine in sorted({c.engine for c in matrix.cells}):
        cells = [c for c in matrix.cells if c.engine == engine]
        newest = max(cells, key=lambda c: Version(c.version))
        oldest = min(cells, key=lambda c: Version(c.version))
        versions = final_versions(project_files(index_url, engine), engine)
        newer = tuple(str(v) for v in versions if v > Version(newest.version))
        by_series: dict[str, list[Version]] = {}
        for version in versions:
            if version >= Version(oldest.version) or \
                    matrix.series_for(engine, str(version)) == oldest.series:
                by_series.setdefault(matrix.series_for(engine, str(version)), []).append(version)
        series_cells = {c.series: c for c in cells}
        skipped = dict(matrix.skipped.get(engine, {}))
        why: dict[str, str] = {}
        for series, releases in sorted(by_series.items(), key=lambda item: max(item[1])):
            latest = max(releases)
            cell = series_cells.get(series)
            if cell is not None:
                if latest > Version(cell.version):
                    why[str(latest)] = (f"a newer release of cell {cell.name}'s series (the "
                                        f"cell pins {cell.version})")
            elif series in skipped:
                continue
            elif latest > Version(newest.version):
                why[str(latest)] = f"newer than the newest cell {newest.name}"
            else:
                why[str(latest)] = (f"series {series} is inside the span {oldest.version} - "
                                    f"{newest.version} and has no cell")
        lines.append(ScanLine(engine, newest.name, newest.version, newer, why,
                              skipped))
    return lines
