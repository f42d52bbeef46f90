"""Upgrade check: what the registered transforms make of an upstream release the matrix lacks.

``python -m forge upgrade-check <engine> <version|latest>`` resolves the release's artifacts
from the index (sha256 from the index), fetches them into the cache, and tries, for every seam
the engine requires, every registered transform of that seam regardless of its version range,
each on the release's pristine sources. Every seam gets a row; a failing transform never stops
the report. When every required seam has exactly one working transform, the check proposes an
``experimental`` matrix entry (``<out>/matrix-entry.toml``) with the unreviewed diffs beside it
(``<out>/unreviewed/``); only ``--write-cell`` appends the entry to matrix.toml. The registry's
version ranges are never widened here, and unreviewed diffs never go to
``patches/<engine>/<series>/reviewed/``: widening a range and approving a diff stay a review.

``python -m forge upgrade-scan`` lists the final releases on the index newer than each engine's
newest cell.
"""

from __future__ import annotations

import ast
import datetime as dt
import difflib
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import libcst
from libcst.codemod import CodemodContext, SkipFile
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from codemods.base import BuildContext
from forge import TOOLKIT_VERSION
from forge.errors import FetchError, ForgeError, MatrixError
from forge.fetch import CACHE_ENV, INDEX_URL_ENV, IndexFile, fetch_artifact, project_files
from forge.matrix import Artifact, Cell, Matrix, parse_matrix
from forge.patches import diff_body
from forge.registry import Kind, Registry, Transform
from forge.trial import PROOF_TRIAL_ENV, trial_matrix_path, trial_registry, write_trial

Progress = Callable[[str], None]

# Per-variant results, best first.
SAME_CHANGE = "same change"
APPLIED = "applied"
PARTIAL = "partial"
ALREADY = "already applied"
NOT_FOUND = "not found"
ERROR = "error"
_RANK = {SAME_CHANGE: 4, APPLIED: 3, PARTIAL: 2, ALREADY: 1, NOT_FOUND: 0, ERROR: 0}
_WORKING = (SAME_CHANGE, APPLIED)
_KVCACHED_MODULE = "kvcached_core"


def _quiet(_line: str) -> None:
    return None


# --- the release on the index -----------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    engine: str
    version: str
    artifacts: tuple[Artifact, ...]   # wheel, then cpu-wheel and sdist where the index has them

    def artifact(self, role: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.role == role), None)


def final_versions(files: Mapping[str, IndexFile], distribution: str) -> list[Version]:
    """The final (no pre-, dev- or local) releases of ``distribution`` among ``files``,
    ascending; yanked files do not count."""
    found: set[Version] = set()
    for name, entry in files.items():
        version = _file_version(name, distribution)
        if version is not None and not entry.yanked and not (
                version.is_prerelease or version.is_devrelease or version.local):
            found.add(version)
    return sorted(found)


def _file_version(filename: str, distribution: str) -> Version | None:
    try:
        if filename.endswith(".whl"):
            name, version, _build, _tags = parse_wheel_filename(filename)
        elif filename.endswith((".tar.gz", ".zip")):
            name, version = parse_sdist_filename(filename)
        else:
            return None
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None
    return version if canonicalize_name(name) == canonicalize_name(distribution) else None


def _pick_wheel(files: Mapping[str, IndexFile], distribution: str, version: Version,
                preferred: str | None) -> tuple[str, IndexFile] | None:
    """The Linux x86_64 (or pure) wheel of ``version``: the nearest cell's tags first, then its
    Python tag, then abi3."""
    candidates: list[tuple[tuple[int, int, int, str], str, IndexFile]] = []
    preferred_tags = preferred.removesuffix(".whl").split("-", 2)[-1] if preferred else ""
    preferred_python = preferred_tags.split("-", 1)[0]
    for name, entry in files.items():
        if entry.yanked or not name.endswith(".whl") or \
                _file_version(name, distribution) != version:
            continue
        tags = name.removesuffix(".whl").split("-", 2)[-1]
        platform = tags.rsplit("-", 1)[-1]
        if platform != "any" and not ("linux" in platform and "x86_64" in platform):
            continue
        key = (0 if tags == preferred_tags else 1,
               0 if tags.split("-", 1)[0] == preferred_python else 1,
               0 if "abi3" in tags else 1, name)
        candidates.append((key, name, entry))
    if not candidates:
        return None
    _, name, entry = min(candidates)
    return name, entry


