"""Where a failing seam's code went: what the report tells the person who writes the new variant.

For a seam without a working variant, the useful facts are about the variant the nearest cell
uses, not the oldest one: exactly why it failed on the release; which code it rewrote in the
nearest cell (the lines its change removes there, and the function its anchor names); where
code like that is in the release (every function of the release's package scored by how much of
those lines' calls, keywords and names it holds, the best few shown with file and line); and how
much the seam's files changed between the two releases.
"""

from __future__ import annotations

import ast
import difflib
import keyword
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Names too common to say where code went.
_COMMON = frozenset({"self", "cls", "None", "True", "False", "return", "if", "else", "for",
                     "in", "not", "and", "or", "is", "def", "torch", "int", "str", "len",
                     "list", "dict", "tuple", "range", "super", "kwargs", "args"})
_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_KEYWORD = re.compile(r"\b([A-Za-z_]\w*)\s*=\s*(?!=)([\w.]+)")
_NAME = re.compile(r"[A-Za-z_]\w+")
# A candidate function is shown only when it scores this much (half of it from the anchor code
# itself).
_MIN_SCORE = 0.5
CANDIDATES_SHOWN = 3


@dataclass(frozen=True)
class Candidate:
    """A function of the release that holds code like the nearest cell's anchor code."""

    function: str            # dotted: module.Class.method
    path: str                # relative to the release's source root
    line: int                # the line that matches best
    text: str                # that line, stripped
    score: float             # matched share of the anchor code (1.0 per anchor line, summed)
    why: str                 # what matched


@dataclass
class SeamGuide:
    seam: str
    nearest_variant: str                 # the nearest cell's transform of the seam, or "-"
    nearest_result: str                  # its result on the release, with the reason
    anchor: str                          # its declared anchor
    anchor_code: list[str] = field(default_factory=list)   # lines it rewrote in the nearest cell
    candidates: list[Candidate] = field(default_factory=list)
    file_stats: list[str] = field(default_factory=list)    # the seam's files, nearest -> release
    # The anchor's class, method by method from the nearest cell's release to this one.
    class_changes: list[str] = field(default_factory=list)

    def to_markdown(self, engine: str, nearest: str, version: str) -> list[str]:
        lines = [f"### {self.seam}", "",
                 f"- the nearest cell's variant: {self.nearest_variant}: {self.nearest_result}",
                 f"- its anchor: {self.anchor}"]
        if self.anchor_code:
            lines.append(f"- the code it rewrote in {engine} {nearest}:")
            lines += [f"  - `{code}`" for code in self.anchor_code]
        if self.candidates:
            lines.append(f"- where that code is in {engine} {version} (best first):")
            lines += [f"  - `{c.function}` at {c.path}:{c.line} (score {c.score:.2f}; "
                      f"{c.why}): `{c.text}`" for c in self.candidates]
        else:
            lines.append(f"- no function of {engine} {version} holds that code")
        if self.class_changes:
            lines.append(f"- the anchor's class from {nearest} to {version}:")
            lines += [f"  - {change}" for change in self.class_changes]
        if self.file_stats:
            lines.append(f"- the seam's files from {nearest} to {version}: "
                         + "; ".join(self.file_stats))
        return lines + [""]


# --- the anchor code ---------------------------------------------------------------------------


def anchor_lines(diff: str, paths: Iterable[str]) -> list[str]:
    """The code a diff rewrote in ``paths``: the lines it removes (stripped, blank and comment
    lines dropped), in order; for a change that only adds (a decorator, a keyword), the
    nearest code line on each side of each added block, which is what it was added to."""
    wanted = set(paths)
    removed: list[str] = []
    beside: list[str] = []
    current: str | None = None
    previous = ""            # the last context line seen in this file
    after_added = False      # an added block ended on the line before
    for line in diff.splitlines():
        header = re.match(r"diff --git a/(\S+) b/", line)
        if header:
            current, previous, after_added = header.group(1), "", False
            continue
        if current not in wanted or line.startswith(("---", "+++", "@@")):
            continue
        text = line[1:].strip()
        code = bool(text) and not text.startswith("#")
        if line.startswith("-"):
            if code:
                removed.append(text)
        elif line.startswith("+"):
            if not after_added and previous:
                beside.append(previous)
            after_added = True
        elif code:
            if after_added:
                beside.append(text)
                after_added = False
            previous = text
    kept = removed or [line for line in beside if "_kvcached" not in line]
    return [line for line in kept if re.search(r"[A-Za-z_]", line)]


