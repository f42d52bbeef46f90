"""The [cell.proven] records: which transform set a cell's heavy proofs last passed with.

A cell's heavy proofs (the full wheel build, its L1 suite on the stock and patched trees, its
L2 engine run) are re-run by ``nox -s verify-<cell>``, which writes the record only when all of
them passed. Every CI run compares each supported cell's current patch-set fingerprint with its
record (``stale_records``), so a transform change cannot ship on proofs of older transforms.

The record covers what the fingerprint covers: the cell's transforms and the toolkit version.
A change of the runtime (kvcached_core) does not move any fingerprint; the newest supported cell
of each engine runs its heavy proofs on every CI run for that.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from xml.etree import ElementTree

from forge import TOOLKIT_VERSION
from forge.errors import MatrixError
from forge.fingerprint import patch_set_fingerprint
from forge.matrix import L2_NOT_RUN, L2_PASSED, Cell, Matrix, Proven, load_matrix
from forge.registry import Registry
from forge.transforms import select_transforms

_HEADER = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\s]+?)\s*\]\]?\s*(#.*)?$")


def current_fingerprint(registry: Registry, cell: Cell) -> str:
    """The patch-set fingerprint of the cell's transform set as the checkout has it now."""
    return patch_set_fingerprint(select_transforms(registry, cell), TOOLKIT_VERSION)


def stale_records(matrix: Matrix, registry: Registry) -> list[str]:
    """One line per supported cell with no record, or whose transforms changed since its heavy
    proofs passed."""
    problems = []
    for cell in matrix.cells:
        if cell.status != "supported":
            continue
        if cell.proven is None:
            problems.append(f"cell {cell.name}: supported, but no [cell.proven] records its "
                            f"heavy proofs: run nox -s verify-{cell.name}")
            continue
        now = current_fingerprint(registry, cell)
        if now != cell.proven.fingerprint:
            problems.append(
                f"cell {cell.name}: its transforms changed since its heavy proofs passed "
                f"(recorded {cell.proven.fingerprint[:12]}…, now {now[:12]}…): "
                f"run nox -s verify-{cell.name}")
    return problems


def render_proven(proven: Proven) -> str:
    """The [cell.proven] table as matrix.toml holds it (a trailing newline, no blank line)."""
    return (f"[cell.proven]\n"
            f'fingerprint = "{proven.fingerprint}"\n'
            f"date = {proven.date.isoformat()}\n"
            f"l1_passed = {proven.l1_passed}\n"
            f"l1_stock_passed = {proven.l1_stock_passed}\n"
            f'l2 = "{_toml_escape(proven.l2)}"\n')


def _toml_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def write_proven(path: Path, cell_name: str, proven: Proven) -> None:
    """Set cell ``cell_name``'s [cell.proven] table in the matrix file at ``path``.

    A targeted text edit: an existing record is replaced in place, a new one goes before the
    cell's first [[cell.artifact]]; every other line (comments included) stays as it was. The
    result is validated before it is written.
    """
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    start, end = _cell_block(lines, cell_name, path)
    block = lines[start:end]
    record = render_proven(proven).splitlines(keepends=True)
    headers = [(i, _header_name(line)) for i, line in enumerate(block)]
    headers = [(i, name) for i, name in headers if name is not None]
    existing = next((i for i, name in headers if name == "cell.proven"), None)
    if existing is not None:
        following = next((i for i, _ in headers if i > existing), len(block))
        # Keep the blank lines and comments that precede the next table.
        stop = following
        while stop > existing + 1 and not _is_key_line(block[stop - 1]):
            stop -= 1
        block[existing:stop] = record
    else:
        artifact = next((i for i, name in headers if name == "cell.artifact"), len(block))
        block[artifact:artifact] = [*record, "\n"]
    updated = "".join(lines[:start] + block + lines[end:])
    check = path.with_name(f".{path.name}.proven-check")
    check.write_text(updated, encoding="utf-8")
    try:
        written = load_matrix(check).get_cell(cell_name).proven
    finally:
        check.unlink()
    if written != proven:
        raise MatrixError(f"{path.name}: cell {cell_name}: the written [cell.proven] reads "
                          f"back as {written}, not {proven}")
    path.write_text(updated, encoding="utf-8")


