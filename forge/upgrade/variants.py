"""One transform variant tried on a release's pristine sources, and whether its change is the
nearest cell's reviewed change."""

from __future__ import annotations

import ast
import difflib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import libcst
from libcst.codemod import CodemodContext, SkipFile
from packaging.version import Version

from codemods.base import BuildContext
from forge.patches import diff_body
from forge.registry import Kind, Registry, Transform

# Per-variant results, best first.
SAME_CHANGE = "same change"
APPLIED = "applied"
PARTIAL = "partial"
ALREADY = "already applied"
NOT_FOUND = "not found"
ERROR = "error"
RANK = {SAME_CHANGE: 4, APPLIED: 3, PARTIAL: 2, ALREADY: 1, NOT_FOUND: 0, ERROR: 0}
WORKING = (SAME_CHANGE, APPLIED)
_KVCACHED_MODULE = "kvcached_core"


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


def all_diffs(registry: Registry, engine: str) -> list[Transform]:
    return [t for e, series in registry.all_series() if e == engine
            for t in registry.diffs(e, series)]
