"""Zip archives at the level of headers and compressed bytes, plus the wheel RECORD format.

Re-packing a large engine wheel must not inflate and deflate hundreds of megabytes that do not
change, so this module reads the central directory itself and exposes each member's local header
and compressed span: a writer can then copy a member byte for byte, or give its unchanged
compressed data a new name, or write a new member with a fixed timestamp and attributes.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import BinaryIO

from forge.errors import WheelError

STORED = 0
DEFLATED = 8

_EOCD = struct.Struct("<4sHHHHLLH")
_EOCD_SIG = b"PK\x05\x06"
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_LOCATOR_SIG = b"PK\x06\x07"
_ZIP64_EOCD = struct.Struct("<4sQHHLLQQQQ")
_ZIP64_EOCD_SIG = b"PK\x06\x06"
_CENTRAL = struct.Struct("<4sHHHHHHLLLHHHHHLL")
_CENTRAL_SIG = b"PK\x01\x02"
_LOCAL = struct.Struct("<4sHHHHHLLLHH")
_LOCAL_SIG = b"PK\x03\x04"
_DESCRIPTOR_SIG = b"PK\x07\x08"
_ZIP64_EXTRA_ID = 0x0001
_MAX_COMMENT = 0xFFFF
_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFFFFFF
_FLAG_DESCRIPTOR = 0x08
_FLAG_UTF8 = 0x800
_FLAG_ENCRYPTED = 0x01
_UNIX = 3
_MADE_BY_VERSION = 20
_ZIP64_VERSION = 45
COPY_CHUNK = 1 << 20

REGULAR_FILE_ATTR = (0o100644 << 16) & _U32_MAX
DIRECTORY_ATTR = ((0o040755 << 16) | 0x10) & _U32_MAX
# Earliest time a zip header can express; used where no source timestamp exists.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class ZipMember:
    """One central-directory entry, with zip64 values already folded in."""

    name: str
    raw_name: bytes
    version_made_by: int
    version_needed: int
    flags: int
    method: int
    mod_time: int
    mod_date: int
    crc32: int
    compressed_size: int
    file_size: int
    internal_attr: int
    external_attr: int
    header_offset: int
    extra: bytes
    comment: bytes

    @property
    def is_dir(self) -> bool:
        return self.name.endswith("/")

    @property
    def uses_descriptor(self) -> bool:
        return bool(self.flags & _FLAG_DESCRIPTOR)

    @property
    def date_time(self) -> tuple[int, int, int, int, int, int]:
        return dos_to_date_time(self.mod_date, self.mod_time)


@dataclass(frozen=True)
class CentralDirectory:
    members: tuple[ZipMember, ...]
    offset: int
    size: int
    file_size: int


@dataclass(frozen=True)
class LocalHeader:
    """A member's local header as found in the file, and where its data lies."""

    raw: bytes
    data_offset: int
    descriptor_size: int


def dos_to_date_time(dos_date: int, dos_time: int) -> tuple[int, int, int, int, int, int]:
    return (
        (dos_date >> 9) + 1980,
        (dos_date >> 5) & 0xF,
        dos_date & 0x1F,
        dos_time >> 11,
        (dos_time >> 5) & 0x3F,
        (dos_time & 0x1F) * 2,
    )


def date_time_to_dos(date_time: tuple[int, int, int, int, int, int]) -> tuple[int, int]:
    """(dos_date, dos_time) of a timestamp; the zip format counts seconds in pairs."""
    year, month, day, hour, minute, second = date_time
    if not 1980 <= year <= 2107:
        raise WheelError(f"timestamp {date_time} cannot be stored in a zip header")
    return (year - 1980) << 9 | month << 5 | day, hour << 11 | minute << 5 | second // 2


def _decode_name(raw: bytes, flags: int) -> str:
    return raw.decode("utf-8" if flags & _FLAG_UTF8 else "cp437")


