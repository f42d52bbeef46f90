"""Every transform, registered and justified.

A codemod is registered below with all its metadata. A diff is registered by its file: the line
naming it in ``patches/<engine>/<series>/series`` plus the DEP-3 style header at its top
(see ``patches/README.md``). The transform set of a cell is every registered transform whose
engine matches (``*`` matches every engine) and whose version range contains the cell's version:
codemods in registry order, then the diffs in the order of the cell's series file.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version
from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from codemods.base import HitCountingCodemod
from codemods.provenance import WriteProvenanceModule
from forge.errors import TransformError

ANY_ENGINE = "*"
PATCHES_ROOT = Path(__file__).resolve().parent.parent / "patches"
REQUIRED_PATCH_FIELDS = ("Description", "Why", "Anchor", "Expected-Hits", "Retire-When",
                         "Last-Update")
_ID = re.compile(r"[a-z0-9][a-z0-9._-]*")


class Kind(StrEnum):
    CODEMOD = "codemod"
    DIFF = "diff"


@dataclass(frozen=True)
class ExpectedHits:
    """An exact count (``1``) or an inclusive range (``2..4``)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int) -> ExpectedHits:
        raw = str(text).strip()
        match = re.fullmatch(r"(\d+)(?:\.\.(\d+))?", raw)
        if not match:
            raise ValueError(f"expected hits must be N or MIN..MAX, got {raw!r}")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if low < 1 or high < low:
            raise ValueError(f"expected hits must be >= 1 and MIN <= MAX, got {raw!r}")
        return cls(low, high)

    def __contains__(self, hits: object) -> bool:
        return isinstance(hits, int) and self.low <= hits <= self.high

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}..{self.high}"


@dataclass(frozen=True)
class Transform:
    id: str
    engine: str
    versions: SpecifierSet
    kind: Kind
    anchor: str
    targets: tuple[str, ...]          # paths in the wheel; "{package}" is the engine package
    expected_hits: ExpectedHits
    why: str
    retire_when: str
    codemod: type[HitCountingCodemod] | None = None
    patch: Path | None = None
    forwarded: str = ""
    last_update: str = ""
    description: str = ""

    def applies_to(self, engine: str, version: str) -> bool:
        return self.engine in (ANY_ENGINE, engine) and Version(version) in self.versions

    def target_paths(self, package: str) -> tuple[str, ...]:
        return tuple(t.replace("{package}", package) for t in self.targets)

    def source_bytes(self) -> bytes:
        """The text this transform is made of: its codemod module, or its patch file."""
        if self.patch is not None:
            return self.patch.read_bytes()
        if self.codemod is None:
            raise TransformError(f"transform {self.id} has neither a codemod nor a patch")
        source_file = inspect.getsourcefile(self.codemod)
        if source_file is None:
            raise TransformError(f"transform {self.id}: source of {self.codemod!r} not found")
        return Path(source_file).read_bytes()


def codemod(*, id: str, engine: str, versions: str, anchor: str, targets: Sequence[str],
            expected_hits: str | int, why: str, retire_when: str,
            codemod: type[HitCountingCodemod], forwarded: str = "",
            last_update: str = "") -> Transform:
    """Register a codemod (the metadata is checked again by ``Registry.lint``)."""
    return Transform(
        id=id, engine=engine, versions=SpecifierSet(versions), kind=Kind.CODEMOD,
        anchor=anchor, targets=tuple(targets), expected_hits=ExpectedHits.parse(expected_hits),
        why=why, retire_when=retire_when, codemod=codemod, forwarded=forwarded,
        last_update=last_update, description=(codemod.__doc__ or "").strip().splitlines()[0]
        if codemod.__doc__ else "",
    )