def anchor_function(anchor: str) -> str:
    """The function or method an anchor names (``pkg.mod.Class.method: ...`` -> ``method``)."""
    head = anchor.split(":", 1)[0].strip()
    if " " in head or "." not in head:
        return ""
    return head.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class _Tokens:
    calls: frozenset[str]
    keywords: frozenset[str]
    names: frozenset[str]

    @property
    def weight(self) -> int:
        return 2 * len(self.calls) + 2 * len(self.keywords) + len(self.names)


def _tokens(text: str) -> _Tokens:
    calls = frozenset(_CALL.findall(text))
    keywords = frozenset(f"{k}={v}" for k, v in _KEYWORD.findall(text))
    names = frozenset(n for n in _NAME.findall(text)
                      if n not in _COMMON and not keyword.iskeyword(n))
    return _Tokens(calls, keywords, names)


def _coverage(anchor: _Tokens, line: _Tokens) -> float:
    if anchor.weight == 0:
        return 0.0
    held = (2 * len(anchor.calls & line.calls) + 2 * len(anchor.keywords & line.keywords)
            + len(anchor.names & line.names))
    return held / anchor.weight


# --- the search --------------------------------------------------------------------------------


def _functions(tree: ast.Module) -> Iterable[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name inside the module, node) of every function and method, nested too."""
    pending: list[tuple[str, ast.AST]] = [("", tree)]
    while pending:
        prefix, node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                pending.append((f"{prefix}{child.name}.", child))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{prefix}{child.name}", child
                pending.append((f"{prefix}{child.name}.", child))


def find_candidates(root: Path, anchor_code: Sequence[str], function_name: str,
                    near: Sequence[str] = (), limit: int = CANDIDATES_SHOWN) -> list[Candidate]:
    """The functions under ``root`` (a release's package sources) that hold most of
    ``anchor_code``; with no anchor code, the functions named ``function_name``. Code moves
    within its file or its package more often than across the tree: a function in one of the
    ``near`` files (the variant's targets) scores half a line more, one in their folder a
    quarter."""
    wanted = [(code, _tokens(code)) for code in anchor_code]
    wanted = [(code, tokens) for code, tokens in wanted if tokens.weight]
    # A file is parsed only when it holds one of the anchor code's calls (or the function's
    # name): a release has thousands of modules.
    # The variant's own target files are always read: a renamed function is found there.
    needles = {call for _, tokens in wanted for call in tokens.calls} or \
        ({f"def {function_name}("} if function_name else set())
    near_files = set(near)
    near_folders = {path.rpartition("/")[0] for path in near}
    found: list[Candidate] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        if relative not in near_files and not any(needle in text for needle in needles):
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        module = relative.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        source_lines = text.splitlines()
        for qualified, node in _functions(tree):
            candidate = _score(node, source_lines, wanted, function_name)
            if candidate is None:
                continue
            score, line, why = candidate
            if relative in near_files:
                score, why = score + 0.5, f"{why}; in the variant's target file"
            elif relative.rpartition("/")[0] in near_folders:
                score, why = score + 0.25, f"{why}; beside the variant's target file"
            if score < _MIN_SCORE:
                continue
            found.append(Candidate(f"{module}.{qualified}", relative, line,
                                   source_lines[line - 1].strip(), round(score, 2), why))
    found.sort(key=lambda c: (-c.score, c.path, c.line))
    return found[:limit]


def _score(node: ast.FunctionDef | ast.AsyncFunctionDef, source_lines: Sequence[str],
           wanted: Sequence[tuple[str, _Tokens]], function_name: str
           ) -> tuple[float, int, str] | None:
    # The function's own lines, nested functions' lines included (they are its code too).
    first, last = node.lineno, node.end_lineno or node.lineno
    body = [(number, source_lines[number - 1]) for number in range(first, last + 1)]
    score, best_line, best_share, reasons = 0.0, first, 0.0, []
    for code, tokens in wanted:
        share, at = 0.0, first
        for number, text in body:
            stripped = text.strip()
            line_share = 1.0 if stripped == code else _coverage(tokens, _tokens(stripped))
            if line_share > share:
                share, at = line_share, number
        score += share
        if share > best_share:
            best_share, best_line = share, at
        if share == 1.0:
            reasons.append("holds an anchor line")
    named = bool(function_name) and node.name == function_name
    if named:
        score += 0.5
        reasons.append(f"named {function_name}")
        if not wanted:
            best_line = node.lineno
    if score < _MIN_SCORE / 2:
        return None
    why = ", ".join(dict.fromkeys(reasons)) or \
        f"{best_share:.0%} of an anchor line's calls, keywords and names"
    return score, best_line, why


# --- the anchor's class --------------------------------------------------------------------


def anchor_class(anchor: str) -> tuple[str, ...]:
    """The names an anchor's qualified head could give its class: its last part
    (``pkg.mod.Class``) and the one before (``pkg.mod.Class.method``)."""
    head = anchor.split(":", 1)[0].split("(", 1)[0].strip()
    if " " in head or "." not in head:
        return ()
    parts = head.split(".")
    return tuple(part for part in reversed(parts[-2:]) if part[:1].isupper())


def _class_methods(path: Path, names: Sequence[str]
                   ) -> tuple[str, int, dict[str, tuple[int, str]]] | None:
    """(class name, line, {method: (line, source)}) of the first of ``names`` defined in
    ``path``, or None."""
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for name in names:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                methods = {child.name: (child.lineno, ast.get_source_segment(text, child) or "")
                           for child in node.body
                           if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)}
                return name, node.lineno, methods
    return None


def class_changes(names: Sequence[str], paths: Iterable[str], nearest: Path,
                  release: Path) -> list[str]:
    """Method by method, how the anchor's class changed: new, gone and changed methods (lines
    added and removed), each with its line in the release."""
    if not names:
        return []
    for relative in sorted(set(paths)):
        old = _class_methods(nearest / relative, names)
        new = _class_methods(release / relative, names)
        if old is None or new is None:
            continue
        name, line, after = new
        before = old[2]
        found: list[str] = []
        for method, (at, source) in after.items():
            if method not in before:
                found.append(f"new `{method}` at {relative}:{at}")
                continue
            if source == before[method][1]:
                continue
            added = removed = 0
            for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
                    None, before[method][1].splitlines(), source.splitlines(),
                    autojunk=False).get_opcodes():
                removed += i2 - i1 if tag in ("replace", "delete") else 0
                added += j2 - j1 if tag in ("replace", "insert") else 0
            found.append(f"changed `{method}` (+{added} -{removed}) at {relative}:{at}")
        found += [f"gone `{method}` (was at line {at})" for method, (at, _) in before.items()
                  if method not in after]
        return [f"`{name}` at {relative}:{line}", *found] if found else \
            [f"`{name}` at {relative}:{line}: no method changed"]
    return []


# --- the seam's files --------------------------------------------------------------------------


def file_stats(paths: Iterable[str], nearest: Path, release: Path, version: str) -> list[str]:
    """Per file: ``path: +added -removed`` lines from the nearest cell's to the release's, or
    that it is missing in one of them."""
    stats: list[str] = []
    for relative in sorted(set(paths)):
        old, new = nearest / relative, release / relative
        if not old.is_file() and not new.is_file():
            continue
        if not new.is_file():
            stats.append(f"{relative}: missing in {version}")
            continue
        if not old.is_file():
            stats.append(f"{relative}: new in {version}")
            continue
        added = removed = 0
        before = old.read_text(encoding="utf-8", errors="replace").splitlines()
        after = new.read_text(encoding="utf-8", errors="replace").splitlines()
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, before, after,
                                                           autojunk=False).get_opcodes():
            if tag in ("replace", "delete"):
                removed += i2 - i1
            if tag in ("replace", "insert"):
                added += j2 - j1
        stats.append(f"{relative}: +{added} -{removed}" if added or removed
                     else f"{relative}: unchanged")
    return stats


def guide_seam(*, seam: str, nearest_variant: str, nearest_result: str, anchor: str,
               nearest_diff: str, target_paths: Sequence[str], seam_paths: Iterable[str],
               nearest_sources: Path, release_sources: Path, version: str) -> SeamGuide:
    """Everything the report says about one failing seam (see the module's docstring)."""
    code = list(dict.fromkeys(anchor_lines(nearest_diff, target_paths)))
    function = anchor_function(anchor)
    return SeamGuide(
        seam=seam, nearest_variant=nearest_variant, nearest_result=nearest_result,
        anchor=anchor, anchor_code=code,
        candidates=find_candidates(release_sources, code, function, target_paths),
        file_stats=file_stats(seam_paths, nearest_sources, release_sources, version),
        class_changes=class_changes(anchor_class(anchor), target_paths, nearest_sources,
                                    release_sources))