def _zip64_values(extra: bytes, wanted: list[str], where: str) -> tuple[dict[str, int], bytes]:
    """Reads the zip64 extra field: the values named in `wanted`, in the order the format fixes.

    Returns them and the extra data with the zip64 field removed (a writer adds it back only
    where its own offsets need it).
    """
    values: dict[str, int] = {}
    kept = bytearray()
    pos = 0
    while pos + 4 <= len(extra):
        field_id, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        if len(body) != size:
            raise WheelError(f"{where}: extra field runs past its end")
        if field_id == _ZIP64_EXTRA_ID:
            if len(body) < 8 * len(wanted):
                raise WheelError(f"{where}: zip64 extra field is too short")
            for index, key in enumerate(wanted):
                values[key] = struct.unpack_from("<Q", body, 8 * index)[0]
        else:
            kept += extra[pos : pos + 4 + size]
        pos += 4 + size
    if len(values) != len(wanted):
        raise WheelError(f"{where}: sizes need a zip64 extra field, which is missing")
    return values, bytes(kept)


def _find_eocd(f: BinaryIO, file_size: int, where: str) -> tuple[int, tuple[int, ...]]:
    tail_size = min(file_size, _EOCD.size + _MAX_COMMENT)
    f.seek(file_size - tail_size)
    tail = f.read(tail_size)
    pos = tail.rfind(_EOCD_SIG)
    while pos >= 0:
        if pos + _EOCD.size <= len(tail):
            fields = _EOCD.unpack_from(tail, pos)
            if pos + _EOCD.size + fields[7] == len(tail):
                return file_size - tail_size + pos, fields
        pos = tail.rfind(_EOCD_SIG, 0, pos)
    raise WheelError(
        f"{where}: not a zip archive or truncated (no end-of-central-directory record)"
    )


def read_central_directory(f: BinaryIO, where: str) -> CentralDirectory:
    """Parses the central directory of the archive open in `f` (`where` names it in errors)."""
    file_size = f.seek(0, io.SEEK_END)
    eocd_offset, eocd = _find_eocd(f, file_size, where)
    _, disk, cd_disk, _, count, cd_size, cd_offset, _ = eocd
    directory_end = eocd_offset
    if _U32_MAX in (cd_size, cd_offset) or count == _U16_MAX:
        locator_offset = eocd_offset - _ZIP64_LOCATOR.size
        f.seek(max(locator_offset, 0))
        locator = f.read(_ZIP64_LOCATOR.size)
        if len(locator) != _ZIP64_LOCATOR.size or not locator.startswith(_ZIP64_LOCATOR_SIG):
            raise WheelError(f"{where}: zip64 locator missing before offset {eocd_offset}")
        zip64_offset = _ZIP64_LOCATOR.unpack(locator)[2]
        f.seek(zip64_offset)
        record = f.read(_ZIP64_EOCD.size)
        if len(record) != _ZIP64_EOCD.size or not record.startswith(_ZIP64_EOCD_SIG):
            raise WheelError(f"{where}: zip64 end record missing at offset {zip64_offset}")
        fields = _ZIP64_EOCD.unpack(record)
        disk, cd_disk, count, cd_size, cd_offset = fields[4], fields[5], fields[7], *fields[8:]
        directory_end = zip64_offset
    if disk != 0 or cd_disk != 0:
        raise WheelError(f"{where}: multi-disk archives are not supported")
    if cd_offset + cd_size != directory_end:
        raise WheelError(
            f"{where}: central directory at offset {cd_offset} (+{cd_size} bytes) does not end "
            f"at the end record (offset {directory_end}); truncated or prefixed archive"
        )
    f.seek(cd_offset)
    data = f.read(cd_size)
    if len(data) != cd_size:
        raise WheelError(f"{where}: central directory truncated at offset {cd_offset}")
    members: list[ZipMember] = []
    seen: set[str] = set()
    pos = 0
    while pos < len(data):
        entry_where = f"{where}: central directory entry at offset {cd_offset + pos}"
        if pos + _CENTRAL.size > len(data) or data[pos : pos + 4] != _CENTRAL_SIG:
            raise WheelError(f"{entry_where}: bad signature")
        (
            _,
            made_by,
            needed,
            flags,
            method,
            mod_time,
            mod_date,
            crc,
            csize,
            usize,
            name_len,
            extra_len,
            comment_len,
            _disk_start,
            internal_attr,
            external_attr,
            header_offset,
        ) = _CENTRAL.unpack_from(data, pos)
        pos += _CENTRAL.size
        raw_name = data[pos : pos + name_len]
        extra = data[pos + name_len : pos + name_len + extra_len]
        comment = data[pos + name_len + extra_len : pos + name_len + extra_len + comment_len]
        pos += name_len + extra_len + comment_len
        if pos > len(data):
            raise WheelError(f"{entry_where}: entry runs past the central directory")
        name = _decode_name(raw_name, flags)
        wanted = [
            key
            for key, value in (("usize", usize), ("csize", csize), ("offset", header_offset))
            if value == _U32_MAX
        ]
        if wanted:
            values, extra = _zip64_values(extra, wanted, f"{entry_where} ({name})")
            usize = values.get("usize", usize)
            csize = values.get("csize", csize)
            header_offset = values.get("offset", header_offset)
        else:
            extra = _zip64_values(extra, [], f"{entry_where} ({name})")[1]
        if flags & _FLAG_ENCRYPTED:
            raise WheelError(f"{where}: member {name} is encrypted")
        if name in seen:
            raise WheelError(f"{where}: member {name} appears twice")
        seen.add(name)
        members.append(
            ZipMember(
                name=name,
                raw_name=raw_name,
                version_made_by=made_by,
                version_needed=needed,
                flags=flags,
                method=method,
                mod_time=mod_time,
                mod_date=mod_date,
                crc32=crc,
                compressed_size=csize,
                file_size=usize,
                internal_attr=internal_attr,
                external_attr=external_attr,
                header_offset=header_offset,
                extra=extra,
                comment=comment,
            )
        )
    if len(members) != count:
        raise WheelError(
            f"{where}: central directory holds {len(members)} entries, end record says {count}"
        )
    return CentralDirectory(tuple(members), cd_offset, cd_size, file_size)


