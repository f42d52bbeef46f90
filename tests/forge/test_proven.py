"""[cell.proven]: a supported cell records the transform set its heavy proofs last passed with;
a changed transform set fails until `nox -s verify-<cell>` re-proves and records it."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from pathlib import Path

import pytest
from _fixtures import CELL, fakeeng_project, make_registry

from forge.cli import main
from forge.errors import MatrixError
from forge.matrix import Proven, load_matrix
from forge.proven import (
    current_fingerprint,
    proven_from_results,
    render_proven,
    stale_records,
    write_proven,
)
from forge.registry import default_registry

REPO_MATRIX = Path(__file__).resolve().parents[2] / "matrix.toml"
SHA = "ab" * 32
RECORD = Proven(fingerprint="cd" * 32, date=dt.date(2026, 12, 1), l1_passed=533,
                l1_stock_passed=533, l2="passed")

MATRIX = f"""# the matrix
schema = 1
index_url = "https://pypi.org/simple"

[[cell]]
engine = "vllm"
series = "0.9"
version = "0.9.2"
build = 1
python = ">=3.9"
torch = "2.7.0"
status = "experimental"
reason = "being proven"
test_pins = {{ transformers = "4.53.3" }}  # a comment that must survive

[[cell.artifact]]
role = "wheel"
filename = "vllm-0.9.2-cp38-abi3-manylinux1_x86_64.whl"
sha256 = "{SHA}"

# the next cell
[[cell]]
engine = "vllm"
series = "0.25"
version = "0.25.1"
build = 1
python = ">=3.10"
torch = "2.11.0"
status = "supported"

[cell.proven]
fingerprint = "{'ef' * 32}"
date = 2026-11-30
l1_passed = 1
l1_stock_passed = 1
l2 = "not run: no CPU wheel"