def resolve_release(index_url: str, engine: str, requested: str, nearest: Cell | None,
                    progress: Progress = _quiet) -> Release:
    """The artifacts of ``engine`` ``requested`` (an exact version or ``latest``) on the index,
    each with the index's sha256; FetchError naming what is missing."""
    progress(f"index {index_url}: reading project {engine}")
    files = project_files(index_url, engine)
    versions = final_versions(files, engine)
    if requested == "latest":
        if not versions:
            raise FetchError(f"index {index_url} lists no final release of {engine}")
        version = versions[-1]
    else:
        try:
            version = Version(requested)
        except InvalidVersion:
            raise FetchError(f"{requested!r} is not a version (give one like 0.33.0, or "
                             "'latest')") from None
        if version not in {Version(str(v)) for v in _all_versions(files, engine)}:
            newest = f"; newest final release: {versions[-1]}" if versions else ""
            raise FetchError(f"{engine} {requested} does not exist on {index_url}{newest}")

    artifacts: list[Artifact] = []
    preferred = nearest.artifact("wheel") if nearest else None
    wheel = _pick_wheel(files, engine, version, preferred.filename if preferred else None)
    if wheel is not None:
        artifacts.append(_artifact("wheel", *wheel))
    cpu = nearest.artifact("cpu-wheel") if nearest else None
    if cpu is not None:
        cpu_distribution = cpu.distribution
        try:
            cpu_files = project_files(index_url, cpu_distribution)
        except FetchError as exc:
            if "has no project" not in str(exc):
                raise
            cpu_files = {}
        cpu_wheel = _pick_wheel(cpu_files, cpu_distribution, version, cpu.filename)
        if cpu_wheel is not None:
            artifacts.append(_artifact("cpu-wheel", *cpu_wheel))
    sdist = next(((name, entry) for name, entry in sorted(files.items())
                  if not entry.yanked and name.endswith(".tar.gz")
                  and _file_version(name, engine) == version), None)
    if sdist is not None:
        artifacts.append(_artifact("sdist", *sdist))
    if not any(a.role == "wheel" for a in artifacts):
        raise FetchError(f"{engine} {version} on {index_url} has no Linux x86_64 wheel")
    return Release(engine=engine, version=str(version), artifacts=tuple(artifacts))


def _all_versions(files: Mapping[str, IndexFile], distribution: str) -> set[Version]:
    return {v for v in (_file_version(name, distribution) for name in files) if v is not None}


def _artifact(role: str, filename: str, entry: IndexFile) -> Artifact:
    if not entry.sha256:
        raise FetchError(f"the index gives no sha256 for {filename} ({entry.url}): cannot "
                         "verify it")
    return Artifact(role=role, filename=filename, sha256=entry.sha256)


def nearest_cell(matrix: Matrix, engine: str, version: str) -> Cell:
    """Same engine, the nearest version at or below ``version``; else the nearest above."""
    cells = [c for c in matrix.cells if c.engine == engine]
    if not cells:
        known = ", ".join(sorted({c.engine for c in matrix.cells})) or "none"
        raise MatrixError(f"engine {engine!r} has no cell in {matrix.path.name} (engines: "
                          f"{known})")
    target = Version(version)
    below = [c for c in cells if Version(c.version) <= target]
    if below:
        return max(below, key=lambda c: Version(c.version))
    return min(cells, key=lambda c: Version(c.version))


# --- the release's sources --------------------------------------------------------------------


