"""Uploads wheels to a package index with twine, safely repeatable.

Before anything is uploaded, the index's simple API (read with `pypi-simple`) is asked which of
the files it already holds, and with which sha256:

- a file already there with the same sha256 is skipped, so re-running a publish that was
  interrupted completes it;
- a file already there under the same name with a different sha256 refuses the whole batch,
  before any upload, with one line: a published build is never replaced;
- the rest is uploaded by twine (repository configuration, credentials from `~/.pypirc`,
  keyring or `TWINE_USERNAME`/`TWINE_PASSWORD`, retries), one file per call in the order given,
  and each upload is checked on the index afterwards (twine's `--skip-existing` is for PyPI
  only; a file that appeared meanwhile is judged by its sha256 like any other).

Callers order the files so that nothing is visible before what it depends on (engine and core
wheels first, the meta wheels that pin them last).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import urllib.parse
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from email.parser import BytesParser
from pathlib import Path

from packaging.utils import canonicalize_name

from forge.errors import PublishError, WheelError
from forge.repack import WheelName
from forge.wheelfile import COPY_CHUNK

_MB = 1_000_000
DEFAULT_TIMEOUT_S = 60.0
# How many lines of twine's own output a failure message keeps (twine explains itself well).
_TWINE_DETAIL_LINES = 3
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class WheelFile:
    path: Path
    name: str
    version: str
    sha256: str
    requires: tuple[str, ...] = ()


@dataclass
class PublishResult:
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def describe_wheel(path: Path) -> WheelFile:
    """Name, version, Requires-Dist and sha256 of a wheel, read from its METADATA."""
    if not path.is_file():
        raise PublishError(f"{path}: no such file")
    try:
        WheelName.parse(path.name)
    except WheelError as exc:
        raise PublishError(f"{path.name}: only wheels can be published ({exc})") from exc
    try:
        with zipfile.ZipFile(path) as archive:
            metadata_paths = [
                n
                for n in archive.namelist()
                if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
            ]
            if len(metadata_paths) != 1:
                raise PublishError(f"{path.name}: expected one .dist-info/METADATA")
            message = BytesParser().parsebytes(archive.read(metadata_paths[0]))
    except (OSError, zipfile.BadZipFile) as exc:
        raise PublishError(f"{path.name}: cannot read wheel: {exc}") from exc
    name, version = message.get("Name"), message.get("Version")
    if not name or not version:
        raise PublishError(f"{path.name}: METADATA lacks Name or Version")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK):
            digest.update(chunk)
    requires = tuple(message.get_all("Requires-Dist") or ())
    return WheelFile(path, name, version, digest.hexdigest(), requires)


def default_simple_url(repository_url: str) -> str:
    """pypiserver serves uploads at its root and the simple API at `<root>/simple/`."""
    return urllib.parse.urljoin(repository_url.rstrip("/") + "/", "simple/")


def publish(
    files: Sequence[Path],
    repository_url: str,
    *,
    username: str | None = None,
    password: str | None = None,
    progress: Callable[[str], None] | None = None,
    simple_url: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PublishResult:
    """Uploads `files` (wheels) to `repository_url` in the order given; see the module doc.

    `simple_url` is the index's PEP 503 root; by default `<repository_url>/simple/` (pypiserver;
    devpi: `<index>/+simple/`).
    """
    say = progress or (lambda _line: None)
    wheels = [describe_wheel(Path(path)) for path in files]
    names = [wheel.path.name for wheel in wheels]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise PublishError(f"{duplicates[0]} is given twice")
    simple = simple_url or default_simple_url(repository_url)

    on_index = _hashes_on_index(simple, {w.name for w in wheels}, timeout_s)
    result = PublishResult()
    pending: list[WheelFile] = []
    for wheel in wheels:
        present = on_index.get(wheel.path.name, _ABSENT)
        if present is _ABSENT:
            pending.append(wheel)
            continue
        index_sha256 = present if present is not None else _download_sha256(
            simple, wheel, timeout_s)
        if index_sha256 != wheel.sha256:
            raise PublishError(
                f"{wheel.path.name} is already on {repository_url} with a different sha256 "
                f"({index_sha256[:12]}… there, {wheel.sha256[:12]}… here): a published file is "
                "never replaced; bump the cell's build number"
            )
        result.skipped.append(wheel.path.name)
        say(f"skip {wheel.path.name}: already on the index with the same sha256")

    for wheel in pending:
        size = wheel.path.stat().st_size
        say(f"upload {wheel.path.name} ({size / _MB:.1f} MB) to {repository_url}")
        started = time.monotonic()
        failure = _twine_upload(wheel.path, repository_url, username, password, timeout_s)
        _check_uploaded(simple, wheel, repository_url, timeout_s, failure)
        result.uploaded.append(wheel.path.name)
        say(f"uploaded {wheel.path.name} in {time.monotonic() - started:.1f} s")
    return result


_ABSENT = "<absent>"


def _hashes_on_index(simple: str, projects: set[str], timeout_s: float
                     ) -> dict[str, str | None]:
    """filename -> sha256 (None where the index gives no hash) for the projects' files."""
    import requests
    from pypi_simple import NoSuchProjectError, PyPISimple

    found: dict[str, str | None] = {}
    with PyPISimple(endpoint=simple.rstrip("/") + "/") as client:
        for project in sorted(projects):
            try:
                page = client.get_project_page(canonicalize_name(project), timeout=timeout_s)
            except NoSuchProjectError:
                continue
            except requests.HTTPError as exc:
                raise PublishError(f"index {simple} answered {_first_line(str(exc))}") from None
            except (requests.RequestException, OSError) as exc:
                raise PublishError(f"index {simple} unreachable: {_reason(exc)}") from None
            for package in page.packages:
                found[package.filename] = package.digests.get("sha256")
    return found


