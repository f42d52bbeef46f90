"""The proposed cell's trial build and its L0 and L1 proofs, all inside the report folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from forge.errors import ForgeError
from forge.fetch import CACHE_ENV, INDEX_URL_ENV
from forge.matrix import Matrix
from forge.registry import Kind, Registry
from forge.trial import PROOF_TRIAL_ENV, trial_matrix_path, trial_registry, write_trial
from forge.upgrade.release import Progress, quiet
from forge.upgrade.report import UpgradeReport
from forge.upgrade.variants import all_diffs


def trial_build(*, matrix: Matrix, registry: Registry, report: UpgradeReport,
                chosen: list[str], cache_dir: Path, index_url: str, out_dir: Path,
                progress: Progress) -> tuple[str, Path | None]:
    """Build the proposed cell's wheels with the chosen transforms applied together, all in
    ``out_dir``: a trial matrix (the matrix plus the entry), a trial registry (the chosen
    transforms, ranges narrowed to this release only; forge/trial.py) and its reviewed diffs
    under ``out_dir/trial-patches/``, the wheels under ``out_dir/dist/``. Nothing is written to
    the project's matrix, ``patches/`` or ``dist/``. Returns the one-line outcome and the
    folder of the wheels (None when the build failed: a failure is the outcome, not an
    exception)."""
    from forge.build import approve_diffs, build_cell  # the build pulls in the re-packer

    transforms = [t for t in [*registry.codemods, *all_diffs(registry, report.engine)]
                  if t.id in chosen]
    if any(t.kind is Kind.DIFF for t in transforms):
        return "skipped: a chosen variant is a diff, which applies only in its own series", None
    # The trial has no measured L1 count to guard: its L1 floor is 1 (stock and patched
    # trees must still agree); the count it measures becomes the proposed entry's floor.
    write_trial(out_dir, matrix_text=matrix.path.read_text(encoding="utf-8"),
                entry=with_l1_floor(report.matrix_entry, 1), cell=report.cell_name,
                version=report.version, transforms=transforms)
    trial_matrix = trial_matrix_path(out_dir)
    trial = trial_registry(out_dir, base=registry)
    dist = out_dir / "dist"
    try:
        approve_diffs(report.cell_name, matrix_path=trial_matrix, cache_dir=cache_dir,
                      registry=trial, index_url=index_url, progress=progress)
        result = build_cell(report.cell_name, matrix_path=trial_matrix, dist_dir=dist,
                            cache_dir=cache_dir, registry=trial, index_url=index_url,
                            progress=progress)
    except ForgeError as exc:
        return f"failed: {exc}", None
    wheels = ", ".join(w.name for w in result.wheels)
    return (f"built {wheels} in {result.out_dir} (trial: unreviewed, not for publishing)",
            result.out_dir)


# --- L0 and L1 on the trial build -------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]  # forge/upgrade/trial.py
# The proof suites of each engine, as `nox -s verify-<cell>` runs them: L0 then L1.
PROOF_SUITES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "vllm": (("L0", ("tests/cells",)), ("L1", ("tests/contract",))),
    "sglang": (("L0", ("tests/cells",)), ("L1", ("tests/sglang/test_l1_contract.py",))),
}
PROOF_LOG = "l0-l1.log"
PROOF_RESULTS = "proof-results"

# argv, environment, working folder, log file (appended to), progress -> exit status and output
CommandRunner = Callable[[Sequence[str], Mapping[str, str], Path, Path, Progress],
                         tuple[int, str]]


def run_proof_command(argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path,
                      progress: Progress) -> tuple[int, str]:
    """Run one proof suite, its output appended to ``log``; pytest's summary lines (failures,
    the count) go to ``progress`` as they come."""
    lines: list[str] = []
    with log.open("a", encoding="utf-8") as sink:
        sink.write(f"$ {' '.join(argv)}\n")
        sink.flush()
        with subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, bufsize=1) as child:
            assert child.stdout is not None
            for line in child.stdout:
                sink.write(line)
                lines.append(line.rstrip("\n"))
                if _SUMMARY.search(line) or line.startswith(("FAILED ", "ERROR ")):
                    progress(f"    {line.rstrip()}")
        sink.write(f"[exit status {child.returncode}]\n\n")
    return child.returncode, "\n".join(lines)


_SUMMARY = re.compile(r"\b\d+ (passed|failed|error|errors|skipped)\b.* in [\d.]+s")
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)")


@dataclass
class ProofOutcome:
    outcome: str                        # one line for the report
    timings: dict[str, float]
    l1_patched_passed: int | None = None
    failed: bool = False                # a suite that ran failed


def run_cell_proofs(*, report: UpgradeReport, out_dir: Path, wheels: Path, cache_dir: Path,
                    index_url: str, with_l1: bool = True, runner: CommandRunner | None = None,
                    progress: Progress = quiet) -> ProofOutcome:
    """L0 and (``with_l1``) L1 of the proposed cell on its trial build: the project's own proof
    suites, each a ``python -m pytest`` with ``--cell <cell> --heavy=all`` and
    ``KVCACHED_PROOF_TRIAL`` naming ``out_dir`` (so they select the trial's matrix and
    transforms). Output goes to ``out_dir/l0-l1.log``; what L1 measured is read from
    ``out_dir/proof-results/``. A failing suite is the outcome, never an exception."""
    suites = PROOF_SUITES.get(report.engine)
    if suites is None:
        return ProofOutcome(f"not run: no proof suites for engine {report.engine}", {})
    if not with_l1:
        suites = tuple((step, paths) for step, paths in suites if step != "L1")
    missing = [path for _, paths in suites for path in paths if not (REPO_ROOT / path).exists()]
    if missing:
        return ProofOutcome(f"not run: {', '.join(missing)} not beside this forge "
                            f"({REPO_ROOT})", {})
    runner = runner or run_proof_command
    log = out_dir / PROOF_LOG
    log.unlink(missing_ok=True)
    results = out_dir / PROOF_RESULTS
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    env = {**os.environ, PROOF_TRIAL_ENV: str(out_dir.resolve()),
           CACHE_ENV: str(cache_dir.resolve()), INDEX_URL_ENV: index_url}
    timings: dict[str, float] = {}
    parts: list[str] = []
    failed = False
    for step, paths in suites:
        argv = [sys.executable, "-m", "pytest", *paths, f"--cell={report.cell_name}",
                "--heavy=all", f"--proof-results={results.resolve()}", "-q", "-rfE",
                "-p", "no:cacheprovider"]
        if step == "L0":
            # The trial build's wheels, not a rebuild.
            argv.append(f"--built-dist={wheels.resolve()}")
        progress(f"{step}: {' '.join(paths)} on {report.cell_name} (trial); log {log}")
        began = time.monotonic()
        status, output = runner(argv, env, REPO_ROOT, log, progress)
        timings[step] = time.monotonic() - began
        counts = _pytest_counts(output)
        progress(f"{step}: exit status {status}, {counts or 'no summary'} "
                 f"({timings[step]:.0f} s)")
        if status != 0:
            failed = True
            # The release's own tests may have passed (and written their count) while another
            # L1 test failed.
            own = _l1_numbers(results, report.cell_name) \
                if step == "L1" and _l1_result(results, report.cell_name) else ""
            parts.append(f"{step} failed: {_first_failure(output, status)}"
                         + (f" ({own.removeprefix('L1 ')} in the release's own tests)"
                            if own else ""))
        elif step == "L1":
            parts.append(_l1_numbers(results, report.cell_name))
        else:
            parts.append(f"{step} passed ({counts})" if counts else f"{step} passed")
    if not with_l1:
        parts.append("L1 not run (--no-l1)")
    outcome = "; ".join(parts) + (f"; see {PROOF_LOG}" if failed else "")
    measured = None if failed else _l1_measured(results, report.cell_name)
    return ProofOutcome(outcome, timings, measured, failed)


def _pytest_counts(output: str) -> str:
    """pytest's closing count (``12 passed, 3 skipped``), or ""."""
    for line in reversed(output.splitlines()):
        if _SUMMARY.search(line):
            return re.sub(r"\s+in [\d.]+s.*$", "", line.strip(" =")).strip()
    return ""


