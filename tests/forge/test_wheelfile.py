"""The zip layer: reading central directories, raw copies, new members, RECORD text."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from forge.errors import WheelError
from forge.wheelfile import (
    DEFLATED,
    REGULAR_FILE_ATTR,
    STORED,
    RecordRow,
    ZipWriter,
    date_time_to_dos,
    descriptor_size,
    dos_to_date_time,
    format_record,
    parse_local_header,
    parse_record,
    read_central_directory,
    record_hash,
)


def _archive(data_descriptors: bool = False, zip64: bool = False) -> bytes:
    class Unseekable(io.RawIOBase):
        def __init__(self) -> None:
            self.buffer = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, data: bytes) -> int:  # type: ignore[override]
            self.buffer += data
            return len(data)

    sink: io.BytesIO | Unseekable = Unseekable() if data_descriptors else io.BytesIO()
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_DEFLATED) as archive:  # type: ignore[arg-type]
        archive.writestr("a/one.txt", b"one " * 100, compresslevel=9)
        archive.writestr("a/two.bin", bytes(range(256)) * 4, compress_type=zipfile.ZIP_STORED)
        with archive.open("a/three.txt", "w", force_zip64=zip64) as member:
            member.write(b"three\n" * 50)
        archive.writestr("a/ünï.txt", b"non-ascii name")
    return bytes(sink.buffer) if isinstance(sink, Unseekable) else sink.getvalue()


def _copy_all_raw(source: bytes) -> bytes:
    """Copies every member of `source` verbatim into a new archive with ZipWriter."""
    src = io.BytesIO(source)
    directory = read_central_directory(src, "src.zip")
    out = io.BytesIO()
    writer = ZipWriter(out)
    for member in directory.members:
        src.seek(member.header_offset)
        fixed = src.read(30)
        name_len, extra_len = parse_local_header(fixed, member, "src.zip")
        header = fixed + src.read(name_len + extra_len)
        data = src.read(member.compressed_size)
        head = src.read(4)
        descriptor = head + src.read(descriptor_size(member, head) - 4)
        writer.begin_raw(member, header)
        writer.write(data)
        if member.uses_descriptor:
            writer.write(descriptor)
    writer.close()
    return out.getvalue()


@pytest.mark.parametrize(("descriptors", "zip64"), [(False, False), (True, False), (False, True)])
def test_raw_copy_gives_an_archive_zipfile_reads(descriptors: bool, zip64: bool) -> None:
    source = _archive(descriptors, zip64)
    copied = _copy_all_raw(source)
    with zipfile.ZipFile(io.BytesIO(source)) as a, zipfile.ZipFile(io.BytesIO(copied)) as b:
        assert b.testzip() is None
        assert a.namelist() == b.namelist()
        for name in a.namelist():
            assert a.read(name) == b.read(name)
            assert a.getinfo(name).compress_type == b.getinfo(name).compress_type
    if descriptors:
        assert any(
            m.uses_descriptor for m in read_central_directory(io.BytesIO(source), "s").members
        )


def test_new_members_are_readable_and_carry_the_given_attributes() -> None:
    out = io.BytesIO()
    writer = ZipWriter(out)
    stamp = (2025, 7, 7, 17, 26, 18)
    writer.add(
        "p/deflated.py",
        b"x = 1\n" * 50,
        method=DEFLATED,
        date_time=stamp,
        external_attr=REGULAR_FILE_ATTR,
    )
    writer.add(
        "p/stored.bin", b"\x00\x01", method=STORED, date_time=stamp, external_attr=(0o100755 << 16)
    )
    writer.close()
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None
        deflated, stored = archive.infolist()
        assert archive.read("p/deflated.py") == b"x = 1\n" * 50
        assert deflated.compress_type == zipfile.ZIP_DEFLATED
        assert stored.compress_type == zipfile.ZIP_STORED
        assert deflated.date_time == stamp
        assert stored.external_attr >> 16 == 0o100755


def test_unsupported_method_for_new_members_is_refused() -> None:
    with pytest.raises(WheelError, match="method 12"):
        ZipWriter(io.BytesIO()).add(
            "x", b"", method=12, date_time=(1980, 1, 1, 0, 0, 0), external_attr=0
        )


@pytest.mark.parametrize("cut", [1, 21, 200])
def test_truncated_archive_is_named(cut: int) -> None:
    data = _archive()[:-cut]
    with pytest.raises(WheelError, match=r"^cut\.zip: .*(truncated|central directory)"):
        read_central_directory(io.BytesIO(data), "cut.zip")


def test_not_a_zip_is_refused() -> None:
    with pytest.raises(WheelError, match="no end-of-central-directory"):
        read_central_directory(io.BytesIO(b"this is no zip archive" * 10), "junk.whl")


def test_local_header_that_disagrees_with_the_central_entry_is_refused() -> None:
    data = bytearray(_archive())
    member = read_central_directory(io.BytesIO(bytes(data)), "s").members[0]
    data[member.header_offset + 14] ^= 0xFF  # CRC field of the local header
    fixed = bytes(data[member.header_offset : member.header_offset + 30])
    with pytest.raises(WheelError, match=rf"a/one.txt at offset {member.header_offset}.*CRC"):
        parse_local_header(fixed, member, "s.zip")


def test_dos_timestamps_round_trip() -> None:
    stamp = (2031, 12, 31, 23, 59, 58)
    assert dos_to_date_time(*date_time_to_dos(stamp)) == stamp
    with pytest.raises(WheelError):
        date_time_to_dos((1979, 1, 1, 0, 0, 0))


def test_record_round_trips_paths_with_commas_and_keeps_line_endings() -> None:
    rows = [
        RecordRow("p/a,b.py", record_hash(b"x"), "1"),
        RecordRow("p-1.dist-info/RECORD", "", ""),
    ]
    text = format_record(rows, "\r\n").decode()
    assert text.endswith("RECORD,,\r\n")
    assert parse_record(text, "w") == rows


def test_record_line_with_missing_fields_is_refused() -> None:
    with pytest.raises(WheelError, match="line 2 has 2 fields"):
        parse_record("a,sha256=x,1\nb,sha256=y\n", "w.whl")


def test_record_hash_is_urlsafe_unpadded_sha256(tmp_path: Path) -> None:
    assert record_hash(b"") == "sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"
