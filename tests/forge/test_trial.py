"""The trial files an upgrade check's trial build writes, read back as the cell proofs read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge.matrix import load_matrix
from forge.registry import Transform, default_registry
from forge.trial import (
    TRIAL_MATRIX,
    TRIAL_REGISTRY,
    TrialError,
    trial_matrix_path,
    trial_registry,
    write_trial,
)

ROOT = Path(__file__).resolve().parents[2]
# A release no cell of the project's matrix holds: the trial adds it beside them.
ENTRY = """[[cell]]
engine = "vllm"
series = "0.35"
version = "0.35.0"
build = 1
python = ">=3.10,<3.15"
torch = "2.9.0"
status = "experimental"
reason = "a trial"

[[cell.artifact]]
role = "wheel"
filename = "vllm-0.35.0-cp38-abi3-manylinux_2_28_x86_64.whl"
sha256 = "{sha}"
""".format(sha="1" * 64)


def chosen_for_0_32() -> list[Transform]:
    registry = default_registry()
    return registry.select("vllm-0.32", "vllm", "0.32", "0.32.0")


def test_the_written_trial_reads_back_as_the_chosen_transforms_narrowed_to_the_release(
        tmp_path: Path) -> None:
    chosen = chosen_for_0_32()
    write_trial(tmp_path, matrix_text=(ROOT / "matrix.toml").read_text(encoding="utf-8"),
                entry=ENTRY, cell="vllm-0.35", version="0.35.0", transforms=chosen)

    registry = trial_registry(tmp_path)
    assert [t.id for t in registry.codemods] == [t.id for t in chosen]
    assert {str(t.versions) for t in registry.codemods} == {"==0.35.0"}
    assert registry.patches_root == tmp_path / "trial-patches"
    assert registry.required_seams == default_registry().required_seams
    # The trial's cell resolves to exactly those transforms; its neighbours' versions do not.
    matrix = load_matrix(trial_matrix_path(tmp_path))
    cell = matrix.get_cell("vllm-0.35")
    selected = registry.select(cell.name, cell.engine, cell.series, cell.version)
    assert [t.id for t in selected] == [t.id for t in chosen]
    assert all(not t.applies_to("vllm", "0.35.1") for t in registry.codemods)
    # Every cell of the project's matrix is still there beside the trial's.
    assert {c.name for c in matrix.cells} == \
        {c.name for c in load_matrix(ROOT / "matrix.toml").cells} | {"vllm-0.35"}


def test_a_trial_folder_that_moved_still_finds_its_reviewed_diffs(tmp_path: Path) -> None:
    write_trial(tmp_path / "a", matrix_text="schema = 1\n", entry=ENTRY, cell="vllm-0.35",
                version="0.35.0", transforms=chosen_for_0_32())
    (tmp_path / "a").rename(tmp_path / "b")
    assert trial_registry(tmp_path / "b").patches_root == tmp_path / "b" / "trial-patches"


@pytest.mark.parametrize("missing", [TRIAL_MATRIX, TRIAL_REGISTRY])
def test_a_trial_folder_without_its_files_is_one_line_naming_the_file(
        tmp_path: Path, missing: str) -> None:
    write_trial(tmp_path, matrix_text="schema = 1\n", entry=ENTRY, cell="vllm-0.35",
                version="0.35.0", transforms=chosen_for_0_32())
    (tmp_path / missing).unlink()
    with pytest.raises(TrialError) as raised:
        trial_matrix_path(tmp_path)
        trial_registry(tmp_path)
    message = str(raised.value)
    assert "\n" not in message
    assert message == f"proof trial {tmp_path}: no {missing} (an upgrade-check trial build " \
                      "writes it)"


def test_a_description_naming_an_unregistered_transform_is_refused(tmp_path: Path) -> None:
    write_trial(tmp_path, matrix_text="schema = 1\n", entry=ENTRY, cell="vllm-0.35",
                version="0.35.0", transforms=chosen_for_0_32())
    path = tmp_path / TRIAL_REGISTRY
    description = json.loads(path.read_text(encoding="utf-8"))
    description["transforms"].append("vllm-no-such-transform")
    path.write_text(json.dumps(description), encoding="utf-8")
    with pytest.raises(TrialError, match="transforms not registered: vllm-no-such-transform$"):
        trial_registry(tmp_path)
    path.write_text("{}", encoding="utf-8")
    with pytest.raises(TrialError, match="not a trial registry description"):
        trial_registry(tmp_path)


def test_a_diff_cannot_be_part_of_a_trial(tmp_path: Path) -> None:
    from dataclasses import replace

    from forge.registry import Kind

    diff_like = replace(chosen_for_0_32()[0], kind=Kind.DIFF)
    with pytest.raises(TrialError, match="codemods only"):
        write_trial(tmp_path, matrix_text="schema = 1\n", entry=ENTRY, cell="vllm-0.35",
                    version="0.35.0", transforms=[diff_like])
    assert not (tmp_path / TRIAL_REGISTRY).exists()
