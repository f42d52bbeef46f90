"""The transform registry: every codemod and diff, selected per cell and checked against seams.

A codemod is registered by its declaration in ``codemods/catalog.py``; a diff by its line in
``patches/<engine>/<series>/series`` plus the DEP-3 style header at its top (see
``patches/README.md``). The transform set of a cell is every registered transform whose engine
matches (``*`` matches every engine) and whose version range contains the cell's version:
codemods in catalogue order, then the diffs in the order of the cell's series file.

A cell resolves only when every seam its engine requires at its version (``REQUIRED_SEAMS``)
is covered by exactly one transform of the set; otherwise, and for a version above every
range registered for its engine, selection fails with one line naming the cell.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from libcst.codemod import CodemodCommand
from packaging.specifiers import InvalidSpecifier, Specifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from codemods.base import HitCountingCodemod
from codemods.catalog import CODEMODS, REQUIRED_SEAMS
from codemods.declare import ANY_ENGINE, CodemodDeclaration, RequiredSeam
from forge.errors import TransformError
from forge.patches import PatchFile, read_patch, series_entries

PATCHES_ROOT = Path(__file__).resolve().parent.parent / "patches"
REQUIRED_PATCH_FIELDS = ("Description", "Seam", "Why", "Anchor", "Expected-Hits", "Retire-When",
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
    seams: tuple[str, ...]            # the seam it implements first, then any it also covers
    anchor: str
    targets: tuple[str, ...]          # paths in the wheel; "{package}" is the engine package
    expected_hits: ExpectedHits
    why: str
    retire_when: str
    description: str
    codemod: type[HitCountingCodemod] | None = None
    patch: PatchFile | None = None
    forwarded: str = ""
    last_update: str = ""
    writes_build_facts: bool = False  # a codemod whose output holds the build's facts

    def applies_to(self, engine: str, version: str) -> bool:
        return self.engine in (ANY_ENGINE, engine) and Version(version) in self.versions

    def target_paths(self, package: str) -> tuple[str, ...]:
        return tuple(t.replace("{package}", package) for t in self.targets)


def codemod_transform(declaration: CodemodDeclaration) -> Transform:
    """The registry's view of a declared codemod (its metadata is checked by ``lint``)."""
    return Transform(
        id=declaration.id, engine=declaration.engine,
        versions=SpecifierSet(declaration.versions), kind=Kind.CODEMOD, seams=declaration.seams,
        anchor=declaration.anchor, targets=tuple(declaration.targets),
        expected_hits=ExpectedHits.parse(declaration.expected_hits), why=declaration.why,
        retire_when=declaration.retire_when, description=declaration.codemod.DESCRIPTION,
        codemod=declaration.codemod, forwarded=declaration.forwarded,
        last_update=declaration.last_update, writes_build_facts=declaration.writes_build_facts,
    )


def diff_transform(patch: PatchFile, engine: str, series: str) -> Transform:
    """Register one diff from its header; every fault names the file."""
    where = f"patch {patch.path}"
    header = patch.header
    missing = [name for name in REQUIRED_PATCH_FIELDS if not header.get(name, "").strip()]
    if missing:
        raise TransformError(f"{where}: header lacks {', '.join(missing)}")
    try:
        expected = ExpectedHits.parse(header["Expected-Hits"])
        versions = SpecifierSet(header.get("Applies-To") or f"=={series}.*")
    except (ValueError, InvalidSpecifier) as exc:
        raise TransformError(f"{where}: {exc}") from None
    if patch.hunks not in expected:
        raise TransformError(
            f"{where}: has {patch.hunks} hunks, header Expected-Hits says {expected}")
    return Transform(
        id=patch.path.stem, engine=engine, versions=versions, kind=Kind.DIFF,
        seams=(header["Seam"],), anchor=header["Anchor"], targets=patch.targets,
        expected_hits=expected, why=header["Why"], retire_when=header["Retire-When"],
        description=header["Description"], patch=patch, forwarded=header.get("Forwarded", ""),
        last_update=header["Last-Update"],
    )


