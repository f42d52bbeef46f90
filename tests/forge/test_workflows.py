"""The generated CI workflows: current against the matrix, one job per supported cell, pinned."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ci import workflows

REPO = Path(__file__).resolve().parents[2]
PULL_REQUEST = workflows.WORKFLOWS_DIR / "pull-request.yml"
UPGRADE = workflows.WORKFLOWS_DIR / "upgrade.yml"

NEW_CELL = """
[[cell]]
engine = "vllm"
series = "0.34"
version = "0.34.0"
build = 1
python = ">=3.11,<3.15"
torch = "2.13.0"
status = "{status}"
{reason}
[[cell.artifact]]
role = "wheel"
filename = "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
sha256 = "{sha}"
"""


def project_copy(tmp_path: Path, extra_cell: str = "") -> Path:
    """The files the workflows are generated from, in a folder of their own."""
    root = tmp_path / "project"
    root.mkdir(parents=True)
    for name in ("noxfile.py", "pyproject.toml", "matrix.toml"):
        shutil.copy(REPO / name, root / name)
    if extra_cell:
        with open(root / "matrix.toml", "a") as matrix:
            matrix.write(extra_cell)
    return root


def with_cell(status: str) -> str:
    reason = "" if status == "supported" else 'reason = "new release, unreviewed"'
    return NEW_CELL.format(status=status, reason=reason, sha="a" * 64)


def cell_matrix(text: str) -> list[dict]:
    return yaml.safe_load(text)["jobs"]["cells"]["strategy"]["matrix"]["include"]


def test_checked_in_workflows_are_current() -> None:
    assert workflows.stale(REPO) == []


def test_a_new_supported_cell_adds_its_job_and_makes_the_checked_in_file_stale(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = workflows.render(project_copy(tmp_path / "before"))
    root = project_copy(tmp_path / "after", with_cell("supported"))
    for path, text in before.items():  # the files as checked in before the cell was added
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)

    assert workflows.main(["--check", "--root", str(root)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{PULL_REQUEST}: stale against noxfile.py and matrix.toml; run `python ci/workflows.py`"
    ]

    after = workflows.render(root)
    old_cells = cell_matrix(before[PULL_REQUEST])
    new_cells = cell_matrix(after[PULL_REQUEST])
    added = [entry for entry in new_cells if entry not in old_cells]
    assert added == [{"cell": "vllm-0.34", "engine": "vllm", "version": "0.34.0",
                      "build": "build-vllm-0.34", "test": "test-vllm-0.34"}]
    assert [entry["cell"] for entry in new_cells] == sorted(entry["cell"] for entry in new_cells)
    assert after[UPGRADE] == before[UPGRADE]

    assert workflows.main(["--root", str(root)]) == 0
    assert workflows.main(["--check", "--root", str(root)]) == 0
    assert (root / PULL_REQUEST).read_text() == after[PULL_REQUEST]


@pytest.mark.parametrize("status", ["experimental", "broken"])
def test_a_cell_that_is_not_supported_gets_no_pull_request_job(tmp_path: Path,
                                                               status: str) -> None:
    # An upgrade's pull request adds an experimental cell: it must leave the workflows as they
    # are, since a workflow token may not change workflow files.
    assert workflows.render(project_copy(tmp_path, with_cell(status))) == \
        workflows.render(REPO)


def test_every_cell_of_the_matrix_is_built_then_tested_after_lint_and_tests() -> None:
    text = (REPO / PULL_REQUEST).read_text()
    document = yaml.safe_load(text)
    jobs = document["jobs"]
    assert [step.get("run") for step in jobs["lint"]["steps"]][-1] == "nox -s lint"
    assert [step.get("run") for step in jobs["tests"]["steps"]][-1] == "nox -s tests"
    assert jobs["cells"]["needs"] == ["lint", "tests"]
    supported = {name for name in _matrix_cells(REPO) if name[1] == "supported"}
    assert {entry["cell"] for entry in cell_matrix(text)} == {name for name, _ in supported}
    runs = [step.get("run") for step in jobs["cells"]["steps"]]
    assert runs[-2:] == ['nox -s "$BUILD_SESSION"', 'nox -s "$TEST_SESSION" --no-dependencies']
    cache = next(step for step in jobs["cells"]["steps"]
                 if "actions/cache@" in step.get("uses", ""))
    assert cache["with"]["path"] == "~/.cache/kvcached-forge"
    assert "hashFiles('matrix.toml')" in cache["with"]["key"]


def _matrix_cells(root: Path) -> list[tuple[str, str]]:
    import tomllib

    with open(root / "matrix.toml", "rb") as f:
        cells = tomllib.load(f)["cell"]
    return [(f"{c['engine']}-{c['series']}", c["status"]) for c in cells]


def test_upgrade_workflow_scans_daily_checks_each_release_and_proposes_the_cell() -> None:
    document = yaml.safe_load((REPO / UPGRADE).read_text())
    triggers = document[True]  # YAML 1.1 reads the key `on` as true
    assert set(triggers) == {"schedule", "workflow_dispatch"}
    assert re.fullmatch(r"\d+ \d+ \* \* \*", triggers["schedule"][0]["cron"])
    scan, check = document["jobs"]["scan"], document["jobs"]["check"]
    assert "nox -s upgrade-scan -- --json" in scan["steps"][-1]["run"]
    assert check["strategy"]["matrix"]["include"] == \
        "${{ fromJSON(needs.scan.outputs.releases) }}"
    steps = check["steps"]
    assert any('nox -s upgrade-check -- "$ENGINE" "$VERSION" --out "$REPORT_DIR" --write-cell'
               in step.get("run", "") for step in steps)
    assert check["env"]["REPORT_DIR"] == \
        "reports/upgrade/${{ matrix.engine }}-${{ matrix.version }}"
    upload = next(s for s in steps if "actions/upload-artifact@" in s.get("uses", ""))
    assert upload["if"] == "always()" and upload["with"]["path"] == check["env"]["REPORT_DIR"]
    opened = next(s for s in steps if "create-pull-request@" in s.get("uses", ""))
    assert opened["with"]["add-paths"] == "matrix.toml"
    assert opened["with"]["body-path"] == "${{ runner.temp }}/pull-request.md"
    described = next(s for s in steps if "/pull-request.md" in s.get("run", ""))
    assert 'cat "$REPORT_DIR/report.md"' in described["run"]
    # only the job that opens the pull request may write
    assert document["permissions"] == {"contents": "read"}
    assert check["permissions"] == {"contents": "write", "pull-requests": "write"}


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq (on every GitHub runner) is absent")
def test_the_scan_step_turns_the_scan_into_one_check_per_new_release(tmp_path: Path) -> None:
    scan_step = yaml.safe_load((REPO / UPGRADE).read_text())["jobs"]["scan"]["steps"][-1]
    script = scan_step["run"].replace("nox -s upgrade-scan -- --json > scan.json\n", "")
    (tmp_path / "scan.json").write_text(json.dumps([
        {"engine": "sglang", "newest_cell": "sglang-0.5.23", "newest_cell_version": "0.5.23",
         "newer": []},
        {"engine": "vllm", "newest_cell": "vllm-0.32", "newest_cell_version": "0.32.0",
         "newer": ["0.33.0", "0.33.1"]},
    ]))
    output = tmp_path / "github-output"
    subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, check=True,
                   env={"PATH": os.environ["PATH"], "GITHUB_OUTPUT": str(output)})
    values = dict(line.split("=", 1) for line in output.read_text().splitlines())
    assert json.loads(values["releases"]) == [{"engine": "vllm", "version": "0.33.0"},
                                              {"engine": "vllm", "version": "0.33.1"}]
    assert values["count"] == "2"


@pytest.mark.parametrize("path", [PULL_REQUEST, UPGRADE])
def test_actions_are_pinned_and_permissions_least(path: Path) -> None:
    text = (REPO / path).read_text()
    document = yaml.safe_load(text)
    uses = re.findall(r"uses: (\S+)", text)
    assert uses
    for action in uses:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", action), action
    assert document["permissions"] == {"contents": "read"}
    assert document["concurrency"]["group"]


def test_generated_text_is_the_yaml_of_the_workflow() -> None:
    """The hand-written emitter says exactly what the workflow structure says."""
    sessions = workflows.nox_sessions(REPO)
    import tomllib

    with open(REPO / "matrix.toml", "rb") as f:
        cells = tomllib.load(f)["cell"]
    for structure in (workflows.pull_request_workflow(sessions, cells, "nox>=2025.2"),
                      workflows.upgrade_workflow(sessions, "nox>=2025.2")):
        plain = json.loads(json.dumps(structure, default=str))
        plain[True] = plain.pop("on")
        assert yaml.safe_load(workflows.document(structure)) == plain


@pytest.mark.parametrize("value", ["on", "3.11", "a: b", "x #y", "-x", "'q", '"q', "", "~",
                                   "*/5 * * * *", "tab\there", "yes", "1e3", "{x}"])
def test_scalars_that_yaml_would_misread_are_quoted(value: str) -> None:
    assert yaml.safe_load("\n".join(workflows.emit({"key": value}))) == {"key": value}