def extract_sources(path: Path, package: str, dest: Path,
                    only: Iterable[str] | None = None) -> int:
    """Write the ``.py`` files of ``package`` from a wheel or an sdist to ``dest/<package>/``
    (only the paths in ``only`` when given); returns how many. An sdist's package directory is
    the one under its top folder."""
    wanted = None if only is None else set(only)

    def selected(relative: str) -> bool:
        if wanted is not None:
            return relative in wanted
        return relative.startswith(f"{package}/") and relative.endswith(".py")

    count = 0
    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path) as wheel:
            for info in wheel.infolist():
                if not info.is_dir() and selected(info.filename):
                    count += _write_member(dest, info.filename, wheel.read(info))
        return count
    with tarfile.open(path, "r:*") as archive:
        for member in archive:
            parts = member.name.split("/", 1)
            if len(parts) == 2 and member.isfile() and selected(parts[1]):
                handle = archive.extractfile(member)
                if handle is not None:
                    count += _write_member(dest, parts[1], handle.read())
    return count


def _write_member(dest: Path, relative: str, data: bytes) -> int:
    if relative.startswith("/") or ".." in relative.split("/"):
        return 0  # never write outside dest, whatever the archive says
    target = dest / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return 1


def wheel_metadata(path: Path) -> tuple[str | None, str | None]:
    """(Requires-Python, the torch it requires) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as archive:
        name = next((n for n in archive.namelist()
                     if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
        if name is None:
            return None, None
        text = archive.read(name).decode("utf-8", "replace")
    message = email.parser.Parser().parsestr(text, headersonly=True)
    torch: str | None = None
    for line in message.get_all("Requires-Dist") or []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(requirement.name) != "torch":
            continue
        if requirement.marker is not None and not requirement.marker.evaluate(
                {"platform_machine": "x86_64", "sys_platform": "linux",
                 "platform_system": "Linux", "extra": ""}):
            continue
        pins = [s.version for s in requirement.specifier if s.operator == "=="]
        torch = pins[0] if pins else str(requirement.specifier) or None
        break
    return message.get("Requires-Python"), torch


# --- one transform variant on the pristine sources --------------------------------------------


@dataclass
class VariantResult:
    id: str
    kind: str
    seams: tuple[str, ...]
    registered_range: str
    in_range: bool                    # the registry's range holds this release
    result: str
    hits: int
    expected: str
    anchor: str
    detail: str = ""
    compile_check: str = "-"
    import_check: str = "-"
    same_change: str = "-"
    files: tuple[str, ...] = ()
    diff: str = field(default="", repr=False)


ParseCache = dict[str, libcst.Module]


def try_variant(transform: Transform, sources: Path, build: BuildContext,
                parsed: ParseCache | None = None) -> VariantResult:
    """Apply one transform to the pristine ``sources``; never raises for a fault of the
    transform or the sources: the fault is the result. ``parsed`` keeps each file's syntax tree
    for the next variant (trees are immutable; a codemod works on its own copy): parsing the
    largest modules dominates the check."""
    result = VariantResult(
        id=transform.id, kind=str(transform.kind), seams=transform.seams,
        registered_range=str(transform.versions) or "any",
        in_range=Version(build.upstream_version) in transform.versions, result=ERROR, hits=0,
        expected=str(transform.expected_hits),
        anchor=transform.anchor.replace("{package}", build.package))
    try:
        if transform.kind is Kind.CODEMOD:
            changed = _codemod_changes(transform, sources, build, result,
                                       {} if parsed is None else parsed)
        else:
            changed = _diff_changes(transform, sources, build, result)
    except Exception as exc:  # noqa: BLE001 - a broken transform is a row of the report
        result.result, result.detail = ERROR, f"{type(exc).__name__}: {exc}"
        return result
    if changed is None:
        return result
    result.files = tuple(sorted(changed))
    result.diff = unified_diff(changed)
    result.compile_check = _compile_check(changed)
    result.import_check = _kvcached_use_check(changed)
    return result


def _codemod_changes(transform: Transform, sources: Path, build: BuildContext,
                     result: VariantResult, parsed: ParseCache
                     ) -> dict[str, tuple[str, str]] | None:
    assert transform.codemod is not None
    hits = already = 0
    missing: list[str] = []
    changed: dict[str, tuple[str, str]] = {}
    for relative in transform.target_paths(build.package):
        path = sources / relative
        if path.is_file():
            source = path.read_text(encoding="utf-8")
        elif transform.codemod.creates_file:
            source = ""
        else:
            missing.append(relative)
            continue
        module = relative.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        context = CodemodContext(filename=relative, full_module_name=module,
                                 full_package_name=module.rpartition(".")[0])
        command = transform.codemod(context, build)
        try:
            if relative not in parsed:
                parsed[relative] = libcst.parse_module(source)
            code = command.transform_module(parsed[relative]).code
        except SkipFile:
            already += max(command.already_applied, 1)
            continue
        except Exception as exc:  # noqa: BLE001 - as libcst's transform_module reports it
            result.result, result.detail = ERROR, f"{relative}: codemod failed: {exc!r}"
            return None
        hits += command.hits
        already += command.already_applied
        if command.hits and code != source:
            changed[relative] = (source, code)
    result.hits = hits
    if missing and not hits:
        result.result = NOT_FOUND
        result.detail = f"target file missing: {', '.join(missing)}"
        return None
    if hits == 0:
        result.result = ALREADY if already else NOT_FOUND
        result.detail = ("the release already has the change" if already
                         else f"anchor not found: {result.anchor}")
        return None
    if hits not in transform.expected_hits or missing or not changed:
        result.result = PARTIAL
        reasons = [f"found {hits}, expected {transform.expected_hits}; anchor {result.anchor}"]
        if missing:
            reasons.append(f"target file missing: {', '.join(missing)}")
        if not changed:
            reasons.append("hits counted but no file changed")
        result.detail = "; ".join(reasons)
        return changed or None
    result.result = APPLIED
    return changed


def _diff_changes(transform: Transform, sources: Path, build: BuildContext,
                  result: VariantResult) -> dict[str, tuple[str, str]] | None:
    """``git apply`` with zero fuzz on a scratch copy of the diff's target files."""
    assert transform.patch is not None
    with tempfile.TemporaryDirectory(prefix="kvcached-upgrade-diff-") as scratch:
        root = Path(scratch)
        before: dict[str, str] = {}
        for relative in transform.targets:
            source = sources / relative
            if source.is_file():
                before[relative] = source.read_text(encoding="utf-8")
                (root / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, root / relative)
        patch = root / ".transform.patch"
        patch.write_text(diff_body(transform.patch.path.read_text(encoding="utf-8")),
                         encoding="utf-8")
        done = subprocess.run(["git", "apply", "-v", str(patch)], cwd=root, capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            errors = [line.removeprefix("error: ") for line in done.stderr.splitlines()
                      if line.startswith("error: ")]
            result.result = NOT_FOUND
            result.detail = f"does not apply with zero fuzz: {errors[0] if errors else 'error'}"
            return None
        changed = {}
        for relative in transform.targets:
            after = root / relative
            text = after.read_text(encoding="utf-8") if after.is_file() else ""
            if text != before.get(relative, ""):
                changed[relative] = (before.get(relative, ""), text)
    result.hits = transform.patch.hunks
    result.result = APPLIED
    return changed


def unified_diff(changed: Mapping[str, tuple[str, str]]) -> str:
    """A git-style diff of ``{path: (before, after)}``, files in path order."""
    chunks: list[str] = []
    for relative in sorted(changed):
        before, after = changed[relative]
        lines = list(difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True),
            fromfile=f"a/{relative}" if before else "/dev/null", tofile=f"b/{relative}"))
        if not lines:
            continue
        header = f"diff --git a/{relative} b/{relative}\n"
        if not before:
            header += "new file mode 100644\n"
        chunks.append(header + "".join(line if line.endswith("\n") else line + "\n"
                                       for line in lines))
    return "".join(chunks)