@dataclass
class Registry:
    codemods: list[Transform]
    patches_root: Path = PATCHES_ROOT
    required_seams: Sequence[RequiredSeam] = ()
    _diff_cache: dict[tuple[str, str], list[Transform]] = field(default_factory=dict, repr=False)

    def transforms_for(self, engine: str, series: str, version: str) -> list[Transform]:
        """Every transform whose engine and range match, in application order (unchecked)."""
        selected = [t for t in self.codemods if t.applies_to(engine, version)]
        selected += [t for t in self.diffs(engine, series) if t.applies_to(engine, version)]
        return selected

    def select(self, cell: str, engine: str, series: str, version: str) -> list[Transform]:
        """The transform set of a cell, in application order; TransformError (one line naming
        the cell) for an unknown version, a required seam with no transform, or a seam with
        two."""
        where = f"cell {cell}"
        if not any(row.engine == engine for row in self.required_seams):
            raise TransformError(f"{where}: engine {engine!r} declares no required seams "
                                 "(REQUIRED_SEAMS in codemods/catalog.py)")
        own = [t for t in [*self.codemods, *self.diffs(engine, series)] if t.engine == engine]
        newest = _newest_bound(t.versions for t in own)
        if not own or (newest is not None and _above(Version(version), newest)):
            registered = f"<{'=' if newest[1] else ''}{newest[0]}" if newest else "none"
            raise TransformError(f"{where}: {engine} version {version} is unknown "
                                 f"(newest registered: {registered})")
        selected = self.transforms_for(engine, series, version)
        required = [row.seam for row in self.required_seams
                    if row.required_for(engine, version)]
        missing = [seam for seam in dict.fromkeys(required)
                   if not any(seam in t.seams for t in selected)]
        if missing:
            seams, verb = ("seams", "have") if len(missing) > 1 else ("seam", "has")
            raise TransformError(f"{where}: required {seams} {', '.join(missing)} {verb} no "
                                 f"transform for {engine} {version}")
        covering: dict[str, list[str]] = {}
        for transform in selected:
            for seam in transform.seams:
                covering.setdefault(seam, []).append(transform.id)
        for seam, ids in covering.items():
            if len(ids) > 1:
                raise TransformError(f"{where}: seam {seam} has {len(ids)} transforms for "
                                     f"{engine} {version}: {', '.join(ids)}")
        return selected

    def required_for(self, engine: str, version: str) -> list[str]:
        """The seams a build of ``engine`` ``version`` must cover, in table order."""
        return list(dict.fromkeys(row.seam for row in self.required_seams
                                  if row.required_for(engine, version)))

    def series_file(self, engine: str, series: str) -> Path:
        return self.patches_root / engine / series / "series"

    def diffs(self, engine: str, series: str) -> list[Transform]:
        """The diffs of ``patches/<engine>/<series>/series``, in series order."""
        key = (engine, series)
        if key not in self._diff_cache:
            self._diff_cache[key] = [
                diff_transform(read_patch(path), engine, series)
                for path in series_entries(self.series_file(engine, series))
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
            if not transform.seams or not all(_ID.fullmatch(seam) for seam in transform.seams):
                problems.append(f"{where}: seam must be lower-case letters, digits, '.', '_', "
                                "'-'")
            if not transform.targets:
                problems.append(f"{where}: no target files")
            if transform.kind is Kind.CODEMOD:
                if not (isinstance(transform.codemod, type)
                        and issubclass(transform.codemod, HitCountingCodemod)):
                    problems.append(f"{where}: codemod must subclass HitCountingCodemod")
                elif transform.description.strip() in ("", CodemodCommand.DESCRIPTION):
                    problems.append(f"{where}: codemod {transform.codemod.__name__} has no "
                                    "DESCRIPTION")
        for row in self.required_seams:
            try:
                SpecifierSet(row.versions)
            except InvalidSpecifier as exc:
                problems.append(f"required seam {row.engine} {row.seam}: {exc}")
        return problems


# A range's upper end: (version, inclusive); None when the range is open above.
_Bound = tuple[Version, bool]


def _spec_bound(spec: Specifier) -> _Bound | None:
    text = spec.version
    try:
        if spec.operator == "<":
            return Version(text), False
        if spec.operator == "<=":
            return Version(text), True
        if spec.operator in ("==", "===") and not text.endswith(".*"):
            return Version(text), True
        if spec.operator == "==" or spec.operator == "~=":
            # ==0.5.* ends before 0.6; ~=0.5.2 ends before 0.6; ~=1.4 ends before 2.
            parts = text.removesuffix(".*").split(".")
            if spec.operator == "~=":
                parts = parts[:-1]
            parts[-1] = str(int(parts[-1]) + 1)
            return Version(".".join(parts)), False
    except (InvalidVersion, ValueError):
        return None
    return None


def _upper_bound(versions: SpecifierSet) -> _Bound | None:
    bounds = [b for b in (_spec_bound(spec) for spec in versions) if b is not None]
    return min(bounds, key=lambda b: (b[0], b[1])) if bounds else None


def _newest_bound(ranges: Iterable[SpecifierSet]) -> _Bound | None:
    """The highest upper end among ``ranges``; None when any of them is open above."""
    bounds = [_upper_bound(r) for r in ranges]
    if not bounds or any(b is None for b in bounds):
        return None
    return max((b for b in bounds if b is not None), key=lambda b: (b[0], b[1]))


def _above(version: Version, bound: _Bound) -> bool:
    limit, inclusive = bound
    return version > limit if inclusive else version >= limit


def default_registry(patches_root: Path = PATCHES_ROOT,
                     extra: Iterable[Transform] = ()) -> Registry:
    """The toolkit's registry: the catalogue's codemods and seams, and the diffs of
    ``patches_root``."""
    return Registry(codemods=[*(codemod_transform(d) for d in CODEMODS), *extra],
                    patches_root=patches_root, required_seams=REQUIRED_SEAMS)