def _header_name(line: str) -> str | None:
    match = _HEADER.match(line)
    return re.sub(r"\s+", "", match.group(1)) if match else None


def _is_key_line(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _cell_block(lines: list[str], cell_name: str, path: Path) -> tuple[int, int]:
    """The line range of the [[cell]] whose engine-series is ``cell_name``."""
    starts = [i for i, line in enumerate(lines) if _header_name(line) == "cell"
              and line.lstrip().startswith("[[")]
    for number, start in enumerate(starts):
        end = starts[number + 1] if number + 1 < len(starts) else len(lines)
        fields = {}
        for line in lines[start + 1:end]:
            if _header_name(line) is not None:
                break
            match = re.match(r'\s*(engine|series)\s*=\s*"([^"]*)"', line)
            if match:
                fields[match.group(1)] = match.group(2)
        if f"{fields.get('engine')}-{fields.get('series')}" == cell_name:
            # A cell's block ends where the next one begins; trailing comments of the file
            # before the next [[cell]] belong to that one.
            while end > start + 1 and not _is_key_line(lines[end - 1]) and end < len(lines):
                end -= 1
            return start, end
    raise MatrixError(f"{path.name}: no [[cell]] {cell_name!r} to record the proofs of")


def proven_from_results(cell: Cell, registry: Registry, results: Path, *,
                        l2_not_run: str | None, today: dt.date) -> Proven:
    """The record of the heavy proofs whose measured counts are in ``results``.

    ``l1-<cell>.json`` is written by the cell's L1 test when it passed; ``l2-<cell>.xml`` is
    the JUnit report of its L2 run (absent where ``l2_not_run`` gives the reason it has none).
    A missing or failed result is a MatrixError: nothing is recorded.
    """
    l1_file = results / f"l1-{cell.name}.json"
    if not l1_file.is_file():
        raise MatrixError(f"cell {cell.name}: no L1 result ({l1_file.name}) in {results}: "
                          "its L1 test did not pass or did not run")
    l1 = json.loads(l1_file.read_text(encoding="utf-8"))
    if l2_not_run is not None:
        if not l2_not_run.strip():
            raise MatrixError(f"cell {cell.name}: give the reason L2 is not run")
        l2 = f"{L2_NOT_RUN}{l2_not_run.strip()}"
    else:
        l2 = _l2_verdict(cell, results / f"l2-{cell.name}.xml")
    return Proven(fingerprint=current_fingerprint(registry, cell), date=today,
                  l1_passed=int(l1["patched_passed"]),
                  l1_stock_passed=int(l1.get("stock_passed") or 0), l2=l2)


def _l2_verdict(cell: Cell, report: Path) -> str:
    """"passed" when the L2 run passed a test and failed none; "not run: <reason>" when it
    skipped every test (the reason pytest gave)."""
    if not report.is_file():
        raise MatrixError(f"cell {cell.name}: no L2 report {report}")
    root = ElementTree.parse(report).getroot()
    cases = list(root.iter("testcase"))
    failed = [c.get("name") for c in cases if c.find("failure") is not None
              or c.find("error") is not None]
    if failed:
        raise MatrixError(f"cell {cell.name}: L2 failed: {', '.join(map(str, failed))}")
    skipped = [c.find("skipped") for c in cases]
    if cases and all(s is not None for s in skipped):
        first = skipped[0]
        assert first is not None
        return f"{L2_NOT_RUN}{first.get('message') or 'every L2 test was skipped'}"
    if not cases:
        raise MatrixError(f"cell {cell.name}: the L2 run collected no test")
    return L2_PASSED