def parse_local_header(raw: bytes, member: ZipMember, where: str) -> tuple[int, int]:
    """Checks a member's local header against its central entry.

    `raw` holds at least the fixed part of the header. Returns (name length, extra length).
    """
    at = f"{where}: member {member.name} at offset {member.header_offset}"
    if len(raw) < _LOCAL.size or raw[:4] != _LOCAL_SIG:
        raise WheelError(f"{at}: bad local header signature (truncated or corrupt)")
    _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len = _LOCAL.unpack_from(raw)
    if method != member.method:
        raise WheelError(f"{at}: local header says method {method}, central says {member.method}")
    # With a data descriptor the local fields may be zero; with zip64 they are 0xFFFFFFFF and
    # the central entry carries the real sizes.
    if not flags & _FLAG_DESCRIPTOR and (
        crc != member.crc32
        or csize not in (member.compressed_size, _U32_MAX)
        or usize not in (member.file_size, _U32_MAX)
    ):
        raise WheelError(f"{at}: CRC or sizes in the local header differ from the central entry")
    return name_len, extra_len


def descriptor_size(member: ZipMember, head: bytes) -> int:
    """Size of the data descriptor after a member's data; `head` is its first bytes (>= 4)."""
    if not member.uses_descriptor:
        return 0
    signed = head.startswith(_DESCRIPTOR_SIG)
    wide = member.compressed_size >= _U32_MAX or member.file_size >= _U32_MAX
    return (4 if signed else 0) + 4 + (16 if wide else 8)


