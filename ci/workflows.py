"""Generate the GitHub Actions workflows in .github/workflows/ from `nox -l --json` and matrix.toml.

    python ci/workflows.py            (re)write the workflow files
    python ci/workflows.py --check    exit 1, one line per stale file, if a checked-in file
                                      differs from what would be generated

pull-request.yml: lint and the project's tests, then one job per supported cell (its build
session, then its test session). upgrade.yml: daily, the upgrade scan, then one upgrade check
per release it lists as unchecked, its report uploaded; a proposed experimental cell becomes a
pull request, a release that cannot be proposed or whose proposed cell fails its proofs an issue
(ci/hosting.py), and the job then fails, so the scheduled run is red. soak.yml: nightly, the
hour-long soak (`nox -s soak`), its report uploaded.

Only `supported` cells get pull-request jobs: an experimental cell was built and proven by the
upgrade check that wrote it, and keeping it out means the upgrade's pull request changes no
workflow file (a workflow token may not push those).

The text is written by hand, not by a YAML library, so that it is stable byte for byte and can
carry the version comment next to each pinned action.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS_DIR = Path(".github") / "workflows"
FORGE_CACHE = "~/.cache/kvcached-forge"
RUNNER = "ubuntu-latest"
UPGRADE_CRON = "17 4 * * *"
UPGRADE_REPORTS = "reports/upgrade"
SOAK_CRON = "41 1 * * *"
SOAK_SECONDS = 3600
SOAK_REPORTS = "reports/soak"


@dataclass(frozen=True)
class Action:
    """A third-party action pinned by full commit sha; `version` is what the sha was tagged."""

    name: str
    sha: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}@{self.sha}"


CHECKOUT = Action("actions/checkout", "11bd71901bbe5b1630ceea73d27597364c9af683", "v4.2.2")
SETUP_PYTHON = Action("actions/setup-python", "0b93645e9fea7318ecaed2b359559ac225c90a2b",
                      "v5.3.0")
CACHE = Action("actions/cache", "1bd1e32a3bdc45362d1e726936510720a7c30a57", "v4.2.0")
UPLOAD_ARTIFACT = Action("actions/upload-artifact", "b4b15b8c7c6ac21ea08fcf65892d2ee8f75cf882",
                         "v4.4.3")
CREATE_PULL_REQUEST = Action("peter-evans/create-pull-request",
                             "271a8d0340265f705b14b6d32b9829c1cb33d45e", "v7.0.8")


@dataclass(frozen=True)
class CellJob:
    cell: str
    engine: str
    version: str
    python: str
    build_session: str
    test_session: str


# --- inputs --------------------------------------------------------------------------------


def nox_sessions(root: Path) -> list[dict]:
    """`nox -l --json` of the noxfile in `root` (its sessions follow that folder's matrix.toml)."""
    done = subprocess.run(
        [sys.executable, "-m", "nox", "--noxfile", str(root / "noxfile.py"), "-l", "--json"],
        capture_output=True, text=True, cwd=root,
    )
    if done.returncode != 0:
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"ci/workflows.py: nox -l --json failed: {detail}")
    return json.loads(done.stdout)


def nox_requirement(root: Path) -> str:
    """The nox requirement the project's test dependency group names (one source of truth)."""
    with open(root / "pyproject.toml", "rb") as f:
        groups = tomllib.load(f).get("dependency-groups", {})
    for entry in groups.get("test", []):
        if isinstance(entry, str) and re.match(r"nox\b", entry):
            return entry
    return "nox"


def cell_jobs(sessions: Sequence[Mapping], cells: Sequence[Mapping]) -> list[CellJob]:
    """One job per supported cell that has both a build and a test session, sorted by name."""
    by_name = {s["session"]: s for s in sessions}
    cells_by_name = {f"{c['engine']}-{c['series']}": c for c in cells}
    jobs = []
    for session in sessions:
        tags = session.get("tags", [])
        if "build" not in tags or "supported" not in tags:
            continue
        cell = session["session"].removeprefix("build-")
        test = by_name.get(f"test-{cell}")
        if cell not in cells_by_name or test is None:
            continue
        jobs.append(CellJob(cell=cell, engine=cells_by_name[cell]["engine"],
                            version=cells_by_name[cell]["version"],
                            python=session.get("python") or "3.11",
                            build_session=session["session"], test_session=test["session"]))
    return sorted(jobs, key=lambda job: job.cell)