@dataclass
class Registry:
    codemods: list[Transform]
    patches_root: Path = PATCHES_ROOT
    _diff_cache: dict[tuple[str, str], list[Transform]] = field(default_factory=dict, repr=False)

    def transforms_for(self, engine: str, series: str, version: str) -> list[Transform]:
        """The transform set of a cell, in application order."""
        selected = [t for t in self.codemods if t.applies_to(engine, version)]
        selected += [t for t in self.diffs(engine, series) if t.applies_to(engine, version)]
        return selected

    def series_file(self, engine: str, series: str) -> Path:
        return self.patches_root / engine / series / "series"

    def diffs(self, engine: str, series: str) -> list[Transform]:
        """The diffs of ``patches/<engine>/<series>/series``, in series order."""
        key = (engine, series)
        if key not in self._diff_cache:
            self._diff_cache[key] = [
                load_patch(path, engine, series)
                for path in _series_entries(self.series_file(engine, series))
            ]
        return self._diff_cache[key]

    def all_series(self) -> list[tuple[str, str]]:
        if not self.patches_root.is_dir():
            return []
        return sorted(
            (path.parent.parent.name, path.parent.name)
            for path in self.patches_root.glob("*/*/series")
        )

    def lint(self) -> list[str]:
        """Problems in the registry, one line each; empty when every transform is complete."""
        problems: list[str] = []
        transforms: list[Transform] = list(self.codemods)
        for engine, series in self.all_series():
            try:
                transforms += self.diffs(engine, series)
            except TransformError as exc:
                problems.append(str(exc))
        seen: set[str] = set()
        for transform in transforms:
            where = f"transform {transform.id or '<no id>'}"
            if not _ID.fullmatch(transform.id):
                problems.append(f"{where}: id must be lower-case letters, digits, '.', '_', '-'")
            if transform.id in seen:
                problems.append(f"{where}: id registered twice")
            seen.add(transform.id)
            for name in ("engine", "anchor", "why", "retire_when"):
                if not str(getattr(transform, name)).strip():
                    problems.append(f"{where}: field {name!r} is empty")
            if not transform.targets:
                problems.append(f"{where}: no target files")
            if transform.kind is Kind.CODEMOD and not (
                isinstance(transform.codemod, type)
                and issubclass(transform.codemod, HitCountingCodemod)
            ):
                problems.append(f"{where}: codemod must subclass HitCountingCodemod")
        return problems


def _series_entries(series_file: Path) -> list[Path]:
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


def load_patch(path: Path, engine: str, series: str) -> Transform:
    """Register one diff from its header; every fault names the file."""
    raw = path.read_bytes()
    text = raw.decode("utf-8")
    where = f"patch {path}"
    if b"\r\n" in raw:
        raise TransformError(f"{where}: has CRLF line endings")
    if not text.endswith("\n"):
        raise TransformError(f"{where}: does not end with a newline")
    header = parse_patch_header(text)
    missing = [name for name in REQUIRED_PATCH_FIELDS if not header.get(name, "").strip()]
    if missing:
        raise TransformError(f"{where}: header lacks {', '.join(missing)}")
    try:
        expected = ExpectedHits.parse(header["Expected-Hits"])
        versions = SpecifierSet(header.get("Applies-To") or f"=={series}.*")
    except (ValueError, InvalidSpecifier) as exc:
        raise TransformError(f"{where}: {exc}") from None
    try:
        patch_set = PatchSet.from_string(text)
    except UnidiffParseError as exc:
        raise TransformError(f"{where}: not a valid unified diff: {exc}") from None
    targets = tuple(_strip_prefix(f.target_file if not f.is_removed_file else f.source_file)
                    for f in patch_set)
    if not targets:
        raise TransformError(f"{where}: contains no file changes")
    hunks = sum(len(f) for f in patch_set)
    if hunks not in expected:
        raise TransformError(f"{where}: has {hunks} hunks, header Expected-Hits says {expected}")
    return Transform(
        id=path.stem, engine=engine, versions=versions, kind=Kind.DIFF,
        anchor=header["Anchor"], targets=targets, expected_hits=expected,
        why=header["Why"], retire_when=header["Retire-When"], patch=path,
        forwarded=header.get("Forwarded", ""), last_update=header["Last-Update"],
        description=header["Description"],
    )


def _strip_prefix(name: str) -> str:
    return name[2:] if name.startswith(("a/", "b/")) else name


# --- the registered codemods, in application order -------------------------------------------

CODEMODS: list[Transform] = [
    codemod(
        id="provenance",
        engine=ANY_ENGINE,
        versions="",
        anchor="file {package}/_kvcached_build.py (new module)",
        targets=["{package}/_kvcached_build.py"],
        expected_hits=1,
        why="A running engine must be able to say which patched build it is (cell, base "
            "artifact and sha256, transforms, patch-set fingerprint).",
        retire_when="Never: vendor-specific; it exists because these wheels are ours.",
        codemod=WriteProvenanceModule,
        forwarded="not-needed",
        last_update="2026-11-30",
    ),
]


def default_registry(patches_root: Path = PATCHES_ROOT,
                     extra: Iterable[Transform] = ()) -> Registry:
    return Registry(codemods=[*CODEMODS, *extra], patches_root=patches_root)