def _download_sha256(simple: str, wheel: WheelFile, timeout_s: float) -> str:
    """The sha256 of the index's copy of a file, for an index that lists no hashes."""
    import requests

    from forge.fetch import find_on_index

    listed = find_on_index(simple, wheel.path.name)
    digest = hashlib.sha256()
    try:
        with requests.get(listed.url, stream=True, timeout=timeout_s) as response:
            response.raise_for_status()
            for chunk in response.iter_content(COPY_CHUNK):
                digest.update(chunk)
    except (requests.RequestException, OSError) as exc:
        raise PublishError(f"index {simple} unreachable: {_reason(exc)}") from None
    return digest.hexdigest()


def _twine_upload(path: Path, repository_url: str, username: str | None, password: str | None,
                  timeout_s: float) -> str | None:
    """Runs twine for one file; returns its error in one line, or None when it succeeded."""
    env = dict(os.environ, NO_COLOR="1")
    if username is not None:
        env["TWINE_USERNAME"] = username
    if password is not None:
        env["TWINE_PASSWORD"] = password
    if "TWINE_USERNAME" not in env and "TWINE_PASSWORD" not in env:
        # No user given: upload anonymously (pypiserver -a .) rather than prompt. A user set
        # without a password lets twine take the password from the keyring.
        env["TWINE_USERNAME"] = ""
        env["TWINE_PASSWORD"] = ""
    command = [sys.executable, "-m", "twine", "upload", "--non-interactive",
               "--disable-progress-bar", "--repository-url", repository_url,
               str(path)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=max(timeout_s, 60.0) + path.stat().st_size / (5 * _MB))
    except subprocess.TimeoutExpired:
        raise PublishError(f"twine upload of {path.name} to {repository_url} timed out") from None
    if done.returncode == 0:
        return None
    output = _ANSI_RE.sub("", done.stdout + "\n" + done.stderr)
    lines = [line.strip() for line in output.splitlines()
             if line.strip() and not line.startswith(("Uploading", "INFO"))]
    detail = " ".join(lines[-_TWINE_DETAIL_LINES:]) or f"exit status {done.returncode}"
    return f"twine could not upload {path.name} to {repository_url}: {detail}"


def _check_uploaded(simple: str, wheel: WheelFile, repository_url: str,
                    timeout_s: float, failure: str | None) -> None:
    """Looks at the index after an upload: the file must be there with our sha256.

    A failed upload whose file is there with our sha256 (another publish of the same build got
    there first) is fine; an index that is gone reports twine's own error."""
    try:
        listed = _hashes_on_index(simple, {wheel.name}, timeout_s)
    except PublishError:
        if failure:
            raise PublishError(failure) from None
        raise
    present = listed.get(wheel.path.name, _ABSENT)
    if present is _ABSENT:
        raise PublishError(failure or f"{wheel.path.name}: twine reported success but {simple} "
                           "does not list it")
    if present is not None and present != wheel.sha256:
        raise PublishError(
            f"{wheel.path.name} is already on {repository_url} with a different sha256 "
            f"({present[:12]}… there, {wheel.sha256[:12]}… here): a published file is never "
            "replaced; bump the cell's build number"
        )


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0] if stripped else ""


def _reason(exc: BaseException) -> str:
    text = str(exc)
    for marker in ("Connection refused", "Name or service not known", "timed out",
                   "Connection reset", "Remote end closed"):
        if marker.lower() in text.lower():
            return marker
    return _first_line(text) or type(exc).__name__


# --- which cells may be published ----------------------------------------------------------

ALLOW_EXPERIMENTAL_FLAG = "--allow-experimental"


def check_publishable(cell: str, status: str, reason: str | None, *,
                      allow_experimental: bool) -> None:
    """Refuses, in one line, a cell users must not be offered.

    A `supported` cell is published whole. An `experimental` cell only when asked for
    explicitly, and then without its meta wheels (`meta_wheels_published`): the meta name is
    what users install, so it only ever pins a supported build. A `broken` cell never.
    """
    if status == "supported":
        return
    why = f" ({reason})" if reason else ""
    if status == "broken":
        raise PublishError(f"cell {cell} is broken{why}: a broken cell is never published")
    if not allow_experimental:
        raise PublishError(
            f"cell {cell} is experimental{why}: not published unless asked with "
            f"{ALLOW_EXPERIMENTAL_FLAG}, and then without its meta wheels")