def project_session(sessions: Sequence[Mapping], name: str) -> Mapping:
    for session in sessions:
        if session["session"] == name:
            return session
    raise SystemExit(f"ci/workflows.py: noxfile.py has no session {name!r}")


# --- YAML text -----------------------------------------------------------------------------

# Characters a plain (unquoted) scalar may hold here; anything else is written double-quoted.
_PLAIN = re.compile(r"[A-Za-z0-9_./${}()'\" |=!:&<>-]*")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    needs_quotes = (
        not text
        or not _PLAIN.fullmatch(text)
        or text.lower() in _YAML_WORDS
        or text[0] in "-&!|>'\"%@` {*?[,#+.0123456789"
        or ": " in text
        or " #" in text
        or text.endswith(":")
    )
    return json.dumps(text) if needs_quotes else text


def emit(value: object, indent: int = 0) -> list[str]:
    """Block-style YAML lines for dicts (insertion order), lists and scalars."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            lines += _emit_entry(f"{pad}{key}:", item, indent)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, Mapping) and item:
                first, *rest = emit(item, indent + 2)
                lines.append(f"{pad}- {first.lstrip()}")
                lines += rest
            else:
                lines += _emit_entry(f"{pad}-", item, indent)
    else:
        lines.append(pad + scalar(value))
    return lines


def _emit_entry(head: str, item: object, indent: int) -> list[str]:
    if isinstance(item, Action):
        return [f"{head} {item}  # {item.version}"]
    if isinstance(item, str) and "\n" in item:
        lines = item.rstrip("\n").split("\n")
        body = [(" " * (indent + 2) + line) if line else "" for line in lines]
        return [f"{head} |", *body]
    if isinstance(item, Mapping | list) and item:
        return [head, *emit(item, indent + 2)]
    if isinstance(item, Mapping):
        return [f"{head} {{}}"]
    if isinstance(item, list):
        return [f"{head} []"]
    return [f"{head} {scalar(item)}"]


HEADER = (
    "# Generated by ci/workflows.py from `nox -l --json` and matrix.toml: do not edit.\n"
    "# Regenerate with `python ci/workflows.py`; the tests fail while this file is stale.\n"
)


def document(workflow: Mapping) -> str:
    return HEADER + "\n".join(emit(workflow)) + "\n"


# --- the workflows -------------------------------------------------------------------------


def _setup_steps(python: str, nox: str, cache_key: str | None) -> list[dict]:
    steps: list[dict] = [
        {"uses": CHECKOUT, "with": {"persist-credentials": False}},
        {"uses": SETUP_PYTHON, "with": {"python-version": python}},
    ]
    if cache_key is not None:
        # Upstream wheels and cached test venvs: large, and fixed by the matrix's sha256 pins.
        steps.append({
            "name": "Cache the upstream artifacts and test venvs",
            "uses": CACHE,
            "with": {
                "path": FORGE_CACHE,
                "key": f"{cache_key}-${{{{ hashFiles('matrix.toml') }}}}",
                "restore-keys": f"{cache_key}-",
            },
        })
    steps.append({"name": "Install nox", "run": f"python -m pip install '{nox}'"})
    return steps


def pull_request_workflow(sessions: Sequence[Mapping], cells: Sequence[Mapping],
                          nox: str) -> dict:
    lint = project_session(sessions, "lint")
    tests = project_session(sessions, "tests")
    jobs: dict[str, dict] = {
        "lint": {
            "runs-on": RUNNER,
            "timeout-minutes": 30,
            "steps": [*_setup_steps(lint.get("python") or "3.11", nox, None),
                      {"name": "nox -s lint", "run": "nox -s lint"}],
        },
        "tests": {
            "runs-on": RUNNER,
            "timeout-minutes": 60,
            "steps": [*_setup_steps(tests.get("python") or "3.11", nox,
                                    "forge-${{ runner.os }}-tests"),
                      {"name": "nox -s tests", "run": "nox -s tests"}],
        },
    }
    cell_list = cell_jobs(sessions, cells)
    pythons = sorted({job.python for job in cell_list})
    if cell_list:
        jobs["cells"] = {
            "name": "cell ${{ matrix.cell }}",
            "needs": ["lint", "tests"],
            "runs-on": RUNNER,
            "timeout-minutes": 120,
            "strategy": {
                "fail-fast": False,
                "matrix": {"include": [
                    {"cell": job.cell, "engine": job.engine, "version": job.version,
                     # a matrix field only where the cells' sessions differ in Python
                     **({"python": job.python} if len(pythons) > 1 else {}),
                     "build": job.build_session, "test": job.test_session}
                    for job in cell_list
                ]},
            },
            "env": {"BUILD_SESSION": "${{ matrix.build }}",
                    "TEST_SESSION": "${{ matrix.test }}"},
            "steps": [
                *_setup_steps(pythons[0] if len(pythons) == 1 else "${{ matrix.python }}", nox,
                              "forge-${{ runner.os }}-${{ matrix.cell }}"),
                {"name": "Build the cell's wheels", "run": 'nox -s "$BUILD_SESSION"'},
                # The build just ran: --no-dependencies keeps nox from running it again.
                {"name": "Prove the cell on its wheels",
                 "run": 'nox -s "$TEST_SESSION" --no-dependencies'},
            ],
        }
    return {
        "name": "pull-request",
        "on": {"pull_request": {}},
        "permissions": {"contents": "read"},
        "concurrency": {
            "group": "pull-request-${{ github.event.pull_request.number }}",
            "cancel-in-progress": True,
        },
        "jobs": jobs,
    }


# upgrade-scan --json: [{"engine", "newest_cell", "newest_cell_version", "newer": [...],
# "unchecked": [...]}]; "unchecked" holds every release to check (the newer ones, releases in the
# supported span whose series is no cell and is not declared skipped, newer post releases of a
# cell's series). The check job wants one {"engine", "version"} per unchecked release, at most
# MAX_CHECKS of them: GitHub refuses a matrix of more than 256 jobs.
MAX_CHECKS = 256
SCAN_SCRIPT = f"""\
nox -s upgrade-scan -- --json > scan.json
all=$(jq -c '[.[] | .engine as $engine | .unchecked[] | {{engine: $engine, version: .}}]' scan.json)
releases=$(jq -c '.[:{MAX_CHECKS}]' <<< "$all")
total=$(jq length <<< "$all")
if [ "$total" -gt {MAX_CHECKS} ]; then
  echo "::warning::$total releases to check; this run checks the first {MAX_CHECKS}"