def _compile_check(changed: Mapping[str, tuple[str, str]]) -> str:
    for relative, (_before, after) in sorted(changed.items()):
        if not relative.endswith(".py"):
            continue
        try:
            compile(after, relative, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            return f"fails: {relative}:{getattr(exc, 'lineno', '?')}: {exc}"
    return "ok"


def _kvcached_use_check(changed: Mapping[str, tuple[str, str]]) -> str:
    """AST level: each patched module imports from kvcached_core and uses what it imported.

    A real import of the patched module needs the engine's own dependencies (torch, CUDA
    libraries), which the check does not install; this is the part that can be checked
    without them."""
    uses: list[str] = []
    for relative, (_before, after) in sorted(changed.items()):
        if not relative.endswith(".py"):
            continue
        try:
            tree = ast.parse(after)
        except SyntaxError:
            return "skipped: does not parse"
        bound = _kvcached_names(tree)
        found = _uses(tree, bound)
        if bound and not found:
            return f"fails: {relative} imports {_KVCACHED_MODULE} but uses nothing from it"
        uses += found
    return f"ok: uses {', '.join(uses)}" if uses else "n/a: does not use kvcached"


def _kvcached_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == _KVCACHED_MODULE:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and \
                (node.module or "").split(".")[0] == _KVCACHED_MODULE:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _uses(tree: ast.AST, bound: set[str]) -> list[str]:
    """The dotted names rooted in ``bound`` that the module reads (calls, decorators, bases,
    flags), longest chains only."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute | ast.Name) and isinstance(node.ctx, ast.Load):
            name = _dotted(node)
            if name and name.split(".")[0] in bound:
                found.add(name)
    return sorted(name for name in found
                  if not any(other.startswith(name + ".") for other in found))


def _dotted(expression: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(expression, ast.Attribute):
        parts.append(expression.attr)
        expression = expression.value
    return ".".join([expression.id, *reversed(parts)]) if isinstance(expression, ast.Name) \
        else ""


# --- "same change": the variant's change against the nearest cell's reviewed diff ------------


def changed_lines(diff: str) -> dict[str, tuple[list[str], list[str]]]:
    """Per file, the removed and the added lines of a diff (blank lines dropped, trailing
    space ignored): what a change is, apart from line numbers, offsets and context."""
    files: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] | None = None
    for line in diff.splitlines():
        header = re.match(r"diff --git a/(\S+) b/", line)
        if header:
            current = files.setdefault(header.group(1), ([], []))
            continue
        if current is None or line.startswith(("+++", "---")):
            continue
        if line.startswith("-") and line[1:].strip():
            current[0].append(line[1:].rstrip())
        elif line.startswith("+") and line[1:].strip():
            current[1].append(line[1:].rstrip())
    return files


def _is_subsequence(part: list[str], whole: list[str]) -> bool:
    remaining = iter(whole)
    return all(any(line == other for other in remaining) for line in part)


def compare_with_reviewed(variant: VariantResult, reviewed: Mapping[str, str]) -> str:
    """``same change`` when every line the variant removes and adds in each of its files is
    removed and added, in that order, by the nearest cell's reviewed change of that file."""
    if not variant.diff:
        return "-"
    if not reviewed:
        return "no reviewed diff"
    ours = changed_lines(variant.diff)
    if all(not removed for removed, _ in ours.values()) and \
            all(path.endswith("/_kvcached_build.py") for path in ours):
        return "n/a: generated for each build"
    theirs: dict[str, tuple[list[str], list[str]]] = {}
    for text in reviewed.values():
        for path, lines in changed_lines(text).items():
            theirs.setdefault(path, lines)
    for path, (removed, added) in ours.items():
        if path not in theirs:
            return f"differs: {path} not in the reviewed change"
        if not (_is_subsequence(removed, theirs[path][0])
                and _is_subsequence(added, theirs[path][1])):
            return f"differs: {path}"
    return "same"


# --- the check --------------------------------------------------------------------------------


@dataclass
class SeamRow:
    seam: str
    chosen: str | None
    result: str
    variants: list[str]
    note: str = ""


@dataclass
class UpgradeReport:
    engine: str
    version: str
    nearest_cell: str
    nearest_version: str
    index_url: str
    sources: str
    artifacts: list[dict[str, str]]
    python: str | None
    torch: str | None
    seams: list[SeamRow]
    variants: list[VariantResult]
    cell_proposed: bool
    cell_name: str
    verdict: str
    matrix_entry: str = ""
    cell_written: bool = False
    build: str = "skipped"
    l0_l1: str = "skipped"
    import_mode: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        document = asdict(self)
        for variant in document["variants"]:
            variant.pop("diff")
        return json.dumps(document, indent=2) + "\n"

    def to_markdown(self) -> str:
        lines = [
            f"# Upgrade check: {self.engine} {self.version}",
            "",
            f"- nearest cell: {self.nearest_cell} ({self.engine} {self.nearest_version})",
            f"- index: {self.index_url}",
            "- artifacts: " + ", ".join(f"{a['role']} {a['filename']} (sha256 {a['sha256']})"
                                        for a in self.artifacts),
            f"- transforms tried on: {self.sources}",
            f"- Requires-Python: {self.python or 'not declared'}; torch: "
            f"{self.torch or 'not pinned'}",
            f"- import check: {self.import_mode}",
            f"- verdict: {self.verdict}",
            "",
            "## Seams",
            "",
            "| seam | chosen | result | variants tried |",
            "|---|---|---|---|",
        ]
        for row in self.seams:
            note = f" ({row.note})" if row.note else ""
            lines.append(f"| {row.seam} | {row.chosen or '-'} | {row.result}{note} | "
                         f"{', '.join(row.variants) or '-'} |")
        lines += ["", "## Variants", "",
                  "| variant | seams | registered range | result | hits | compile | "
                  "kvcached use | same change | detail |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for v in self.variants:
            lines.append(
                f"| {v.id} | {', '.join(v.seams)} | {v.registered_range} | {v.result} | "
                f"{v.hits}/{v.expected} | {v.compile_check} | {v.import_check} | "
                f"{v.same_change} | {_cell_text(v.detail) or '-'} |")
        lines += ["", "## Cell", ""]
        if self.cell_proposed:
            where = "appended to matrix.toml" if self.cell_written else \
                "proposed in matrix-entry.toml (not in matrix.toml; --write-cell appends it)"
            lines.append(f"experimental cell {self.cell_name}: {where}; unreviewed diffs in "
                         "unreviewed/")
        else:
            lines.append(f"no cell proposed: {self.verdict}")
        lines += [f"- build: {self.build}", f"- L0/L1: {self.l0_l1}", "", "## Timings", ""]
        lines += [f"- {name}: {seconds:.2f} s" for name, seconds in self.timings.items()]
        return "\n".join(lines) + "\n"


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _series_for(matrix: Matrix, engine: str, version: str) -> str:
    """As many version parts as the matrix declares for the engine ([engine.<name>]
    series_parts): the same release always gets the same cell name."""
    return matrix.series_for(engine, version)


def _reviewed_diffs(registry: Registry, cell: Cell) -> dict[str, str]:
    folder = registry.patches_root / cell.engine / cell.series / "reviewed"
    if not folder.is_dir():
        return {}
    return {path.stem: path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.diff"))}


def _choose(seam: str, variants: list[VariantResult]) -> SeamRow:
    tried = [f"{v.id}: {v.result}" for v in variants]
    if not variants:
        return SeamRow(seam, None, "no transform registered", tried)
    working = [v for v in variants if v.result in _WORKING]
    same = [v for v in working if v.result == SAME_CHANGE]
    if len(working) == 1 or len(same) == 1:
        chosen = same[0] if same else working[0]
        return SeamRow(seam, chosen.id, chosen.result, tried)
    if working:
        in_range = [v.id for v in working if v.in_range]
        hint = f"; the registry's range for this release holds {in_range[0]}" \
            if len(in_range) == 1 else ""
        return SeamRow(seam, None, "ambiguous", tried,
                       f"{len(working)} variants work: {', '.join(v.id for v in working)}{hint}")
    best = max(variants, key=lambda v: _RANK[v.result])
    return SeamRow(seam, None, "no working variant", tried,
                   f"best: {best.id} {best.result}" + (f": {best.detail}" if best.detail else ""))


def run_upgrade_check(*, matrix: Matrix, registry: Registry, engine: str, requested: str,
                      index_url: str, cache_dir: Path, out_dir: Path | None = None,
                      write_cell: bool = False, build_wheels: bool = True,
                      skip_l1: bool = False, progress: Progress = _quiet,
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
    candidates = [t for t in [*registry.codemods, *_all_diffs(registry, engine)]
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
    seams = [_choose(seam, [v for v in variants if seam in v.seams]) for seam in required]
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

    report = UpgradeReport(
        engine=engine, version=release.version, nearest_cell=nearest.name,
        nearest_version=nearest.version, index_url=index_url,
        sources=f"{source_role} {source_artifact.filename}{source_note}",
        artifacts=[{"role": a.role, "filename": str(a.filename), "sha256": str(a.sha256)}
                   for a in release.artifacts],
        python=python, torch=torch, seams=seams, variants=variants,
        cell_proposed=not unresolved and not conflicts and existing is None,
        cell_name=cell_name, verdict=verdict,
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
        else:
            proofs = run_cell_proofs(report=report, out_dir=out_dir, wheels=wheels,
                                     cache_dir=cache_dir, index_url=index_url,
                                     with_l1=not skip_l1, runner=proof_runner,
                                     progress=progress)
            report.l0_l1 = proofs.outcome
            timings.update(proofs.timings)
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

    transforms = [t for t in [*registry.codemods, *_all_diffs(registry, report.engine)]
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

REPO_ROOT = Path(__file__).resolve().parent.parent
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


def run_cell_proofs(*, report: UpgradeReport, out_dir: Path, wheels: Path, cache_dir: Path,
                    index_url: str, with_l1: bool = True, runner: CommandRunner | None = None,
                    progress: Progress = _quiet) -> ProofOutcome:
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
            argv.append(f"--dist={wheels.resolve()}")  # the trial build's wheels, not a rebuild
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
    return ProofOutcome(outcome, timings, measured)


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


def _all_diffs(registry: Registry, engine: str) -> list[Transform]:
    return [t for e, series in registry.all_series() if e == engine
            for t in registry.diffs(e, series)]


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


def write_report(report: UpgradeReport, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(report.to_json(), encoding="utf-8")
    (out_dir / "report.md").write_text(report.to_markdown(), encoding="utf-8")


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


# --- upgrade-scan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanLine:
    engine: str
    newest_cell: str
    newest_cell_version: str
    newer: tuple[str, ...]


def scan(matrix: Matrix, index_url: str) -> list[ScanLine]:
    """Per engine of the matrix, the final releases on the index newer than its newest cell."""
    lines: list[ScanLine] = []
    for engine in sorted({c.engine for c in matrix.cells}):
        newest = max((c for c in matrix.cells if c.engine == engine),
                     key=lambda c: Version(c.version))
        versions = final_versions(project_files(index_url, engine), engine)
        newer = tuple(str(v) for v in versions if v > Version(newest.version))
        lines.append(ScanLine(engine, newest.name, newest.version, newer))
    return lines


def default_out_dir(engine: str, version: str) -> Path:
    return Path("reports") / "upgrade" / f"{engine}-{version}"
