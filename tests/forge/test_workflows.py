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
series = "0.35"
version = "0.35.0"
build = 1
python = ">=3.11,<3.15"
torch = "2.13.0"
status = "{status}"
{reason}
[[cell.artifact]]
role = "wheel"
filename = "vllm-0.35.0-cp38-abi3-manylinux_2_28_x86_64.whl"
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
    assert added == [{"cell": "vllm-0.35", "engine": "vllm", "version": "0.35.0",
                      "build": "build-vllm-0.35", "test": "test-vllm-0.35"}]
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


def upgrade_check_steps() -> dict[str, dict]:
    """The check job's steps by role."""
    steps = yaml.safe_load((REPO / UPGRADE).read_text())["jobs"]["check"]["steps"]
    return {
        "check": next(s for s in steps if s.get("id") == "check"),
        "upload": next(s for s in steps if "actions/upload-artifact@" in s.get("uses", "")),
        "describe": next(s for s in steps if "/pull-request.md" in s.get("run", "")),
        "pull request": next(s for s in steps if "create-pull-request@" in s.get("uses", "")),
        "issue": next(s for s in steps if "ci/hosting.py upgrade-issue" in s.get("run", "")),
        "fail": steps[-1],
    }


def test_upgrade_workflow_scans_daily_checks_each_release_and_proposes_the_cell() -> None:
    document = yaml.safe_load((REPO / UPGRADE).read_text())
    triggers = document[True]  # YAML 1.1 reads the key `on` as true
    assert set(triggers) == {"schedule", "workflow_dispatch"}
    assert re.fullmatch(r"\d+ \d+ \* \* \*", triggers["schedule"][0]["cron"])
    scan, check = document["jobs"]["scan"], document["jobs"]["check"]
    assert "nox -s upgrade-scan -- --json" in scan["steps"][-1]["run"]
    assert ".unchecked[]" in scan["steps"][-1]["run"]
    assert check["strategy"]["matrix"]["include"] == \
        "${{ fromJSON(needs.scan.outputs.releases) }}"
    steps = upgrade_check_steps()
    assert 'nox -s upgrade-check -- "$ENGINE" "$VERSION" --out "$REPORT_DIR" --write-cell' \
        in steps["check"]["run"]
    assert check["env"]["REPORT_DIR"] == \
        "reports/upgrade/${{ matrix.engine }}-${{ matrix.version }}"
    upload = steps["upload"]
    assert upload["if"] == "always()" and upload["with"]["path"] == check["env"]["REPORT_DIR"]
    assert upload["with"]["name"] == check["env"]["ARTIFACT"]
    opened = steps["pull request"]
    assert opened["with"]["add-paths"] == "matrix.toml"
    assert opened["with"]["body-path"] == "${{ runner.temp }}/pull-request.md"
    assert 'cat "$REPORT_DIR/report.md"' in steps["describe"]["run"]
    issue = steps["issue"]
    assert issue["run"].strip() == ('python ci/hosting.py upgrade-issue --report "$REPORT_DIR" '
                                    '--artifact-url "$ARTIFACT_URL"')
    assert issue["env"] == {"GITHUB_TOKEN": "${{ github.token }}",
                            "ARTIFACT_URL": "${{ steps.upload.outputs.artifact-url }}"}
    assert steps["fail"]["env"] == {"STATUS": "${{ steps.check.outputs.status }}"}
    # only the job that opens the pull request and the issue may write
    assert document["permissions"] == {"contents": "read"}
    assert check["permissions"] == {"contents": "write", "pull-requests": "write",
                                    "issues": "write"}


def runs(condition: str | None, status: str, outcome: str) -> bool:
    """Whether a step with this `if` runs after the check step said `status` and `outcome`
    (every step before it having succeeded). Knows only the expressions the workflow uses."""
    if condition is None:
        return True
    python = (condition.replace("!cancelled()", "True").replace("always()", "True")
              .replace("steps.check.outputs.status", repr(status))
              .replace("steps.check.outputs.outcome", repr(outcome))
              .replace("&&", " and ").replace("||", " or "))
    assert re.fullmatch(r"[\w\s'().=!-]*", python), python
    return bool(eval(python))  # the workflow's own text, its characters checked above


@pytest.mark.parametrize(("status", "outcome", "expected"), [
    ("0", "proposed", {"upload", "describe", "pull request", "issue"}),
    ("0", "already-a-cell", {"upload", "issue"}),
    ("3", "not-proposable", {"upload", "issue", "fail"}),
    ("4", "proof-failed", {"upload", "issue", "fail"}),
    ("1", "", {"upload", "fail"}),
])
def test_the_check_status_decides_the_pull_request_the_issue_and_the_verdict(
        status: str, outcome: str, expected: set[str]) -> None:
    steps = upgrade_check_steps()
    ran = {role for role, step in steps.items()
           if role != "check" and runs(step.get("if"), status, outcome)}
    assert ran == expected