fi
echo "releases=$releases" >> "$GITHUB_OUTPUT"
echo "count=$(jq length <<< "$releases")" >> "$GITHUB_OUTPUT"
"""

# --write-cell appends the proposed experimental cell to matrix.toml (only when every required
# seam has a working transform); the report folder keeps the unreviewed diffs. No --no-l1: the
# scheduled job has the time (timeout-minutes below) to run the cell's L0 and L1 on the trial
# build, and the cell it proposes then carries its measured L1 floor.
# The step itself succeeds: it hands the check's exit status (0 a cell proposed or the release
# already a cell, 3 no cell can be proposed, 4 the proposed cell failed its trial build or L0/L1,
# 1 bad input or infrastructure) and the report's outcome to the steps after it, so the report is
# uploaded and the issue written before the last step fails the job on that status. GitHub runs
# `bash -e`: `set +e` keeps the status.
CHECK_SCRIPT = """\
set +e
nox -s upgrade-check -- "$ENGINE" "$VERSION" --out "$REPORT_DIR" --write-cell
status=$?
set -e
echo "status=$status" >> "$GITHUB_OUTPUT"
outcome=""
if [ -f "$REPORT_DIR/report.json" ]; then
  outcome=$(jq -r '.outcome // ""' "$REPORT_DIR/report.json" || true)