def meta_wheels_published(status: str) -> bool:
    """Whether a cell's meta wheels (`kvcached-<engine>`, the name users install) go up."""
    return status == "supported"


# --- what a cell's publish uploads ---------------------------------------------------------

CORE_DIST = "kvcached-core"
NEWEST_CPYTHON_MINOR = 14


@dataclass(frozen=True)
class CellRelease:
    """The files of one cell's publish, in upload order, and the core Pythons they cover."""

    engine_wheels: tuple[Path, ...]
    core_wheels: tuple[Path, ...]
    meta_wheels: tuple[Path, ...]
    core_requirement: str
    core_pythons: tuple[str, ...]

    @property
    def ordered(self) -> list[Path]:
        # Nothing may be visible before what it needs: a meta wheel pins the other two.
        return [*self.engine_wheels, *self.core_wheels, *self.meta_wheels]

    @property
    def without_meta(self) -> list[Path]:
        """What an experimental cell uploads: the builds, never the name users install."""
        return [*self.engine_wheels, *self.core_wheels]


def _is_meta(wheel: Path) -> bool:
    return wheel.name.startswith("kvcached_") and not wheel.name.startswith("kvcached_core-")


def cell_release(cell_dir: Path, core_dir: Path) -> CellRelease:
    """Engine and meta wheels of `cell_dir` plus the kvcached-core wheels the metas pin."""
    wheels = sorted(cell_dir.glob("*.whl"))
    metas = [w for w in wheels if _is_meta(w)]
    engines = [w for w in wheels if not _is_meta(w)]
    if not engines or not metas:
        raise PublishError(f"{cell_dir}: no engine and meta wheels; build the cell first")
    pins = set()
    for meta in metas:
        for requirement in describe_wheel(meta).requires:
            name, _, version = requirement.partition("==")
            if canonicalize_name(name.strip()) == CORE_DIST:
                pins.add(version.strip())
    if len(pins) != 1:
        raise PublishError(f"{cell_dir}: meta wheels pin {len(pins)} kvcached-core versions, "
                           "expected exactly one")
    (core_version,) = pins
    cores = sorted(core_dir.glob(f"kvcached_core-{core_version}-*.whl"))
    if not cores:
        raise PublishError(
            f"{cell_dir.name}: its meta wheels pin kvcached-core=={core_version}, but "
            f"{core_dir} holds no such wheel; build it with `nox -s build-core`"
        )
    pythons = tuple(sorted({WheelName.parse(c.name).tags.split("-")[0] for c in cores},
                           key=lambda tag: int(tag[3:]) if tag[3:].isdigit() else 0))
    return CellRelease(tuple(engines), tuple(cores), tuple(metas),
                       f"{CORE_DIST}=={core_version}", pythons)


def uncovered_pythons(allowed: str, core_tags: Sequence[str]) -> list[str]:
    """CPython minors (3.8 to the newest, 3.14) a cell's range allows but no core wheel covers."""
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(allowed)
    covered = {f"3.{tag[3:]}" for tag in core_tags if tag.startswith("cp3")}
    return [f"3.{minor}" for minor in range(8, NEWEST_CPYTHON_MINOR + 1)
            if spec.contains(f"3.{minor}.0") and f"3.{minor}" not in covered]


def stale_reason(cell_dir: Path, *, built_version: str, base_sha256s: Sequence[str],
                 fingerprint: str, core_requirement: str) -> str | None:
    """Why `cell_dir` is not the build the matrix and registry describe now (None: current)."""
    from forge.repack import read_provenance

    engines = [w for w in sorted(cell_dir.glob("*.whl")) if not _is_meta(w)]
    if not engines:
        return f"{cell_dir} holds no engine wheels"
    seen = set()
    for wheel in engines:
        try:
            provenance = read_provenance(wheel)
        except WheelError as exc:
            return str(exc)
        expected = {"built_version": built_version, "patch_set_fingerprint": fingerprint,
                    "core_requirement": core_requirement}
        for key, value in expected.items():
            if provenance.get(key) != value:
                return f"{wheel.name}: {key} is {provenance.get(key)}, now {value}"
        seen.add(provenance.get("base_sha256"))
        meta = cell_dir / (
            f"kvcached_{canonicalize_name(str(provenance.get('distribution'))).replace('-', '_')}"
            f"-{built_version}-py3-none-any.whl")
        if not meta.is_file():
            return f"{meta.name} is missing"
    if seen != set(base_sha256s):
        return "the engine wheels were built from other upstream artifacts than the matrix pins"
    return None
