"""Fetch pinned artifacts from a simple index into a local cache, verified by sha256.

Cache layout (``KVCACHED_FORGE_CACHE``, default ``~/.cache/kvcached-forge``)::

    artifacts/<filename>            verified upstream files
    artifacts/<filename>.verified   stamp: what was verified, and the file's stat at that time
    artifacts/by-sha256/<sha256>/<filename>
                                    a cached file that no longer matched its pin, kept (a typo
                                    in a pin must not cost a re-download); restored, after
                                    hashing, when the pin names it again
    git/<name>.git                  bare clones of pinned git sources

Why the stamp is safe: a stamp is trusted only when the pinned sha256 it records equals the
current pin and the file's size, inode, mtime_ns and ctime_ns equal those recorded right after
hashing. ctime cannot be set from user space (every write, rename or ``utime`` moves it to
"now"), so a file changed after verification no longer matches its stamp and is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import BinaryIO

from packaging.utils import canonicalize_name

from forge.errors import FetchError
from forge.matrix import Artifact, Matrix

Progress = Callable[[str], None]

INDEX_URL_ENV = "KVCACHED_FORGE_INDEX_URL"
CACHE_ENV = "KVCACHED_FORGE_CACHE"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
_ACCEPT = f"{SIMPLE_JSON}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
_CHUNK = 1 << 20
_PROGRESS_INTERVAL_S = 0.5
_TIMEOUT_S = 30.0


def _quiet(_line: str) -> None:
    return None


def default_cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "kvcached-forge"


def resolve_index_url(matrix: Matrix, override: str | None = None) -> str:
    """``--index-url`` beats ``KVCACHED_FORGE_INDEX_URL`` beats matrix ``index_url``."""
    url = override or os.environ.get(INDEX_URL_ENV) or matrix.index_url
    return url.rstrip("/")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class IndexFile:
    url: str
    sha256: str | None
    yanked: bool = False


def fetch_artifact(artifact: Artifact, *, index_url: str, cache_dir: Path,
                   progress: Progress = _quiet) -> Path:
    """Return the verified cached file for ``artifact``, downloading it if needed."""
    if artifact.filename is None or artifact.sha256 is None:
        raise FetchError(f"artifact role {artifact.role!r} is not a file on an index")
    store = cache_dir / "artifacts"
    target = store / artifact.filename
    kept_aside: Path | None = None
    if target.exists():
        if _cached_file_valid(target, artifact.sha256, progress):
            return target
        # A pin that differs from a verified download is more often a typo in the pin than a
        # changed file: keep the copy (hundreds of MB) under its own hash instead of deleting it.
        kept_aside = _move_aside(target)
        progress(f"fetch {artifact.filename}: cached copy does not match its pin "
                 f"{artifact.sha256}; kept as {kept_aside.relative_to(cache_dir)}")
    if _restore_set_aside(store, artifact.filename, artifact.sha256):
        progress(f"fetch {artifact.filename}: restored the cached copy kept for this pin")
        return target
    store.mkdir(parents=True, exist_ok=True)
    found = find_on_index(index_url, artifact.filename)
    if found.sha256 is not None and found.sha256 != artifact.sha256:
        kept = f"; the cached copy is kept as {kept_aside}" if kept_aside else ""
        raise FetchError(
            f"sha256 mismatch for {artifact.filename}: expected {artifact.sha256}, got "
            f"{found.sha256} (the index's hash for {found.url}); nothing downloaded{kept}"
        )
    _download_verified(found.url, target, artifact.sha256, progress)
    return target


def set_aside_path(store: Path, filename: str, sha256: str) -> Path:
    """Where a cached file whose hash is not the current pin is kept: by-sha256/<hash>/<name>."""
    return store / "by-sha256" / sha256 / filename


def _move_aside(target: Path) -> Path:
    actual = sha256_file(target)
    aside = set_aside_path(target.parent, target.name, actual)
    aside.parent.mkdir(parents=True, exist_ok=True)
    os.replace(target, aside)
    _stamp_path(target).unlink(missing_ok=True)
    return aside


def _restore_set_aside(store: Path, filename: str, expected: str) -> bool:
    """Moves a copy kept aside under the pinned hash back into place, after hashing it again."""
    aside = set_aside_path(store, filename, expected)
    if not aside.is_file():
        return False
    if sha256_file(aside) != expected:
        aside.unlink()
        return False
    target = store / filename
    os.replace(aside, target)
    _write_stamp(target, expected)
    return True


def find_on_index(index_url: str, filename: str) -> IndexFile:
    """Resolve ``filename`` through the simple API (PEP 691 JSON, falling back to PEP 503 HTML)."""
    project = canonicalize_name(_project_of(filename))
    files = project_files(index_url, project)
    if filename not in files:
        raise FetchError(f"index {index_url} does not list {filename} "
                         f"({_project_page(index_url, project)})")
    return files[filename]


def _project_page(index_url: str, project: str) -> str:
    return f"{index_url.rstrip('/')}/{canonicalize_name(project)}/"


def project_files(index_url: str, project: str) -> dict[str, IndexFile]:
    """Every file the index lists for ``project``, by filename; FetchError when the index does
    not answer or has no such project."""
    page_url = _project_page(index_url, project)
    request = urllib.request.Request(page_url, headers={"Accept": _ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            content_type = response.headers.get("Content-Type", "")
            body = response.read()
            final_url = response.geturl()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise FetchError(f"index {index_url} has no project "
                             f"{canonicalize_name(project)!r} ({page_url})") from None
        raise FetchError(f"index {index_url} unreachable: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"index {index_url} unreachable: {reason}") from None

    if content_type.split(";")[0].strip() == SIMPLE_JSON:
        return _files_from_json(body, final_url)
    return _files_from_html(body.decode("utf-8", "replace"), final_url)


def _project_of(filename: str) -> str:
    if filename.endswith(".whl"):
        return filename.split("-", 1)[0]
    stem = re.sub(r"\.(tar\.gz|zip)$", "", filename)
    return stem.rsplit("-", 1)[0]


def _files_from_json(body: bytes, base_url: str) -> dict[str, IndexFile]:
    try:
        document = json.loads(body)
        entries = document["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise FetchError(f"index page {base_url} is not valid PEP 691 JSON: {exc}") from None
    files: dict[str, IndexFile] = {}
    for entry in entries:
        url = urllib.parse.urljoin(base_url, entry["url"])
        files[entry["filename"]] = IndexFile(url=url, sha256=entry.get("hashes", {}).get("sha256"),
                                             yanked=bool(entry.get("yanked")))
    return files


class _AnchorParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.hrefs.append((self._href, "".join(self._text).strip()))
            self._href = None


def _files_from_html(text: str, base_url: str) -> dict[str, IndexFile]:
    parser = _AnchorParser()
    parser.feed(text)
    files: dict[str, IndexFile] = {}
    for href, label in parser.hrefs:
        url, _, fragment = urllib.parse.urljoin(base_url, href).partition("#")
        name = label or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        sha256 = fragment[len("sha256="):] if fragment.startswith("sha256=") else None
        files[name] = IndexFile(url=url, sha256=sha256)
    return files


def _download_verified(url: str, target: Path, expected: str, progress: Progress) -> None:
    """Download to a temp file next to ``target``, verify, then rename into place."""
    fd, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    temp = Path(temp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
                    total = int(response.headers.get("Content-Length") or 0)
                    _copy_with_progress(response, out, digest, total, target.name, progress)
            except urllib.error.HTTPError as exc:
                raise FetchError(f"download of {url} failed: HTTP {exc.code} {exc.reason}") \
                    from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise FetchError(f"download of {url} failed: {reason}") from None
        actual = digest.hexdigest()
        if actual != expected:
            raise FetchError(
                f"sha256 mismatch for {target.name}: expected {expected}, got {actual} "
                f"(from {url}); the download was deleted"
            )
        os.replace(temp, target)
        _write_stamp(target, expected)
    finally:
        temp.unlink(missing_ok=True)


def _copy_with_progress(response: BinaryIO, out: BinaryIO, digest: hashlib._Hash, total: int,
                        name: str, progress: Progress) -> None:
    read, write = response.read, out.write
    started = last = time.monotonic()
    done = 0
    while block := read(_CHUNK):
        write(block)
        digest.update(block)
        done += len(block)
        now = time.monotonic()
        if now - last >= _PROGRESS_INTERVAL_S:
            last = now
            progress(_progress_line(name, done, total, now - started))
    progress(_progress_line(name, done, total, time.monotonic() - started))


def _progress_line(name: str, done: int, total: int, elapsed: float) -> str:
    rate = done / 1e6 / elapsed if elapsed > 0 else 0.0
    if total:
        return (f"fetch {name}: {100 * done // total:3d}% {done / 1e6:.1f}/{total / 1e6:.1f} MB "
                f"{rate:.1f} MB/s")
    return f"fetch {name}: {done / 1e6:.1f} MB {rate:.1f} MB/s"


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _stat_key(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _write_stamp(target: Path, sha256: str) -> None:
    stamp = {"sha256": sha256, **_stat_key(target)}
    temp = _stamp_path(target).with_suffix(".tmp")
    temp.write_text(json.dumps(stamp), encoding="utf-8")
    os.replace(temp, _stamp_path(target))


def _cached_file_valid(target: Path, expected: str, progress: Progress) -> bool:
    stamp_file = _stamp_path(target)
    try:
        stamp = json.loads(stamp_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stamp = None
    if stamp == {"sha256": expected, **_stat_key(target)}:
        return True
    started = time.monotonic()
    actual = sha256_file(target)
    progress(f"fetch {target.name}: verified cached copy in {time.monotonic() - started:.2f} s")
    if actual != expected:
        stamp_file.unlink(missing_ok=True)
        return False
    _write_stamp(target, expected)
    return True


# --- git sources pinned by commit -------------------------------------------------------------


def fetch_git_source(artifact: Artifact, *, cache_dir: Path,
                     progress: Progress = _quiet) -> tuple[Path, str]:
    """Fetch ``artifact.tag`` into a cached bare clone; return (repo path, commit).

    The tag must still resolve to the pinned commit: a moved tag is an error naming both.
    """
    import git  # gitpython: imported here so index-only builds do not need git on PATH

    if artifact.git is None or artifact.tag is None or artifact.commit is None:
        raise FetchError(f"artifact role {artifact.role!r} is not a pinned git source")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", artifact.git.rstrip("/").rsplit("/", 1)[-1])
    path = cache_dir / "git" / (name.removesuffix(".git") + ".git")
    path.parent.mkdir(parents=True, exist_ok=True)
    repo = git.Repo(path) if path.exists() else git.Repo.init(path, bare=True)
    refspec = f"+refs/tags/{artifact.tag}:refs/tags/{artifact.tag}"
    progress(f"fetch {artifact.git} tag {artifact.tag}")
    try:
        repo.git.fetch("--no-tags", artifact.git, refspec)
        resolved = repo.git.rev_parse(f"refs/tags/{artifact.tag}^{{commit}}").strip()
    except git.GitCommandError as exc:
        detail = (exc.stderr or "").strip().splitlines()
        raise FetchError(
            f"git fetch of tag {artifact.tag!r} from {artifact.git} failed: "
            f"{detail[-1] if detail else exc}"
        ) from None
    if resolved != artifact.commit:
        raise FetchError(
            f"tag {artifact.tag!r} of {artifact.git} resolves to {resolved}, "
            f"but the matrix pins commit {artifact.commit}"
        )
    return path, resolved