fi
echo "outcome=$outcome" >> "$GITHUB_OUTPUT"
"""

# The pull request's description: the report, and where its folder (unreviewed diffs, trial
# wheels' logs) can be downloaded.
DESCRIBE_SCRIPT = """\
{
  cat "$REPORT_DIR/report.md"
  echo
  echo "The report folder, unreviewed diffs included, is the artifact $ARTIFACT of $RUN_URL"
} > "$RUNNER_TEMP/pull-request.md"
"""

# Opens the release's issue, or rewrites the open one (status 3 or 4); closes it with a comment
# once the release is proposed or is a cell (status 0). Without an artifact URL (an older
# upload-artifact, a failed upload) the issue links the run.
ISSUE_SCRIPT = """\
python ci/hosting.py upgrade-issue --report "$REPORT_DIR" --artifact-url "$ARTIFACT_URL"
"""

# The last step: the job fails when the check did not end with a proposed cell (or a release
# that already is one), so the scheduled run is red until someone looks.
FAIL_SCRIPT = """\
case "$STATUS" in
  3) why="no cell can be proposed: a required seam has no working transform" ;;
  4) why="the proposed cell failed its trial build or L0/L1" ;;
  *) why="the check did not finish (bad input or infrastructure)" ;;
esac
title="upgrade-check $ENGINE $VERSION"
echo "::error title=$title::exit status $STATUS, $why; see the artifact $ARTIFACT"
exit "${STATUS:-1}"
"""

CHECK_STATUS = "steps.check.outputs.status"
# a cell was proposed: the pull request steps run
PROPOSED = f"{CHECK_STATUS} == '0' && steps.check.outputs.outcome == 'proposed'"
# the check ended with a report whose outcome the issue step acts on
REPORTED = (f"!cancelled() && ({CHECK_STATUS} == '3' || {CHECK_STATUS} == '4' || "
            f"{CHECK_STATUS} == '0')")
FAILED = f"!cancelled() && {CHECK_STATUS} != '0'"


def upgrade_workflow(sessions: Sequence[Mapping], nox: str) -> dict:
    python = project_session(sessions, "tests").get("python") or "3.11"
    report_dir = f"{UPGRADE_REPORTS}/${{{{ matrix.engine }}}}-${{{{ matrix.version }}}}"
    release = "${{ matrix.engine }} ${{ matrix.version }}"
    artifact = "upgrade-report-${{ matrix.engine }}-${{ matrix.version }}"
    return {
        "name": "upgrade",
        "on": {"schedule": [{"cron": UPGRADE_CRON}], "workflow_dispatch": {}},
        "permissions": {"contents": "read"},
        # One scan at a time; a run in progress finishes rather than leaving half a report.
        "concurrency": {"group": "upgrade", "cancel-in-progress": False},
        "jobs": {
            "scan": {
                "runs-on": RUNNER,
                "timeout-minutes": 15,
                "outputs": {"releases": "${{ steps.scan.outputs.releases }}",
                            "count": "${{ steps.scan.outputs.count }}"},
                "steps": [
                    *_setup_steps(python, nox, None),
                    {"name": "Releases newer than each engine's newest cell", "id": "scan",
                     "run": SCAN_SCRIPT},
                ],
            },
            "check": {
                "name": f"upgrade-check {release}",
                "needs": "scan",
                "if": "needs.scan.outputs.count != '0'",
                "runs-on": RUNNER,
                "timeout-minutes": 120,
                # Only this job writes: the branch and the pull request of the new cell, the
                # release's issue.
                "permissions": {"contents": "write", "pull-requests": "write",
                                "issues": "write"},
                "strategy": {
                    "fail-fast": False,
                    "matrix": {"include": "${{ fromJSON(needs.scan.outputs.releases) }}"},
                },
                "env": {"ENGINE": "${{ matrix.engine }}", "VERSION": "${{ matrix.version }}",
                        "REPORT_DIR": report_dir, "ARTIFACT": artifact},
                "steps": [
                    *_setup_steps(python, nox,
                                  "forge-${{ runner.os }}-upgrade-${{ matrix.engine }}"),
                    {"name": f"nox -s upgrade-check -- {release}", "id": "check",
                     "run": CHECK_SCRIPT},
                    {
                        "name": "Upload the report",
                        "id": "upload",
                        "if": "always()",
                        "uses": UPLOAD_ARTIFACT,
                        "with": {
                            "name": artifact,
                            "path": report_dir,
                            "if-no-files-found": "warn",
                        },
                    },
                    {
                        "name": "Describe the pull request",
                        "if": PROPOSED,
                        "env": {"RUN_URL": "${{ github.server_url }}/${{ github.repository }}"
                                           "/actions/runs/${{ github.run_id }}"},
                        "run": DESCRIBE_SCRIPT,
                    },
                    {
                        "name": "Open a pull request with the experimental cell",
                        "if": PROPOSED,
                        "uses": CREATE_PULL_REQUEST,
                        "with": {
                            "branch": "upgrade/${{ matrix.engine }}-${{ matrix.version }}",
                            "delete-branch": True,
                            "title": f"Experimental cell: {release}",
                            "commit-message": f"Experimental cell: {release} (upgrade check)",
                            "body-path": "${{ runner.temp }}/pull-request.md",
                            "add-paths": "matrix.toml",
                        },
                    },
                    {
                        "name": "Open, update or close the release's issue",
                        "if": REPORTED,
                        "env": {"GITHUB_TOKEN": "${{ github.token }}",
                                "ARTIFACT_URL": "${{ steps.upload.outputs.artifact-url }}"},
                        "run": ISSUE_SCRIPT,
                    },
                    {
                        "name": "Fail when the check did not pass",
                        "if": FAILED,
                        "env": {"STATUS": f"${{{{ {CHECK_STATUS} }}}}"},
                        "run": FAIL_SCRIPT,
                    },
                ],
            },
        },
    }


def soak_workflow(sessions: Sequence[Mapping], nox: str) -> dict:
    """Nightly: the hour-long soak against the README's cell, its report uploaded."""
    python = project_session(sessions, "tests").get("python") or "3.11"
    return {
        "name": "soak",
        "on": {"schedule": [{"cron": SOAK_CRON}], "workflow_dispatch": {}},
        "permissions": {"contents": "read"},
        "concurrency": {"group": "soak", "cancel-in-progress": False},
        "jobs": {
            "soak": {
                "runs-on": RUNNER,
                "timeout-minutes": 150,
                "steps": [
                    *_setup_steps(python, nox, "forge-${{ runner.os }}-tests"),
                    {"name": f"nox -s soak -- {SOAK_SECONDS}",
                     "run": f"nox -s soak -- {SOAK_SECONDS}"},
                    {
                        "name": "Upload the soak report",
                        "if": "always()",
                        "uses": UPLOAD_ARTIFACT,
                        "with": {"name": "soak-report", "path": SOAK_REPORTS,
                                 "if-no-files-found": "warn"},
                    },
                ],
            },
        },
    }