def _first_failure(output: str, status: int) -> str:
    for line in output.splitlines():
        found = _FAILED.match(line)
        if found:
            return found.group(1)
    if status == 5:
        return "no test ran"
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
    return f"exit status {status}" + (f": {last}" if last else "")


def _l1_result(results: Path, cell: str) -> dict[str, object] | None:
    path = results / f"l1-{cell}.json"
    if not path.is_file():
        return None
    loaded = json.loads(path.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else None


def _l1_measured(results: Path, cell: str) -> int | None:
    found = _l1_result(results, cell)
    value = found.get("patched_passed") if found else None
    return value if isinstance(value, int) and value >= 1 else None


def _l1_numbers(results: Path, cell: str) -> str:
    """``L1 533/588 on both trees`` (vLLM: stock and patched sdist trees), ``L1 15 passed in
    the patched engine's venv`` (SGLang), from the count the L1 test wrote."""
    found = _l1_result(results, cell)
    if found is None:
        return "L1 passed but wrote no count (was its test skipped?)"
    patched, stock, collected = (found.get("patched_passed"), found.get("stock_passed"),
                                 found.get("collected"))
    of = f"/{collected}" if isinstance(collected, int) else ""
    if stock is None:
        return f"L1 {patched}{of} passed in the patched engine's venv"
    if stock == patched:
        return f"L1 {patched}{of} on both trees"
    return f"L1 {patched}{of} on the patched tree, {stock} on the stock tree"


def with_l1_floor(entry: str, floor: int, note: str = "") -> str:
    """The matrix entry with its ``[cell.proof]`` ``l1_min_passed`` set to ``floor`` and
    ``note`` after it (a TOML comment); the entry is the one :func:`matrix_entry` writes: one
    such line, or none without a proof."""
    return re.sub(r"(?m)^l1_min_passed = \d+.*$", f"l1_min_passed = {floor}{note}", entry,
                  count=1)
