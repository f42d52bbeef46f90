"""Re-packs a verified upstream wheel with rewritten files into a locally labelled build.

The base wheel is streamed once. Members that do not change are copied raw (local header and
compressed bytes as they are); rewritten members keep their compression method; new files go
just before the dist-info, whose directory is renamed to the new version. METADATA gets the new
`Version:`, WHEEL is kept byte for byte (its tags and any Build tag), RECORD is rewritten and a
provenance file is added. The wheel's file name keeps every upstream tag.

Integrity of raw-copied members: inflating them to check their CRC would cost as much as the
whole re-pack, so by default the sha256 of the entire base file is computed while it streams
(one pass over bytes that are read anyway) and compared with the pinned `base_sha256`; together
with structural checks of every header this catches truncation and any changed byte. Members
that are inflated anyway (METADATA, WHEEL, RECORD, every dist-info file) have CRC, size and
RECORD hash checked always. `verify=True` also inflates every raw-copied member and checks its
CRC, size and RECORD hash, for bases whose pinned digest is itself in doubt.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from forge import TOOLKIT_VERSION
from forge.errors import WheelError
from forge.wheelfile import (
    COPY_CHUNK,
    DEFLATED,
    REGULAR_FILE_ATTR,
    STORED,
    ContentChecker,
    RecordRow,
    ZipMember,
    ZipWriter,
    descriptor_size,
    format_record,
    inflate,
    parse_local_header,
    parse_record,
    read_central_directory,
    record_hash,
    record_hash_name,
    record_line_terminator,
    urlsafe_digest,
)

PROVENANCE_FILE = "kvcached_provenance.json"
_SIGNATURE_FILES = ("RECORD.jws", "RECORD.p7s")
_MANAGED_FILES = ("METADATA", "WHEEL", "RECORD", PROVENANCE_FILE, *_SIGNATURE_FILES)
_LABEL_RE = re.compile(r"[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_VERSION_HEADER_RE = re.compile(rb"^Version:[ \t]*(.*?)[ \t]*\r?$", re.MULTILINE | re.IGNORECASE)
_NAME_HEADER_RE = re.compile(rb"^Name:[ \t]*(.*?)[ \t]*\r?$", re.MULTILINE | re.IGNORECASE)
_PROGRESS_INTERVAL_S = 0.3
_MB = 1_000_000

Progress = Callable[[str], None]


@dataclass(frozen=True)
class RepackSpec:
    base_wheel: Path  # verified upstream wheel
    base_sha256: str
    replacements: Mapping[str, bytes]  # archive path -> new bytes (changed members and new files)
    build_label: str  # e.g. "kvcached.1"; composed with any existing local label
    provenance: Mapping[str, object]  # JSON-able; written to <dist-info>/kvcached_provenance.json


def compose_version(base_version: str, build_label: str) -> str:
    """`0.9.2` + `kvcached.1` -> `0.9.2+kvcached.1`; `0.25.1+cu130` -> `0.25.1+cu130.kvcached.1`."""
    if not _LABEL_RE.fullmatch(build_label):
        raise WheelError(f"build label {build_label!r} is not a valid PEP 440 local label")
    try:
        base = Version(base_version)
    except InvalidVersion as exc:
        raise WheelError(f"upstream version {base_version!r} is not PEP 440") from exc
    if base.local is not None and "kvcached" in base.local.lower():
        raise WheelError(
            f"version {base_version} already carries a kvcached label: "
            "re-pack the upstream wheel, not a patched build"
        )
    local = f"{base.local}.{build_label}" if base.local else build_label
    return str(Version(f"{base.public}+{local}"))


@dataclass(frozen=True)
class WheelName:
    """A wheel file name split into its parts, tags kept exactly as written."""

    distribution: str
    version: str
    build: str | None
    tags: str  # "python-abi-platform", compressed tag sets included

    @classmethod
    def parse(cls, filename: str) -> WheelName:
        if not filename.endswith(".whl"):
            raise WheelError(f"{filename}: not a wheel file name")
        parts = filename[: -len(".whl")].split("-")
        if len(parts) not in (5, 6) or not all(parts):
            raise WheelError(f"{filename}: wheel file name must have 5 or 6 dash-separated parts")
        build = parts[2] if len(parts) == 6 else None
        return cls(parts[0], parts[1], build, "-".join(parts[-3:]))

    def with_version(self, version: str) -> str:
        build = f"-{self.build}" if self.build else ""
        return f"{self.distribution}-{version}{build}-{self.tags}.whl"


def repack_wheel(
    spec: RepackSpec,
    out_dir: Path,
    *,
    progress: Progress | None = None,
    verify: bool = False,
) -> Path:
    """Builds the labelled wheel in `out_dir` and returns its path.

    The wheel is written to a temporary file in `out_dir` and renamed into place only when it
    is complete; on any failure nothing is left behind.
    """
    where = spec.base_wheel.name
    expected_sha = spec.base_sha256.lower()
    if not _SHA256_RE.fullmatch(expected_sha):
        raise WheelError(f"{where}: base_sha256 {spec.base_sha256!r} is not a sha256 hex digest")
    name = WheelName.parse(where)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        base = open(spec.base_wheel, "rb")  # noqa: SIM115 (closed in the finally below)
    except OSError as exc:
        raise WheelError(f"{where}: cannot open base wheel: {exc.strerror}") from exc
    fd, temp_name = tempfile.mkstemp(prefix=".repack-", suffix=".whl.part", dir=out_dir)
    temp_path = Path(temp_name)
    try:
        with base, open(fd, "wb") as out:
            job = _Repack(spec, name, base, out, progress, verify)
            target_name, stats = job.run(expected_sha)
        target = out_dir / target_name
        os.chmod(temp_path, 0o644)
        os.replace(temp_path, target)
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise
    if progress is not None:
        seconds = time.monotonic() - started
        progress(
            f"repack {target.name}: {stats.raw} copied raw, {stats.renamed} renamed, "
            f"{stats.rewritten} rewritten, {stats.added} added, "
            f"{target.stat().st_size / _MB:.1f} MB in {seconds:.1f} s"
        )
    return target


@dataclass
class _Stats:
    raw: int = 0
    renamed: int = 0
    rewritten: int = 0
    added: int = 0


@dataclass
class _Buffered:
    """A dist-info member held back until the end of the archive."""

    member: ZipMember
    compressed: bytes


@dataclass
class _Layout:
    dist_info: str  # "vllm-0.9.2.dist-info/"
    data_dir: str  # "vllm-0.9.2.data/"
    new_dist_info: str
    new_data_dir: str
    version: str
    new_version: str

    def rename(self, path: str) -> str:
        for old, new in ((self.dist_info, self.new_dist_info), (self.data_dir, self.new_data_dir)):
            if path.startswith(old):
                return new + path[len(old) :]
        return path


class _HashingReader:
    """Reads the base wheel front to back exactly once, hashing every byte it passes."""

    def __init__(self, f: io.BufferedReader, where: str) -> None:
        self._f = f
        self._where = where
        self.position = 0
        self.sha256 = hashlib.sha256()
        self._buffer = bytearray(COPY_CHUNK)

    def read(self, size: int) -> bytes:
        data = self._f.read(size)
        if len(data) != size:
            raise WheelError(f"{self._where}: truncated at offset {self.position + len(data)}")
        self.sha256.update(data)
        self.position += size
        return data

    def skip_to(self, offset: int) -> None:
        if offset < self.position:
            raise WheelError(
                f"{self._where}: member at offset {offset} overlaps the one before "
                f"(which ends at {self.position})"
            )
        self.pump(offset - self.position, [])

    def pump(self, size: int, sinks: list[Callable[[memoryview], object]]) -> None:
        view = memoryview(self._buffer)
        remaining = size
        while remaining:
            chunk = view[: min(remaining, COPY_CHUNK)]
            got = self._f.readinto(chunk)
            if not got:
                raise WheelError(f"{self._where}: truncated at offset {self.position}")
            piece = chunk[:got]
            self.sha256.update(piece)
            for sink in sinks:
                sink(piece)
            self.position += got
            remaining -= got


class _Repack:
    def __init__(
        self,
        spec: RepackSpec,
        name: WheelName,
        base: io.BufferedReader,
        out: BinaryIO,
        progress: Progress | None,
        verify: bool,
    ) -> None:
        self.spec = spec
        self.name = name
        self.where = spec.base_wheel.name
        self.base = base
        self.writer = ZipWriter(out)
        self.progress = progress
        self.verify = verify
        self.stats = _Stats()
        self.rows: dict[str, RecordRow] = {}  # output path -> RECORD row, in output order
        self.base_sources: dict[str, str] = {}  # output path -> base path it came from
        self.streamed_digests: dict[str, str] = {}  # base path -> sha256 seen while copying
        self.buffered: list[_Buffered] = []
        self.base_names: set[str] = set()
        self.base_file_sizes: dict[str, int] = {}  # every base file (not directory) -> size
        self._record_date_time: tuple[int, int, int, int, int, int] | None = None
        self._last_report = time.monotonic()

    def run(self, expected_sha: str) -> tuple[str, _Stats]:
        directory = read_central_directory(self.base, self.where)
        members = sorted(directory.members, key=lambda m: m.header_offset)
        layout = self._layout(members)
        self.base_names = {m.name for m in members}
        self.base_file_sizes = {m.name: m.file_size for m in members if not m.is_dir}
        record_member = next(m for m in members if m.name == layout.dist_info + "RECORD")
        self._record_date_time = record_member.date_time
        replacements = self._check_replacements(members, layout)
        self.base.seek(0)
        reader = _HashingReader(self.base, self.where)
        ends = [m.header_offset for m in members[1:]] + [directory.offset]
        copied = 0
        for index, (member, end) in enumerate(zip(members, ends, strict=True)):
            self._stream_member(reader, member, end, layout, replacements)
            copied += member.compressed_size
            self._report(index + 1, len(members), copied)
        reader.skip_to(directory.file_size)
        actual_sha = reader.sha256.hexdigest()
        if actual_sha != expected_sha:
            raise WheelError(
                f"{self.where}: sha256 is {actual_sha}, expected {expected_sha}: "
                "the base wheel changed after it was verified"
            )
        self._finish(layout, replacements)
        return self.name.with_version(layout.new_version), self.stats

    # ---- before streaming: names and checks ----

    def _layout(self, members: list[ZipMember]) -> _Layout:
        tops = {m.name.split("/", 1)[0] for m in members}
        dist_infos = sorted(top for top in tops if top.endswith(".dist-info"))
        if len(dist_infos) != 1:
            found = ", ".join(dist_infos) or "none"
            raise WheelError(f"{self.where}: expected one .dist-info directory, found {found}")
        stem = dist_infos[0][: -len(".dist-info")]
        dist_name, sep, version = stem.partition("-")
        if not sep or "-" in version:
            raise WheelError(f"{self.where}: dist-info directory {dist_infos[0]} is malformed")
        if canonicalize_name(dist_name) != canonicalize_name(self.name.distribution):
            raise WheelError(
                f"{self.where}: dist-info {dist_infos[0]} does not match the file name's "
                f"distribution {self.name.distribution}"
            )
        if _parse_version(version, self.where) != _parse_version(self.name.version, self.where):
            raise WheelError(
                f"{self.where}: dist-info version {version} differs from the file name's "
                f"{self.name.version}"
            )
        new_version = compose_version(version, self.spec.build_label)
        names = {m.name for m in members}
        for required in ("METADATA", "WHEEL", "RECORD"):
            if f"{dist_infos[0]}/{required}" not in names:
                raise WheelError(f"{self.where}: {dist_infos[0]}/{required} is missing")
        return _Layout(
            dist_info=f"{stem}.dist-info/",
            data_dir=f"{stem}.data/",
            new_dist_info=f"{dist_name}-{new_version}.dist-info/",
            new_data_dir=f"{dist_name}-{new_version}.data/",
            version=version,
            new_version=new_version,
        )

    def _check_replacements(self, members: list[ZipMember], layout: _Layout) -> dict[str, bytes]:
        by_name = {m.name: m for m in members}
        managed = {layout.dist_info + managed for managed in _MANAGED_FILES}
        checked: dict[str, bytes] = {}
        for path, data in self.spec.replacements.items():
            _check_archive_path(path, self.where)
            if path in managed:
                raise WheelError(f"{self.where}: {path} is written by the re-pack, not replaceable")
            if path + "/" in by_name or path.startswith(layout.new_dist_info):
                raise WheelError(f"{self.where}: replacement path {path} is not a file path")
            if not isinstance(data, bytes):
                raise WheelError(f"{self.where}: replacement for {path} is not bytes")
            checked[path] = data
        return checked

    # ---- streaming ----

    def _stream_member(
        self,
        reader: _HashingReader,
        member: ZipMember,
        end: int,
        layout: _Layout,
        replacements: Mapping[str, bytes],
    ) -> None:
        at = f"{self.where}: member {member.name} at offset {member.header_offset}"
        reader.skip_to(member.header_offset)
        fixed = reader.read(30)
        name_len, extra_len = parse_local_header(fixed, member, self.where)
        name_and_extra = reader.read(name_len + extra_len)
        if name_and_extra[:name_len] != member.raw_name:
            raise WheelError(f"{at}: local header names {name_and_extra[:name_len]!r}")
        data_end = reader.position + member.compressed_size
        if data_end > end:
            raise WheelError(f"{at}: data runs past the next member (offset {end})")
        new_name = layout.rename(member.name)

        if member.name.startswith(layout.dist_info):
            # held back (dist-info files are small): the dist-info is written last
            pieces: list[bytes] = []
            reader.pump(member.compressed_size, [lambda piece: pieces.append(bytes(piece))])
            self._skip_descriptor(reader, member, end, [])
            self.buffered.append(_Buffered(member, b"".join(pieces)))
        elif member.name in replacements:
            reader.pump(member.compressed_size, [])
            self._skip_descriptor(reader, member, end, [])
            self._write_replacement(member, new_name, replacements[member.name])
        else:
            sinks: list[Callable[[memoryview], object]] = [self.writer.write]
            checker = None
            if self.verify and not member.is_dir:
                checker = ContentChecker(member, "sha256")
                sinks.append(checker.feed)
            if new_name != member.name:
                self.writer.begin_renamed(member, new_name)
                reader.pump(member.compressed_size, sinks)
                self._skip_descriptor(reader, member, end, [])
                self.stats.renamed += 1
            else:
                self.writer.begin_raw(member, fixed + name_and_extra)
                reader.pump(member.compressed_size, sinks)
                self._skip_descriptor(reader, member, end, [self.writer.write])
                self.stats.raw += 1
            if checker is not None:
                digest = checker.finish(self.where)
                assert digest is not None
                self.streamed_digests[member.name] = digest
            if not member.is_dir:
                self.base_sources[new_name] = member.name

    def _skip_descriptor(
        self,
        reader: _HashingReader,
        member: ZipMember,
        end: int,
        sinks: list[Callable[[bytes], object]],
    ) -> None:
        if not member.uses_descriptor:
            return
        head = reader.read(4)
        size = descriptor_size(member, head)
        rest = reader.read(size - 4)
        descriptor = head + rest
        if reader.position > end:
            raise WheelError(
                f"{self.where}: data descriptor of {member.name} runs past offset {end}"
            )
        body = descriptor[4:] if descriptor.startswith(b"PK\x07\x08") else descriptor
        width = 8 if len(body) == 20 else 4
        crc = int.from_bytes(body[:4], "little")
        csize = int.from_bytes(body[4 : 4 + width], "little")
        usize = int.from_bytes(body[4 + width : 4 + 2 * width], "little")
        if (crc, csize, usize) != (member.crc32, member.compressed_size, member.file_size):
            raise WheelError(
                f"{self.where}: data descriptor of {member.name} at offset "
                f"{reader.position - size} differs from the central entry"
            )
        for sink in sinks:
            sink(descriptor)

    def _write_replacement(self, member: ZipMember, new_name: str, data: bytes) -> None:
        if member.method not in (STORED, DEFLATED):
            raise WheelError(
                f"{self.where}: cannot rewrite {member.name}: compression method {member.method}"
            )
        self.writer.add(
            new_name,
            data,
            method=member.method,
            date_time=self._fixed_date_time(),
            external_attr=member.external_attr,
            version_made_by=member.version_made_by,
        )
        self.rows[new_name] = RecordRow(new_name, record_hash(data), str(len(data)))
        self.stats.rewritten += 1

    def _fixed_date_time(self) -> tuple[int, int, int, int, int, int]:
        """Timestamp of every member this re-pack writes: the base RECORD's, so the output
        depends only on the inputs."""
        assert self._record_date_time is not None
        return self._record_date_time

    def _report(self, done: int, total: int, copied: int) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if now - self._last_report < _PROGRESS_INTERVAL_S and done != total:
            return
        self._last_report = now
        self.progress(f"repack {self.where}: {done}/{total} members, {copied / _MB:.0f} MB")

    # ---- after streaming: added files, dist-info, RECORD ----

    def _finish(self, layout: _Layout, replacements: Mapping[str, bytes]) -> None:
        buffered_by_name = {b.member.name: b for b in self.buffered}
        record_buffered = buffered_by_name[layout.dist_info + "RECORD"]
        record_text = self._inflate_text(record_buffered)
        base_rows = {row.path: row for row in parse_record(record_text, self.where)}
        self._check_record_covers_archive(base_rows, layout)
        self._fill_streamed_rows(base_rows)

        added = sorted(path for path in replacements if path not in self.base_names)
        date_time = self._fixed_date_time()
        for path in added:
            if not path.startswith(layout.dist_info):
                self._add_new(layout.rename(path), replacements[path], date_time)

        for buffered in self.buffered:
            self._write_dist_info_member(buffered, layout, replacements, base_rows)
        for path in added:
            if path.startswith(layout.dist_info):
                self._add_new(layout.rename(path), replacements[path], date_time)

        provenance_path = layout.new_dist_info + PROVENANCE_FILE
        provenance = self._provenance_document(layout, replacements, added)
        self.writer.add(
            provenance_path,
            provenance,
            method=DEFLATED,
            date_time=date_time,
            external_attr=REGULAR_FILE_ATTR,
        )
        self.rows[provenance_path] = RecordRow(
            provenance_path, record_hash(provenance), str(len(provenance))
        )

        record_path = layout.new_dist_info + "RECORD"
        ordered = [self.rows[e.name] for e in self.writer.entries if e.name in self.rows]
        ordered.append(RecordRow(record_path, "", ""))
        record = format_record(ordered, record_line_terminator(record_text))
        record_member = record_buffered.member
        self.writer.add(
            record_path,
            record,
            method=record_member.method if record_member.method == STORED else DEFLATED,
            date_time=date_time,
            external_attr=record_member.external_attr,
            version_made_by=record_member.version_made_by,
        )
        self.writer.close()

    def _write_dist_info_member(
        self,
        buffered: _Buffered,
        layout: _Layout,
        replacements: Mapping[str, bytes],
        base_rows: Mapping[str, RecordRow],
    ) -> None:
        member = buffered.member
        new_name = layout.rename(member.name)
        leaf = member.name[len(layout.dist_info) :]
        if leaf in ("RECORD", *_SIGNATURE_FILES):
            return  # RECORD is rewritten last; signatures of the old RECORD no longer hold
        if member.name in replacements:
            self._write_replacement(member, new_name, replacements[member.name])
            return
        if member.is_dir:
            self.writer.begin_renamed(member, new_name)
            self.stats.renamed += 1
            return
        # dist-info files are small: inflate them to check CRC and RECORD hash
        data = inflate(member, buffered.compressed, self.where)
        self._check_against_record(base_rows, member.name, data)
        if leaf == "METADATA":
            self._write_replacement(
                member, new_name, _set_metadata_version(data, layout, self.where)
            )
            return
        self.writer.begin_renamed(member, new_name)
        self.writer.write(buffered.compressed)
        row = base_rows[member.name]
        self.rows[new_name] = RecordRow(new_name, row.hash, row.size)
        self.stats.renamed += 1

    def _inflate_text(self, buffered: _Buffered) -> str:
        data = inflate(buffered.member, buffered.compressed, self.where)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WheelError(f"{self.where}: {buffered.member.name} is not UTF-8") from exc

    def _check_record_covers_archive(
        self, base_rows: Mapping[str, RecordRow], layout: _Layout
    ) -> None:
        unlisted = {layout.dist_info + name for name in ("RECORD", *_SIGNATURE_FILES)}
        files = set(self.base_file_sizes) - unlisted
        missing = sorted(files - set(base_rows))
        if missing:
            raise WheelError(f"{self.where}: RECORD does not list {missing[0]}")
        extra = sorted(set(base_rows) - files - unlisted)
        if extra:
            raise WheelError(f"{self.where}: RECORD lists {extra[0]}, which is not in the wheel")
        for path, size in self.base_file_sizes.items():
            row = base_rows.get(path)
            if row is not None and path not in unlisted and row.size != str(size):
                raise WheelError(
                    f"{self.where}: RECORD gives {path} size {row.size}, the archive {size}"
                )

    def _fill_streamed_rows(self, base_rows: Mapping[str, RecordRow]) -> None:
        for new_name, base_name in self.base_sources.items():
            row = base_rows[base_name]
            record_hash_name(row, self.where)
            streamed = self.streamed_digests.get(base_name)
            if streamed is not None and streamed != row.hash:
                if not row.hash.startswith("sha256="):
                    raise WheelError(
                        f"{self.where}: cannot verify {base_name}: RECORD hash is not sha256"
                    )
                raise WheelError(
                    f"{self.where}: {base_name} does not match its RECORD hash ({row.hash})"
                )
            self.rows[new_name] = RecordRow(new_name, row.hash, row.size)

    def _check_against_record(
        self, base_rows: Mapping[str, RecordRow], base_name: str, data: bytes
    ) -> None:
        row = base_rows[base_name]
        algorithm = record_hash_name(row, self.where)
        digest = hashlib.new(algorithm, data).digest()
        if row.hash != f"{algorithm}={urlsafe_digest(digest)}" or row.size != str(len(data)):
            raise WheelError(f"{self.where}: {base_name} does not match its RECORD hash or size")

    def _add_new(
        self, path: str, data: bytes, date_time: tuple[int, int, int, int, int, int]
    ) -> None:
        self.writer.add(
            path, data, method=DEFLATED, date_time=date_time, external_attr=REGULAR_FILE_ATTR
        )
        self.rows[path] = RecordRow(path, record_hash(data), str(len(data)))
        self.stats.added += 1

    def _provenance_document(
        self, layout: _Layout, replacements: Mapping[str, bytes], added: list[str]
    ) -> bytes:
        if "repack" in self.spec.provenance:
            raise WheelError("provenance key 'repack' is reserved for the re-pack's own record")
        document: dict[str, object] = dict(self.spec.provenance)
        document["repack"] = {
            "base_wheel": self.where,
            "base_sha256": self.spec.base_sha256.lower(),
            "base_version": layout.version,
            "version": layout.new_version,
            "build_label": self.spec.build_label,
            "toolkit_version": TOOLKIT_VERSION,
            "rewritten": sorted(layout.rename(p) for p in replacements if p not in added),
            "added": [layout.rename(p) for p in added],
        }
        try:
            text = json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise WheelError(f"provenance cannot be written as JSON: {exc}") from exc
        return (text + "\n").encode("utf-8")


def _parse_version(text: str, where: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion as exc:
        raise WheelError(f"{where}: version {text!r} is not PEP 440") from exc


def _check_archive_path(path: str, where: str) -> None:
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise WheelError(f"{where}: replacement path {path!r} is not a relative archive path")


def _set_metadata_version(metadata: bytes, layout: _Layout, where: str) -> bytes:
    """Replaces the `Version:` header (and only the header) of METADATA."""
    split = re.search(rb"\r?\n\r?\n", metadata)
    header_end = split.start() if split else len(metadata)
    headers = metadata[:header_end]
    found = list(_VERSION_HEADER_RE.finditer(headers))
    if len(found) != 1:
        raise WheelError(f"{where}: METADATA has {len(found)} Version headers, not 1")
    match = found[0]
    current = match.group(1).decode("utf-8", "replace")
    if _parse_version(current, where) != _parse_version(layout.version, where):
        raise WheelError(
            f"{where}: METADATA Version {current} differs from the dist-info's {layout.version}"
        )
    if not _NAME_HEADER_RE.search(headers):
        raise WheelError(f"{where}: METADATA has no Name header")
    start, end = match.span(1)
    return metadata[:start] + layout.new_version.encode("ascii") + metadata[end:]


def read_provenance(wheel: Path) -> dict:
    """The provenance document of a re-packed wheel."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [
                n
                for n in archive.namelist()
                if n.count("/") == 1 and n.endswith(f".dist-info/{PROVENANCE_FILE}")
            ]
            if len(names) != 1:
                raise WheelError(f"{wheel.name}: has {len(names)} {PROVENANCE_FILE} files, not 1")
            document = json.loads(archive.read(names[0]))
    except (OSError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise WheelError(f"{wheel.name}: cannot read provenance: {exc}") from exc
    if not isinstance(document, dict):
        raise WheelError(f"{wheel.name}: provenance is not a JSON object")
    return document


def verify_wheel(wheel: Path) -> int:
    """Inflates every member of a wheel and checks CRC, RECORD hash and size of each file.

    Returns the number of files checked. Independent of the re-pack's own reader: it uses the
    standard library's zip implementation.
    """
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            dist_infos = {n.split("/", 1)[0] for n in names if ".dist-info/" in n}
            if len(dist_infos) != 1:
                raise WheelError(f"{wheel.name}: expected one .dist-info directory")
            dist_info = dist_infos.pop()
            record_path = f"{dist_info}/RECORD"
            rows = parse_record(archive.read(record_path).decode("utf-8"), wheel.name)
            by_path = {row.path: row for row in rows}
            files = [n for n in names if not n.endswith("/")]
            unsigned = {record_path} | {f"{dist_info}/{s}" for s in _SIGNATURE_FILES}
            for name in files:
                if name in unsigned:
                    continue
                row = by_path.get(name)
                if row is None:
                    raise WheelError(f"{wheel.name}: RECORD does not list {name}")
                algorithm = record_hash_name(row, wheel.name)
                digest = hashlib.new(algorithm)
                size = 0
                with archive.open(name) as member:
                    while chunk := member.read(COPY_CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
                if row.hash != f"{algorithm}={urlsafe_digest(digest.digest())}":
                    raise WheelError(f"{wheel.name}: {name} does not match its RECORD hash")
                if row.size != str(size):
                    raise WheelError(
                        f"{wheel.name}: {name} is {size} bytes, RECORD says {row.size}"
                    )
            unknown = sorted(set(by_path) - set(files))
            if unknown:
                raise WheelError(f"{wheel.name}: RECORD lists {unknown[0]}, not in the wheel")
            return len(files) - 1
    except (OSError, zipfile.BadZipFile, KeyError) as exc:
        raise WheelError(f"{wheel.name}: {exc}") from exc