def render(root: Path) -> dict[Path, str]:
    """Workflow path (relative to `root`) -> the text it should have."""
    sessions = nox_sessions(root)
    with open(root / "matrix.toml", "rb") as f:
        cells = tomllib.load(f).get("cell", [])
    nox = nox_requirement(root)
    return {
        WORKFLOWS_DIR / "pull-request.yml": document(pull_request_workflow(sessions, cells, nox)),
        WORKFLOWS_DIR / "upgrade.yml": document(upgrade_workflow(sessions, nox)),
        WORKFLOWS_DIR / "soak.yml": document(soak_workflow(sessions, nox)),
    }


def stale(root: Path) -> list[str]:
    """One line per workflow file under `root` that differs from what would be generated."""
    problems = []
    for path, text in sorted(render(root).items()):
        target = root / path
        if not target.is_file():
            problems.append(f"{path}: missing; run `python ci/workflows.py`")
        elif target.read_text() != text:
            problems.append(f"{path}: stale against noxfile.py and matrix.toml; "
                            "run `python ci/workflows.py`")
    return problems


def write(root: Path) -> list[Path]:
    written = []
    for path, text in sorted(render(root).items()):
        target = root / path
        if target.is_file() and target.read_text() == text:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 with one line per stale file instead of writing")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="project root holding noxfile.py and matrix.toml (default: this one)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale(args.root)
        for line in problems:
            print(line)
        return 1 if problems else 0
    for path in write(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