class ZipWriter:
    """Writes an archive sequentially: raw copies of existing members and new members."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._offset = 0
        self._entries: list[ZipMember] = []

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def entries(self) -> tuple[ZipMember, ...]:
        return tuple(self._entries)

    def write(self, data: bytes | memoryview) -> None:
        self._out.write(data)
        self._offset += len(data)

    def begin_raw(self, member: ZipMember, local_header: bytes) -> None:
        """Starts a verbatim copy: the caller writes the data (and descriptor) with `write`."""
        self._entries.append(replace(member, header_offset=self._offset))
        self.write(local_header)

    def begin_renamed(self, member: ZipMember, new_name: str) -> None:
        """Starts a copy of a member's compressed data under a new name.

        The new local header carries CRC and sizes directly, so the caller writes only the
        compressed data, without any data descriptor.
        """
        raw_name = new_name.encode("utf-8")
        flags = (member.flags & ~_FLAG_DESCRIPTOR) | (_FLAG_UTF8 if not raw_name.isascii() else 0)
        entry = replace(
            member, name=new_name, raw_name=raw_name, flags=flags, header_offset=self._offset
        )
        self._entries.append(entry)
        self.write(_local_header(entry))

    def add(
        self,
        name: str,
        data: bytes,
        *,
        method: int,
        date_time: tuple[int, int, int, int, int, int],
        external_attr: int,
        version_made_by: int = (_UNIX << 8) | _MADE_BY_VERSION,
    ) -> ZipMember:
        """Writes a new member; deflate output is fixed by zlib's level 6 for the same input."""
        if method == DEFLATED:
            compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
            payload = compressor.compress(data) + compressor.flush()
        elif method == STORED:
            payload = data
        else:
            raise WheelError(f"cannot write {name}: compression method {method} is not supported")
        if len(payload) >= _U32_MAX or len(data) >= _U32_MAX:
            raise WheelError(f"cannot write {name}: members over 4 GiB are not supported")
        raw_name = name.encode("utf-8")
        dos_date, dos_time = date_time_to_dos(date_time)
        entry = ZipMember(
            name=name,
            raw_name=raw_name,
            version_made_by=version_made_by,
            version_needed=20 if method == DEFLATED or name.endswith("/") else 10,
            flags=0 if raw_name.isascii() else _FLAG_UTF8,
            method=method,
            mod_time=dos_time,
            mod_date=dos_date,
            crc32=zlib.crc32(data),
            compressed_size=len(payload),
            file_size=len(data),
            internal_attr=0,
            external_attr=external_attr,
            header_offset=self._offset,
            extra=b"",
            comment=b"",
        )
        self._entries.append(entry)
        self.write(_local_header(entry))
        self.write(payload)
        return entry

    def close(self) -> None:
        """Writes the central directory and end records (zip64 ones where sizes need them)."""
        cd_offset = self._offset
        for entry in self._entries:
            self.write(_central_entry(entry))
        cd_size = self._offset - cd_offset
        count = len(self._entries)
        if count >= _U16_MAX or cd_offset >= _U32_MAX or cd_size >= _U32_MAX:
            zip64_offset = self._offset
            self.write(
                _ZIP64_EOCD.pack(
                    _ZIP64_EOCD_SIG,
                    _ZIP64_EOCD.size - 12,
                    (_UNIX << 8) | _ZIP64_VERSION,
                    _ZIP64_VERSION,
                    0,
                    0,
                    count,
                    count,
                    cd_size,
                    cd_offset,
                )
            )
            self.write(_ZIP64_LOCATOR.pack(_ZIP64_LOCATOR_SIG, 0, zip64_offset, 1))
        self.write(
            _EOCD.pack(
                _EOCD_SIG,
                0,
                0,
                min(count, _U16_MAX),
                min(count, _U16_MAX),
                min(cd_size, _U32_MAX),
                min(cd_offset, _U32_MAX),
                0,
            )
        )


def _local_header(entry: ZipMember) -> bytes:
    return (
        _LOCAL.pack(
            _LOCAL_SIG,
            entry.version_needed,
            entry.flags,
            entry.method,
            entry.mod_time,
            entry.mod_date,
            entry.crc32,
            entry.compressed_size,
            entry.file_size,
            len(entry.raw_name),
            0,
        )
        + entry.raw_name
    )


def _central_entry(entry: ZipMember) -> bytes:
    zip64: list[int] = []
    usize, csize, offset = entry.file_size, entry.compressed_size, entry.header_offset
    if usize >= _U32_MAX:
        zip64.append(usize)
        usize = _U32_MAX
    if csize >= _U32_MAX:
        zip64.append(csize)
        csize = _U32_MAX
    if offset >= _U32_MAX:
        zip64.append(offset)
        offset = _U32_MAX
    extra = entry.extra
    needed = entry.version_needed
    if zip64:
        extra = struct.pack(f"<HH{len(zip64)}Q", _ZIP64_EXTRA_ID, 8 * len(zip64), *zip64) + extra
        needed = max(needed, _ZIP64_VERSION)
    return (
        _CENTRAL.pack(
            _CENTRAL_SIG,
            entry.version_made_by,
            needed,
            entry.flags,
            entry.method,
            entry.mod_time,
            entry.mod_date,
            entry.crc32,
            csize,
            usize,
            len(entry.raw_name),
            len(extra),
            len(entry.comment),
            0,
            entry.internal_attr,
            entry.external_attr,
            offset,
        )
        + entry.raw_name
        + extra
        + entry.comment
    )


