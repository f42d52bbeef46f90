"""The release on the index and its sources: artifacts with the index's sha256, the nearest
cell, the files the transforms target."""

from __future__ import annotations

import email.parser
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from forge.errors import FetchError, MatrixError
from forge.fetch import IndexFile, project_files
from forge.matrix import Artifact, Cell, Matrix

Progress = Callable[[str], None]


def quiet(_line: str) -> None:
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
    Python tag, then the tag of the Python running the check (what the sessions run: a pure
    nearest wheel names no CPython), then abi3."""
    running = f"cp{sys.version_info.major}{sys.version_info.minor}"
    candidates: list[tuple[tuple[int, int, int, int, str], str, IndexFile]] = []
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
        python = tags.split("-", 1)[0]
        key = (0 if tags == preferred_tags else 1, 0 if python == preferred_python else 1,
               0 if python == running else 1, 0 if "abi3" in tags else 1, name)
        candidates.append((key, name, entry))
    if not candidates:
        return None
    _, name, entry = min(candidates)
    return name, entry


def resolve_release(index_url: str, engine: str, requested: str, nearest: Cell | None,
                    progress: Progress = quiet) -> Release:
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
