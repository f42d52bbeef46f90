"""The check: every required seam's variants on the release, the choice per seam, the proposed
experimental matrix entry."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from packaging.version import Version

from codemods.base import BuildContext
from forge import TOOLKIT_VERSION
from forge.errors import ForgeError, MatrixError
from forge.fetch import fetch_artifact
from forge.matrix import Artifact, Cell, Matrix, parse_matrix
from forge.registry import Registry, Transform
from forge.transforms import select_transforms
from forge.upgrade.guide import SeamGuide, file_stats, guide_seam
from forge.upgrade.release import (
    Progress,
    extract_sources,
    nearest_cell,
    quiet,
    resolve_release,
    wheel_metadata,
)
from forge.upgrade.report import Outcome, SeamRow, UpgradeReport, default_out_dir, write_report
from forge.upgrade.trial import CommandRunner, run_cell_proofs, trial_build, with_l1_floor
from forge.upgrade.variants import (
    APPLIED,
    RANK,
    SAME_CHANGE,
    WORKING,
    ParseCache,
    VariantResult,
    all_diffs,
    compare_with_reviewed,
    try_variant,
)

# --- the check ------------------------------------------------------------------------------


def _series_for(matrix: Matrix, engine: str, version: str) -> str:
    """As many version parts as the matrix declares for the engine ([engine.<name>]
    series_parts): the same release always gets the same cell name."""
    return matrix.series_for(engine, version)


def _reviewed_diffs(registry: Registry, cell: Cell) -> dict[str, str]:
    folder = registry.patches_root / cell.engine / cell.series / "reviewed"
    if not folder.is_dir():
        return {}
    return {path.stem: path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.diff"))}


def _choose(seam: str, variants: list[VariantResult], nearest_id: str | None = None) -> SeamRow:
    """The one working variant of a seam, or why there is none: the nearest cell's variant
    first (the one a new variant most likely starts from), else the best-ranked one."""
    tried = [f"{v.id}: {v.result}" for v in variants]
    if not variants:
        return SeamRow(seam, None, "no transform registered", tried)
    working = [v for v in variants if v.result in WORKING]
    same = [v for v in working if v.result == SAME_CHANGE]
    if len(working) == 1 or len(same) == 1:
        chosen = same[0] if same else working[0]
        # The registry's range is a reviewed word on this release: a variant outside it is not
        # chosen over one inside it, however much its change looks like the nearest cell's.
        if chosen.in_range or not any(v.in_range for v in working):
            return SeamRow(seam, chosen.id, chosen.result, tried)
    if working:
        in_range = [v.id for v in working if v.in_range]
        hint = f"; the registry's range for this release holds {in_range[0]}" \
            if len(in_range) == 1 else ""
        return SeamRow(seam, None, "ambiguous", tried,
                       f"{len(working)} variants work: {', '.join(v.id for v in working)}{hint}")
    nearest = next((v for v in variants if v.id == nearest_id), None)
    if nearest is not None:
        return SeamRow(seam, None, "no working variant", tried,
                       f"the nearest cell's {nearest.id}: {nearest.result}"
                       + (f": {nearest.detail}" if nearest.detail else ""))
    best = max(variants, key=lambda v: RANK[v.result])
    return SeamRow(seam, None, "no working variant", tried,
                   f"best: {best.id} {best.result}" + (f": {best.detail}" if best.detail else ""))


def _outcome(*, resolved: bool, existing: Cell | None, version: str) -> Outcome:
    """Before any trial build: proposed, already a cell (this very release), or not
    proposable (a seam without exactly one working variant, or a series that is another
    release's cell, which a person must move)."""
    if resolved and existing is None:
        return Outcome.PROPOSED
    if resolved and existing is not None and Version(existing.version) == Version(version):
        return Outcome.ALREADY_A_CELL
    return Outcome.NOT_PROPOSABLE


def _nearest_variants(registry: Registry, nearest: Cell) -> dict[str, Transform]:
    """Seam -> the transform the nearest cell covers it with."""
    try:
        transforms = select_transforms(registry, nearest)
    except ForgeError:  # a matrix cell resolves (check-matrix); a report never stops on it
        return {}
    return {seam: t for t in transforms for seam in t.seams}


def _guides(*, unresolved: Sequence[str], nearest: Cell, nearest_by_seam: Mapping[str, Transform],
            candidates: Sequence[Transform], variants: Sequence[VariantResult], engine: str,
            release_archive: Path, version: str, index_url: str, cache_dir: Path,
            progress: Progress) -> list[SeamGuide]:
    """Per unresolved seam, what guide.py finds: the nearest cell's variant run on the nearest
    cell's own sources (what it rewrote there), searched for in the whole release."""
    if not unresolved:
        return []
    role = "sdist" if nearest.artifact("sdist") is not None else "wheel"
    artifact = nearest.artifact(role)
    if artifact is None:
        return []
    nearest_archive = fetch_artifact(artifact, index_url=index_url, cache_dir=cache_dir,
                                     progress=progress)
    by_id = {v.id: v for v in variants}
    guides: list[SeamGuide] = []
    with tempfile.TemporaryDirectory(prefix="kvcached-upgrade-guide-") as scratch:
        old_tree, new_tree = Path(scratch) / "nearest", Path(scratch) / "release"
        seam_paths = {seam: sorted({path for t in candidates if seam in t.seams
                                    for path in t.target_paths(engine)})
                      for seam in unresolved}
        wanted = {path for paths in seam_paths.values() for path in paths}
        if extract_sources(nearest_archive, engine, old_tree, only=wanted) == 0 and \
                nearest.artifact("wheel") is not None and role == "sdist":
            wheel = nearest.artifact("wheel")
            assert wheel is not None
            extract_sources(fetch_artifact(wheel, index_url=index_url, cache_dir=cache_dir,
                                           progress=progress), engine, old_tree, only=wanted)
        progress(f"guide: searching {engine} {version} for the code of "
                 f"{', '.join(unresolved)}")
        extract_sources(release_archive, engine, new_tree)
        build = BuildContext(
            cell=nearest.name, engine=engine, package=engine, upstream_version=nearest.version,
            built_version=f"{nearest.version}+kvcached.{nearest.build}",
            base_artifact=str(artifact.filename), base_sha256=str(artifact.sha256),
            transform_ids=(), fingerprint="0" * 64, toolkit_version=TOOLKIT_VERSION)
        for seam in unresolved:
            transform = nearest_by_seam.get(seam)
            if transform is None:
                guides.append(SeamGuide(seam, "-", f"{nearest.name} has no variant of it", "-",
                                        file_stats=file_stats(seam_paths[seam], old_tree,
                                                              new_tree, version)))
                continue
            on_release = by_id.get(transform.id)
            result = (f"{on_release.result}" + (f": {on_release.detail}"
                                                 if on_release.detail else "")
                      if on_release else "not tried")
            own = try_variant(transform, old_tree, build)
            guides.append(guide_seam(
                seam=seam, nearest_variant=transform.id, nearest_result=result,
                anchor=transform.anchor.replace("{package}", engine), nearest_diff=own.diff,
                target_paths=transform.target_paths(engine), seam_paths=seam_paths[seam],
                nearest_sources=old_tree, release_sources=new_tree, version=version))
    return guides


def run_upgrade_check(*, matrix: Matrix, registry: Registry, engine: str, requested: str,
                      index_url: str, cache_dir: Path, out_dir: Path | None = None,
                      write_cell: bool = False, build_wheels: bool = True,
                      skip_l1: bool = False, progress: Progress = quiet,
                      proof_runner: CommandRunner | None = None) -> UpgradeReport:
    """The whole check; ForgeError (one line) only for bad input: an unknown engine or
    version, an index that does not answer, an artifact whose hash is not the index's.
    ``proof_runner`` runs the L0/L1 suites (default: :func:`run_proof_command`)."""
    timings: dict[str, float] = {}
    started = time.monotonic()
    if not any(c.engine == engine for c in matrix.cells):
        nearest_cell(matrix, engine, "0")  # raises the one-line error naming the engines
    release = resolve_release(index_url, engine, requested, None, progress)
    nearest = nearest_cell(matrix, engine, release.version)
    release = resolve_release(index_url, engine, release.version, nearest)
    progress(f"{engine} {release.version}: nearest cell {nearest.name} ({nearest.version}); "
             f"artifacts {', '.join(str(a.filename) for a in release.artifacts)}")
    paths: dict[str, Path] = {}
    for artifact in release.artifacts:
        paths[artifact.role] = fetch_artifact(artifact, index_url=index_url,
                                              cache_dir=cache_dir, progress=progress)
    timings["fetch"] = time.monotonic() - started

    checked = time.monotonic()
    source_role = "sdist" if "sdist" in paths else "wheel"
    source_note = "" if source_role == "sdist" else " (the release has no sdist)"
    source_artifact = release.artifact(source_role)
    assert source_artifact is not None and source_artifact.filename and source_artifact.sha256
    python, torch = wheel_metadata(paths["wheel"])
    series = _series_for(matrix, engine, release.version)
    cell_name = f"{engine}-{series}"
    build = BuildContext(
        cell=cell_name, engine=engine, package=engine, upstream_version=release.version,
        built_version=f"{release.version}+kvcached.1", base_artifact=source_artifact.filename,
        base_sha256=source_artifact.sha256, transform_ids=(), fingerprint="0" * 64,
        toolkit_version=TOOLKIT_VERSION)
    reviewed = _reviewed_diffs(registry, nearest)
    required = registry.required_for(engine, release.version)
    candidates = [t for t in [*registry.codemods, *all_diffs(registry, engine)]
                  if t.engine in ("*", engine) and any(s in required for s in t.seams)]
    variants: list[VariantResult] = []
    with tempfile.TemporaryDirectory(prefix="kvcached-upgrade-") as scratch:
        sources = Path(scratch)
        # Only the files some variant targets: the rest of the tree is never read.
        targets = {path for t in candidates for path in t.target_paths(engine)}
        progress(f"sources: extracting {len(targets)} target files from "
                 f"{source_artifact.filename}")
        count = extract_sources(paths[source_role], engine, sources, only=targets)
        if count == 0 and source_role == "sdist":
            # An sdist laid out otherwise (package below src/ or python/): the wheel's files.
            source_role, source_note = "wheel", " (no target file in the sdist)"
            source_artifact = release.artifact("wheel")
            assert source_artifact is not None
            progress(f"sources: none in the sdist; extracting from {source_artifact.filename}")
            count = extract_sources(paths["wheel"], engine, sources, only=targets)
        progress(f"sources: {count} of them present; trying {len(candidates)} transform "
                 "variants")
        parsed: ParseCache = {}
        for transform in candidates:
            variant = try_variant(transform, sources, build, parsed)
            variant.same_change = compare_with_reviewed(variant, reviewed)
            if variant.result == APPLIED and variant.same_change == "same":
                variant.result = SAME_CHANGE
            progress(f"  {variant.id}: {variant.result} ({variant.hits}/{variant.expected})"
                     + (f": {variant.detail}" if variant.detail else ""))
            variants.append(variant)
    nearest_by_seam = _nearest_variants(registry, nearest)
    seams = [_choose(seam, [v for v in variants if seam in v.seams],
                     getattr(nearest_by_seam.get(seam), "id", None)) for seam in required]
    chosen_ids = list(dict.fromkeys(row.chosen for row in seams if row.chosen))
    conflicts = _conflicts(seams, {v.id: v for v in variants})
    unresolved = [row.seam for row in seams if row.chosen is None]
    existing = next((c for c in matrix.cells
                     if c.engine == engine and Version(c.version) == Version(release.version)),
                    None)
    # One cell per series: another release of a series that is a cell moves that cell.
    series_cell = next((c for c in matrix.cells if c.name == cell_name), None)
    if unresolved:
        verdict = f"seams without exactly one working variant: {', '.join(unresolved)}"
    elif conflicts:
        verdict = conflicts
    elif existing is not None:
        verdict = (f"every required seam has one working variant; {engine} {release.version} "
                   f"is already cell {existing.name}, so no cell is proposed")
    elif series_cell is not None:
        existing = series_cell
        verdict = (f"every required seam has one working variant; series {series} is already "
                   f"cell {cell_name} ({series_cell.version}), so no cell is proposed: move "
                   f"that cell to {release.version}, or declare more series parts for "
                   f"{engine} ([engine.{engine}] series_parts)")
    else:
        verdict = (f"every required seam has one working variant "
                   f"({len(chosen_ids)} transforms); the cell is experimental until reviewed")
    timings["check"] = time.monotonic() - checked
    guided = time.monotonic()
    guides = _guides(unresolved=unresolved, nearest=nearest, nearest_by_seam=nearest_by_seam,
                     candidates=candidates, variants=variants, engine=engine,
                     release_archive=paths[source_role], version=release.version,
                     index_url=index_url, cache_dir=cache_dir, progress=progress)
    if guides:
        timings["guide"] = time.monotonic() - guided

    report = UpgradeReport(
        engine=engine, version=release.version, nearest_cell=nearest.name,
        nearest_version=nearest.version, index_url=index_url,
        sources=f"{source_role} {source_artifact.filename}{source_note}",
        artifacts=[{"role": a.role, "filename": str(a.filename), "sha256": str(a.sha256)}
                   for a in release.artifacts],
        python=python, torch=torch, seams=seams, variants=variants,
        cell_proposed=not unresolved and not conflicts and existing is None,
        cell_name=cell_name, verdict=verdict, guides=guides,
        outcome=_outcome(resolved=not unresolved and not conflicts, existing=existing,
                         version=release.version),
        import_mode="AST only (each patched module imports kvcached_core and uses it); a real "
                    f"import needs {engine}'s dependencies (torch, CUDA), which the check does "
                    "not install")
    out_dir = out_dir or default_out_dir(engine, release.version)
    out_dir.mkdir(parents=True, exist_ok=True)
    unreviewed = out_dir / "unreviewed"
    shutil.rmtree(unreviewed, ignore_errors=True)
    for variant in variants:
        if variant.diff:
            unreviewed.mkdir(exist_ok=True)
            (unreviewed / f"{variant.id}.diff").write_text(variant.diff, encoding="utf-8")
    (out_dir / "matrix-entry.toml").unlink(missing_ok=True)
    if report.cell_proposed:
        report.matrix_entry = matrix_entry(
            engine=engine, series=series, version=release.version, python=python,
            torch=torch, artifacts=release.artifacts, nearest=nearest, seams=seams,
            requested=requested)
        _validate_entry(matrix, report.matrix_entry)
        (out_dir / "matrix-entry.toml").write_text(report.matrix_entry, encoding="utf-8")
    report.build, report.l0_l1 = _build_verdict(report, write_cell)
    if report.cell_proposed and build_wheels:
        built = time.monotonic()
        report.build, wheels = trial_build(
            matrix=matrix, registry=registry, report=report, chosen=chosen_ids,
            cache_dir=cache_dir, index_url=index_url, out_dir=out_dir, progress=progress)
        timings["trial build"] = time.monotonic() - built
        if wheels is None:
            report.l0_l1 = "not run: the trial build made no wheels"
            if report.build.startswith("failed"):
                report.outcome = Outcome.PROOF_FAILED
        else:
            proofs = run_cell_proofs(report=report, out_dir=out_dir, wheels=wheels,
                                     cache_dir=cache_dir, index_url=index_url,
                                     with_l1=not skip_l1, runner=proof_runner,
                                     progress=progress)
            report.l0_l1 = proofs.outcome
            timings.update(proofs.timings)
            if proofs.failed:
                report.outcome = Outcome.PROOF_FAILED
            if proofs.l1_patched_passed:
                report.matrix_entry = with_l1_floor(
                    report.matrix_entry, proofs.l1_patched_passed,
                    "  # measured: the upgrade check's L1 on the trial build")
                _validate_entry(matrix, report.matrix_entry)
                (out_dir / "matrix-entry.toml").write_text(report.matrix_entry,
                                                           encoding="utf-8")
    if report.cell_proposed and write_cell:
        # After the proofs: the entry carries the measured L1 floor when they ran.
        with matrix.path.open("a", encoding="utf-8") as handle:
            handle.write("\n" + report.matrix_entry)
        report.cell_written = True
        progress(f"appended experimental cell {cell_name} to {matrix.path}")
    report.timings = {name: round(seconds, 2) for name, seconds in timings.items()}
    report.timings["total"] = round(time.monotonic() - started, 2)
    write_report(report, out_dir)
    return report


def _build_verdict(report: UpgradeReport, write_cell: bool) -> tuple[str, str]:
    """What the build and the L0/L1 proofs did not do, and why (replaced by what they did when
    they run)."""
    if not report.cell_proposed:
        return ("skipped: no cell proposed", "skipped: no cell proposed")
    how = (f"after review (widen the chosen transforms' ranges, `python -m forge approve-diff "
           f"{report.cell_name}`): `nox -s build-{report.cell_name} test-{report.cell_name}`")
    where = "" if write_cell else " (the cell is in matrix-entry.toml only; --write-cell)"
    return (f"skipped (--no-build){where}; {how}",
            "not run: the proofs run on the trial build, which --no-build leaves out")


def _conflicts(seams: list[SeamRow], variants: Mapping[str, VariantResult]) -> str:
    """A chosen variant that covers a seam another chosen variant was chosen for."""
    chosen_for = {row.seam: row.chosen for row in seams if row.chosen}
    for row in seams:
        if row.chosen is None:
            continue
        for seam in variants[row.chosen].seams:
            other = chosen_for.get(seam)
            if other is not None and other != row.chosen:
                return f"seam {seam}: {row.chosen} and {other} both cover it"
    return ""


# --- the experimental matrix entry ------------------------------------------------------------


def _toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid TOML basic string


def matrix_entry(*, engine: str, series: str, version: str, python: str | None,
                 torch: str | None, artifacts: Iterable[Artifact], nearest: Cell,
                 seams: list[SeamRow], requested: str) -> str:
    """The ``[[cell]]`` text of the proposed experimental cell, with the chosen transform per
    seam in its comment (the schema has no field for it: the registry decides a cell's set)."""
    today = dt.date.today().isoformat()
    reason = (f"upgrade-check: the transforms of {nearest.name} apply; diffs unreviewed, "
              "registry ranges not widened")
    lines = [
        f"# Experimental: proposed by `python -m forge upgrade-check {engine} {requested}` on "
        f"{today}.",
        "# Chosen transform per seam (registry ranges NOT widened; diffs unreviewed):",
        *(f"#   {row.seam}: {row.chosen} ({row.result})" for row in seams),
        f"# test_pins and proof are the nearest cell's ({nearest.name}); l1_min_passed is "
        "its floor until L1 runs on this release.",
        "[[cell]]",
        f"engine = {_toml_string(engine)}",
        f"series = {_toml_string(series)}",
        f"version = {_toml_string(version)}",
        "build = 1",
        f"python = {_toml_string(python or nearest.python)}",
        f"torch = {_toml_string(torch or nearest.torch)}",
        'status = "experimental"',
        f"reason = {_toml_string(reason)}",
    ]
    if nearest.test_pins:
        pins = ", ".join(f"{name} = {_toml_string(pin)}"
                         for name, pin in nearest.test_pins.items())
        lines.append(f"test_pins = {{ {pins} }}")
    proof = nearest.proof
    if proof is not None:
        lines += ["", "[cell.proof]", f"torch = {_toml_string(proof.torch)}",
                  f"l1_tests = [{', '.join(_toml_string(t) for t in proof.l1_tests)}]",
                  f"l1_min_passed = {proof.l1_min_passed}"]
        if proof.block_pool_args is not None:
            lines.append(f"block_pool_args = {_toml_string(proof.block_pool_args)}")
        if proof.kv_manager is not None:
            lines += ["", "[cell.proof.kv_manager]",
                      f"setup = {_toml_string(proof.kv_manager.setup)}",
                      f"manager = {_toml_string(proof.kv_manager.manager)}",
                      f"request = {_toml_string(proof.kv_manager.request)}"]
    for artifact in artifacts:
        lines += ["", "[[cell.artifact]]", f"role = {_toml_string(artifact.role)}",
                  f"filename = {_toml_string(str(artifact.filename))}",
                  f"sha256 = {_toml_string(str(artifact.sha256))}"]
    return "\n".join(lines) + "\n"


def _validate_entry(matrix: Matrix, entry: str) -> None:
    """The matrix with the entry appended must still load (schema, names, artifacts)."""
    import tomllib

    text = matrix.path.read_text(encoding="utf-8") + "\n" + entry
    try:
        parse_matrix(tomllib.loads(text), matrix.path)
    except (tomllib.TOMLDecodeError, MatrixError) as exc:
        raise ForgeError(f"the proposed matrix entry does not validate: {exc}") from None
