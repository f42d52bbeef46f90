"""Uploads wheels to a package index in the legacy upload format (what twine speaks).

pypiserver, devpi and warehouse-style indexes accept it. Before anything is uploaded, the index's
simple API is asked whether any of the files is already there: a version is never uploaded twice,
and a batch is refused whole rather than half published.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from email.parser import BytesParser
from pathlib import Path

from packaging.utils import canonicalize_name

from forge.errors import PublishError, WheelError
from forge.repack import WheelName
from forge.wheelfile import COPY_CHUNK

_HREF_RE = re.compile(r"""href\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_MB = 1_000_000
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class _Upload:
    path: Path
    name: str
    version: str
    fields: list[tuple[str, str]]


def publish(
    files: Sequence[Path],
    repository_url: str,
    *,
    username: str | None = None,
    password: str | None = None,
    progress: Callable[[str], None] | None = None,
    simple_url: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Uploads `files` (wheels) to `repository_url`, in the order given.

    `simple_url` is the index's PEP 503 root; by default `<repository_url>/simple/`, which is
    where pypiserver serves it (devpi: `<index>/+simple/`).
    """
    uploads = [_describe(Path(path)) for path in files]
    names = [upload.path.name for upload in uploads]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise PublishError(f"{duplicates[0]} is given twice")
    simple = simple_url or urllib.parse.urljoin(repository_url.rstrip("/") + "/", "simple/")
    headers = {"User-Agent": "forge-publish"}
    if username is not None or password is not None:
        token = base64.b64encode(f"{username or ''}:{password or ''}".encode()).decode("ascii")
        headers["Authorization"] = f"Basic {token}"

    for upload in uploads:
        present = _files_on_index(simple, upload.name, headers, timeout_s)
        if upload.path.name in present:
            raise PublishError(_already_there(upload, repository_url))
    for upload in uploads:
        size = upload.path.stat().st_size
        if progress is not None:
            progress(f"upload {upload.path.name} ({size / _MB:.1f} MB) to {repository_url}")
        started = time.monotonic()
        _post(upload, repository_url, headers, timeout_s)
        if progress is not None:
            progress(f"uploaded {upload.path.name} in {time.monotonic() - started:.1f} s")


def _already_there(upload: _Upload, url: str) -> str:
    return f"{upload.name} {upload.version} is already on {url}: bump the cell's build number"


def _describe(path: Path) -> _Upload:
    """Reads what the upload form needs from the wheel's METADATA."""
    if not path.is_file():
        raise PublishError(f"{path}: no such file")
    try:
        wheel_name = WheelName.parse(path.name)
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
    sha256 = hashlib.sha256()
    blake2 = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK):
            sha256.update(chunk)
            blake2.update(chunk)
    fields = [
        (":action", "file_upload"),
        ("protocol_version", "1"),
        ("metadata_version", message.get("Metadata-Version", "2.1")),
        ("name", name),
        ("version", version),
        ("summary", message.get("Summary", "")),
        ("filetype", "bdist_wheel"),
        ("pyversion", wheel_name.tags.split("-")[0]),
        ("sha256_digest", sha256.hexdigest()),
        ("blake2_256_digest", blake2.hexdigest()),
    ]
    fields += [("requires_dist", value) for value in message.get_all("Requires-Dist") or []]
    fields += (
        [("requires_python", message["Requires-Python"])] if "Requires-Python" in message else []
    )
    return _Upload(path, name, version, fields)


def _files_on_index(simple: str, name: str, headers: dict[str, str], timeout_s: float) -> set[str]:
    """File names the index lists for a project; empty when it does not know the project."""
    url = urllib.parse.urljoin(simple.rstrip("/") + "/", canonicalize_name(name) + "/")
    request = urllib.request.Request(url, headers={**headers, "Accept": "text/html"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            page = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return set()
        raise PublishError(f"index {url} answered HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise PublishError(f"index {simple} unreachable: {_reason(exc)}") from exc
    files: set[str] = set()
    for href in _HREF_RE.findall(page):
        path = urllib.parse.urlsplit(href).path
        files.add(urllib.parse.unquote(path.rsplit("/", 1)[-1]))
    return files


def _post(upload: _Upload, url: str, headers: dict[str, str], timeout_s: float) -> None:
    boundary = uuid.uuid5(uuid.NAMESPACE_URL, upload.path.name).hex
    head, tail = _multipart_frame(upload, boundary)
    length = len(head) + upload.path.stat().st_size + len(tail)

    def body() -> Iterator[bytes]:
        yield head
        with open(upload.path, "rb") as f:
            while chunk := f.read(COPY_CHUNK):
                yield chunk
        yield tail

    request = urllib.request.Request(
        url,
        data=body(),
        method="POST",
        headers={
            **headers,
            "Content-Type": f"multipart/form-data; boundary={boundary}",
            "Content-Length": str(length),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")
        if exc.code == 409 or (exc.code == 400 and "already exist" in detail.lower()):
            raise PublishError(_already_there(upload, url)) from exc
        first_line = detail.strip().splitlines()[0] if detail.strip() else ""
        raise PublishError(
            f"{url} refused {upload.path.name}: HTTP {exc.code} {exc.reason} {first_line}".strip()
        ) from exc
    except (urllib.error.URLError, OSError) as exc:
        raise PublishError(f"index {url} unreachable: {_reason(exc)}") from exc


def _multipart_frame(upload: _Upload, boundary: str) -> tuple[bytes, bytes]:
    """The form fields and the file part's header (head), and the closing boundary (tail)."""
    parts: list[bytes] = []
    for key, value in upload.fields:
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n'.encode()
            + value.encode("utf-8")
            + b"\r\n"
        )
    parts.append(
        (
            f"--{boundary}\r\n"
            f'Content-Disposition: form-data; name="content"; filename="{upload.path.name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
    )
    return b"".join(parts), f"\r\n--{boundary}--\r\n".encode()


def _reason(exc: BaseException) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__