# artifacts of 0.25
[[cell.artifact]]
role = "wheel"
filename = "vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl"
sha256 = "{SHA}"
"""


def write(tmp_path: Path, text: str = MATRIX) -> Path:
    path = tmp_path / "matrix.toml"
    path.write_text(text, encoding="utf-8")
    return path


# --- the schema ---------------------------------------------------------------------------------


def test_a_record_is_read_with_its_fields(tmp_path: Path) -> None:
    cell = load_matrix(write(tmp_path)).get_cell("vllm-0.25")
    assert cell.proven == Proven(fingerprint="ef" * 32, date=dt.date(2026, 11, 30),
                                 l1_passed=1, l1_stock_passed=1, l2="not run: no CPU wheel")


def test_a_supported_cell_without_a_record_is_reported(tmp_path: Path) -> None:
    start = MATRIX.index("[cell.proven]")
    end = MATRIX.index("# artifacts of 0.25")
    matrix = load_matrix(write(tmp_path, MATRIX[:start] + MATRIX[end:]))
    assert matrix.get_cell("vllm-0.25").proven is None
    # The experimental vllm-0.9 needs none.
    assert stale_records(matrix, default_registry()) == [
        "cell vllm-0.25: supported, but no [cell.proven] records its heavy proofs: "
        "run nox -s verify-vllm-0.25"]


@pytest.mark.parametrize(("old", "new", "message"), [
    (f'fingerprint = "{"ef" * 32}"', 'fingerprint = "abc"',
     "field 'proven.fingerprint' must be 64 lower-case hex digits (a patch-set fingerprint), "
     "got 'abc'"),
    ("date = 2026-11-30", 'date = "2026-11-30"',
     "field 'proven.date' must be a date, got '2026-11-30'"),
    ("l1_passed = 1", "l1_passed = -1", "field 'proven.l1_passed' must be an integer >= 0, "
                                        "got -1"),
    ("l1_stock_passed = 1\n", "", "missing required field 'proven.l1_stock_passed'"),
    ('l2 = "not run: no CPU wheel"', 'l2 = "failed"',
     "field 'proven.l2' must be 'passed' or 'not run: <reason>', got 'failed'"),
    ('l2 = "not run: no CPU wheel"', 'l2 = "not run: "',
     "field 'proven.l2' must be 'passed' or 'not run: <reason>', got 'not run: '"),
    ("l1_passed = 1", "l1_passed = 1\nl3 = 2", "cell vllm-0.25: proven: unknown field 'l3'"),
])
def test_a_malformed_record_names_its_field(tmp_path: Path, old: str, new: str,
                                            message: str) -> None:
    with pytest.raises(MatrixError) as caught:
        load_matrix(write(tmp_path, MATRIX.replace(old, new)))
    assert message in str(caught.value)


# --- freshness ------------------------------------------------------------------------------


def test_every_supported_cell_of_the_repository_was_proven_with_its_current_transforms(
) -> None:
    """The CI gate: a transform change needs `nox -s verify-<cell>` before it is committed."""
    problems = stale_records(load_matrix(REPO_MATRIX), default_registry())
    assert not problems, "\n".join(problems)


def test_a_changed_transform_set_is_reported_one_line_per_cell(tmp_path: Path) -> None:
    with fakeeng_project(tmp_path) as project:
        registry = make_registry(project.patches)
        matrix = load_matrix(project.matrix)
        assert stale_records(matrix, registry) == []
        cell = matrix.get_cell(CELL)
        recorded = cell.proven
        assert recorded is not None
        write_proven(project.matrix, CELL, replace(recorded, fingerprint="12" * 32))
        now = current_fingerprint(registry, cell)
        expected = (f"cell {CELL}: its transforms changed since its heavy proofs passed "
                    f"(recorded {'12' * 6}…, now {now[:12]}…): run nox -s verify-{CELL}")
        assert stale_records(load_matrix(project.matrix), registry) == [expected]


def test_check_matrix_fails_on_a_stale_record(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        common = ["--matrix", str(project.matrix), "--patches-dir", str(project.patches),
                  "--registry", "_fixtures:make_registry"]
        recorded = load_matrix(project.matrix).get_cell(CELL).proven
        assert recorded is not None
        write_proven(project.matrix, CELL, replace(recorded, fingerprint="12" * 32))
        assert main(["check-matrix", *common]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"forge: error: cell {CELL}: its transforms changed since "
                                   "its heavy proofs passed (recorded 121212121212…")
    assert len(captured.err.splitlines()) == 1


# --- writing the record -------------------------------------------------------------------------


def test_a_new_record_goes_before_the_artifacts_and_nothing_else_moves(tmp_path: Path) -> None:
    path = write(tmp_path)
    write_proven(path, "vllm-0.9", RECORD)
    text = path.read_text(encoding="utf-8")
    assert text == MATRIX.replace(
        "# a comment that must survive\n\n[[cell.artifact]]",
        "# a comment that must survive\n\n" + render_proven(RECORD) + "\n[[cell.artifact]]", 1)
    assert load_matrix(path).get_cell("vllm-0.9").proven == RECORD


def test_an_existing_record_is_replaced_in_place(tmp_path: Path) -> None:
    path = write(tmp_path)
    write_proven(path, "vllm-0.25", RECORD)
    text = path.read_text(encoding="utf-8")
    old_start = MATRIX.index("[cell.proven]")
    old_end = MATRIX.index("\n# artifacts of 0.25")
    assert text == MATRIX[:old_start] + render_proven(RECORD) + MATRIX[old_end:]
    assert load_matrix(path).get_cell("vllm-0.25").proven == RECORD
    assert load_matrix(path).get_cell("vllm-0.9").proven is None


def test_an_unknown_cell_is_not_written(tmp_path: Path) -> None:
    path = write(tmp_path)
    with pytest.raises(MatrixError, match="no \\[\\[cell\\]\\] 'vllm-0.1'"):
        write_proven(path, "vllm-0.1", RECORD)
    assert path.read_text(encoding="utf-8") == MATRIX


# --- the record from the proofs' results ------------------------------------------------------


def _junit(path: Path, cases: str) -> None:
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>',
                    encoding="utf-8")


def test_the_record_holds_the_measured_counts_and_the_current_fingerprint(
        tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    with fakeeng_project(tmp_path / "p") as project:
        registry = make_registry(project.patches)
        cell = load_matrix(project.matrix).get_cell(CELL)
        results = tmp_path / "results"
        results.mkdir()
        with pytest.raises(MatrixError, match="no L1 result"):
            proven_from_results(cell, registry, results, l2_not_run="x",
                                today=dt.date(2026, 12, 1))
        (results / f"l1-{CELL}.json").write_text(
            json.dumps({"patched_passed": 238, "stock_passed": 237}), encoding="utf-8")
        _junit(results / f"l2-{CELL}.xml", '<testcase name="a"/><testcase name="b"/>')
        proven = proven_from_results(cell, registry, results, l2_not_run=None,
                                     today=dt.date(2026, 12, 1))
        assert proven == Proven(fingerprint=current_fingerprint(registry, cell),
                                date=dt.date(2026, 12, 1), l1_passed=238,
                                l1_stock_passed=237, l2="passed")
        _junit(results / f"l2-{CELL}.xml",
               '<testcase name="a"><skipped message="no CPU wheel"/></testcase>')
        assert proven_from_results(cell, registry, results, l2_not_run=None,
                                   today=dt.date(2026, 12, 1)).l2 == "not run: no CPU wheel"
        _junit(results / f"l2-{CELL}.xml",
               '<testcase name="a"/><testcase name="b"><failure message="x"/></testcase>')
        with pytest.raises(MatrixError, match="L2 failed: b"):
            proven_from_results(cell, registry, results, l2_not_run=None,
                                today=dt.date(2026, 12, 1))


def test_record_proven_writes_the_matrix(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p").mkdir()
    with fakeeng_project(tmp_path / "p") as project:
        results = tmp_path / "results"
        results.mkdir()
        (results / f"l1-{CELL}.json").write_text(
            json.dumps({"patched_passed": 15, "stock_passed": None}), encoding="utf-8")
        assert main(["record-proven", CELL, "--results", str(results), "--l2-not-run",
                     "no engine here", "--matrix", str(project.matrix), "--patches-dir",
                     str(project.patches), "--registry", "_fixtures:make_registry"]) == 0
        proven = load_matrix(project.matrix).get_cell(CELL).proven
    assert proven is not None
    assert (proven.l1_passed, proven.l1_stock_passed, proven.l2) == (15, 0,
                                                                     "not run: no engine here")
    assert proven.date == dt.date.today()
    assert "recorded" in capsys.readouterr().out
