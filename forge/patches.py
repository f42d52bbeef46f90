"""The diff files of ``patches/``: series files, DEP-3 style headers, and the unified diffs.

This module reads and checks the files only; which header fields a registered diff needs and
what they mean is the registry's business (``forge.registry``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from forge.errors import TransformError

_DIFF_START = re.compile(r"^(diff --git |--- )", flags=re.MULTILINE)


@dataclass(frozen=True)
class PatchFile:
    """One ``.patch`` file: its header fields and the files and hunks its diff changes."""

    path: Path
    header: dict[str, str]
    hunks_by_file: tuple[tuple[str, int], ...]   # (path in the wheel, hunks), in diff order

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(path for path, _ in self.hunks_by_file)

    @property
    def hunks(self) -> int:
        return sum(count for _, count in self.hunks_by_file)

    def hunks_in(self, relative: str) -> int:
        return sum(count for path, count in self.hunks_by_file if path == relative)


def series_entries(series_file: Path) -> list[Path]:
    """The patch files a series file names, in order (``#`` comments, blank lines skipped)."""
    if not series_file.exists():
        return []
    entries: list[Path] = []
    for number, line in enumerate(series_file.read_text(encoding="utf-8").splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        path = series_file.parent / name
        if not path.is_file():
            raise TransformError(f"{series_file}:{number}: patch {name!r} does not exist")
        entries.append(path)
    return entries


def parse_patch_header(text: str) -> dict[str, str]:
    """DEP-3 style ``Field: value`` lines (indented lines continue a value) before the diff."""
    fields: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith(("diff --git ", "--- ", "Index: ")):
            break
        if line[:1] in (" ", "\t") and current is not None:
            fields[current] += "\n" + line.strip()
            continue
        match = re.match(r"([A-Za-z][A-Za-z0-9-]*):\s*(.*)", line)
        if match:
            current = match.group(1)
            fields[current] = match.group(2).strip()
        else:
            current = None
    return fields


def diff_body(text: str) -> str:
    """The patch text from its first diff line on (``git apply`` would read a header as junk)."""
    start = _DIFF_START.search(text)
    return text[start.start():] if start else text


def read_patch(path: Path) -> PatchFile:
    """Read one patch file; every fault names the file."""
    raw = path.read_bytes()
    text = raw.decode("utf-8")
    where = f"patch {path}"
    if b"\r\n" in raw:
        raise TransformError(f"{where}: has CRLF line endings")
    if not text.endswith("\n"):
        raise TransformError(f"{where}: does not end with a newline")
    try:
        patch_set = PatchSet.from_string(text)
    except UnidiffParseError as exc:
        raise TransformError(f"{where}: not a valid unified diff: {exc}") from None
    hunks_by_file = tuple(
        (_strip_prefix(f.source_file if f.is_removed_file else f.target_file), len(f))
        for f in patch_set
    )
    if not hunks_by_file:
        raise TransformError(f"{where}: contains no file changes")
    return PatchFile(path=path, header=parse_patch_header(text), hunks_by_file=hunks_by_file)


def _strip_prefix(name: str) -> str:
    return name[2:] if name.startswith(("a/", "b/")) else name