@pytest.mark.parametrize(("exit_status", "outcome"), [
    (0, "proposed"), (0, "already-a-cell"), (3, "not-proposable"), (4, "proof-failed"), (1, None),
])
@pytest.mark.skipif(shutil.which("jq") is None, reason="jq (on every GitHub runner) is absent")
def test_the_check_step_keeps_the_exit_status_and_the_outcome(
        tmp_path: Path, exit_status: int, outcome: str | None) -> None:
    # nox stands in for the check: writes the report (unless it failed early) and exits.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    report = {"outcome": outcome} if outcome else None
    (bin_dir / "nox").write_text(
        "#!/bin/sh\n"
        + (f"mkdir -p \"$REPORT_DIR\" && echo '{json.dumps(report)}' > "
           "\"$REPORT_DIR/report.json\"\n" if report else "")
        + f"exit {exit_status}\n")
    (bin_dir / "nox").chmod(0o755)
    output = tmp_path / "github-output"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GITHUB_OUTPUT": str(output),
           "ENGINE": "vllm", "VERSION": "0.33.0", "REPORT_DIR": "reports/upgrade/vllm-0.33.0"}
    # GitHub runs a `run` script as `bash --noprofile --norc -eo pipefail {0}`
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                           upgrade_check_steps()["check"]["run"]], cwd=tmp_path, env=env)
    assert done.returncode == 0
    values = dict(line.split("=", 1) for line in output.read_text().splitlines())
    assert values == {"status": str(exit_status), "outcome": outcome or ""}


@pytest.mark.parametrize(("status", "words"), [
    ("3", "no cell can be proposed"), ("4", "failed its trial build or L0/L1"),
    ("1", "did not finish"),
])
def test_the_last_step_fails_the_job_with_the_check_status(tmp_path: Path, status: str,
                                                          words: str) -> None:
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
         upgrade_check_steps()["fail"]["run"]],
        cwd=tmp_path, capture_output=True, text=True,
        env={"PATH": os.environ["PATH"], "STATUS": status, "ENGINE": "vllm",
             "VERSION": "0.33.0", "ARTIFACT": "upgrade-report-vllm-0.33.0"})
    assert done.returncode == int(status)
    assert done.stdout.startswith("::error title=upgrade-check vllm 0.33.0::exit status "
                                  f"{status}, ")
    assert words in done.stdout and "upgrade-report-vllm-0.33.0" in done.stdout


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq (on every GitHub runner) is absent")
def run_scan_step(tmp_path: Path, scan: list[dict]) -> tuple[dict[str, str], str]:
    """The scan step's script on `scan` (what `upgrade-scan --json` printed): its outputs and
    its stdout."""
    scan_step = yaml.safe_load((REPO / UPGRADE).read_text())["jobs"]["scan"]["steps"][-1]
    script = scan_step["run"].replace("nox -s upgrade-scan -- --json > scan.json\n", "")
    (tmp_path / "scan.json").write_text(json.dumps(scan))
    output = tmp_path / "github-output"
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                          cwd=tmp_path, check=True, capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "GITHUB_OUTPUT": str(output)})
    return dict(line.split("=", 1) for line in output.read_text().splitlines()), done.stdout


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq (on every GitHub runner) is absent")
def test_the_scan_step_turns_the_scan_into_one_check_per_unchecked_release(
        tmp_path: Path) -> None:
    values, stdout = run_scan_step(tmp_path, [
        # a post release of a cell's series and a gap in the supported span: unchecked, though
        # not newer than the newest cell
        {"engine": "sglang", "newest_cell": "sglang-0.5.23", "newest_cell_version": "0.5.23",
         "newer": [], "unchecked": ["0.5.20", "0.5.23.post1"]},
        {"engine": "vllm", "newest_cell": "vllm-0.32", "newest_cell_version": "0.32.0",
         "newer": ["0.33.0", "0.33.1"], "unchecked": ["0.30.0", "0.33.0", "0.33.1"]},
    ])
    assert json.loads(values["releases"]) == [
        {"engine": "sglang", "version": "0.5.20"}, {"engine": "sglang", "version": "0.5.23.post1"},
        {"engine": "vllm", "version": "0.30.0"}, {"engine": "vllm", "version": "0.33.0"},
        {"engine": "vllm", "version": "0.33.1"},
    ]
    assert values["count"] == "5"
    assert stdout == ""

    values, _ = run_scan_step(tmp_path, [
        {"engine": "vllm", "newest_cell": "vllm-0.33", "newest_cell_version": "0.33.0",
         "newer": [], "unchecked": []},
    ])
    assert values == {"releases": "[]", "count": "0"}


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq (on every GitHub runner) is absent")
def test_the_scan_step_keeps_the_matrix_within_what_github_takes(tmp_path: Path) -> None:
    versions = [f"0.{minor}.0" for minor in range(300)]
    values, stdout = run_scan_step(tmp_path, [
        {"engine": "vllm", "newest_cell": "vllm-0.9", "newest_cell_version": "0.9.2",
         "newer": versions, "unchecked": versions},
    ])
    assert values["count"] == str(workflows.MAX_CHECKS) == "256"
    assert [entry["version"] for entry in json.loads(values["releases"])] == versions[:256]
    assert stdout == "::warning::300 releases to check; this run checks the first 256\n"


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