def inflate(member: ZipMember, compressed: bytes, where: str) -> bytes:
    """Decompresses a member's data and checks it against the CRC and size of its entry."""
    if member.method == STORED:
        data = compressed
    elif member.method == DEFLATED:
        try:
            decompressor = zlib.decompressobj(-15)
            data = decompressor.decompress(compressed) + decompressor.flush()
        except zlib.error as exc:
            raise WheelError(f"{where}: member {member.name} does not inflate: {exc}") from exc
    else:
        raise WheelError(
            f"{where}: member {member.name} uses compression method {member.method}, "
            "which forge cannot rewrite"
        )
    check_content(member, len(data), zlib.crc32(data), where)
    return data


def check_content(member: ZipMember, size: int, crc: int, where: str) -> None:
    if size != member.file_size or crc != member.crc32:
        raise WheelError(
            f"{where}: member {member.name} at offset {member.header_offset} is corrupt "
            f"(size {size} / CRC {crc:08x}, header says {member.file_size} / {member.crc32:08x})"
        )


class ContentChecker:
    """Inflates a member's compressed data as it streams by, for CRC and RECORD hash checks."""

    def __init__(self, member: ZipMember, hash_name: str | None) -> None:
        if member.method not in (STORED, DEFLATED):
            raise WheelError(f"cannot verify {member.name}: compression method {member.method}")
        self._member = member
        self._inflater = zlib.decompressobj(-15) if member.method == DEFLATED else None
        self._crc = 0
        self._size = 0
        self._hash = hashlib.new(hash_name) if hash_name else None

    def feed(self, compressed: bytes | memoryview) -> None:
        data = self._inflater.decompress(compressed) if self._inflater else bytes(compressed)
        self._take(data)

    def _take(self, data: bytes) -> None:
        self._crc = zlib.crc32(data, self._crc)
        self._size += len(data)
        if self._hash is not None:
            self._hash.update(data)

    def finish(self, where: str) -> str | None:
        """Checks CRC and size; returns the digest in RECORD form when a hash was asked for."""
        if self._inflater is not None:
            self._take(self._inflater.flush())
        check_content(self._member, self._size, self._crc, where)
        if self._hash is None:
            return None
        return f"{self._hash.name}={urlsafe_digest(self._hash.digest())}"


# ---- RECORD ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordRow:
    path: str
    hash: str
    size: str


def urlsafe_digest(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def record_hash(data: bytes) -> str:
    return f"sha256={urlsafe_digest(hashlib.sha256(data).digest())}"


def parse_record(text: str, where: str) -> list[RecordRow]:
    rows: list[RecordRow] = []
    for number, fields in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not fields:
            continue
        if len(fields) != 3:
            raise WheelError(f"{where}: RECORD line {number} has {len(fields)} fields, not 3")
        rows.append(RecordRow(*fields))
    return rows


def record_line_terminator(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


def format_record(rows: Iterable[RecordRow], line_terminator: str = "\n") -> bytes:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator=line_terminator)
    for row in rows:
        writer.writerow((row.path, row.hash, row.size))
    return buffer.getvalue().encode("utf-8")


def record_hash_name(row: RecordRow, where: str) -> str:
    """The hashlib name a RECORD row uses; refuses the weak or unknown ones."""
    algorithm, _, value = row.hash.partition("=")
    if not value or algorithm not in hashlib.algorithms_guaranteed:
        raise WheelError(f"{where}: RECORD hash of {row.path} is not understood: {row.hash!r}")
    if algorithm in ("md5", "sha1"):
        raise WheelError(f"{where}: RECORD hash of {row.path} uses weak {algorithm}")
    return algorithm
