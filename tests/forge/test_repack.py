"""Re-packing an engine wheel: labels, tags, RECORD, raw copies, reproducibility, failures."""

from __future__ import annotations

import csv
import io
import os
import struct
import time
import zipfile
import zlib
from pathlib import Path

import pytest

from forge.errors import WheelError
from forge.repack import (
    PROVENANCE_FILE,
    RepackSpec,
    compose_version,
    read_provenance,
    repack_wheel,
    verify_wheel,
)
from tests.forge.conftest import SO_BYTES, TABLE, Member, WheelFactory, record_hash, sha256_file

PATCHED_INIT = b'BUILD = "kvcached"\nfrom fakeeng.core import answer\n'


def spec_for(base: Path, **changes: object) -> RepackSpec:
    values: dict[str, object] = {
        "base_wheel": base,
        "base_sha256": sha256_file(base),
        "replacements": {
            "fakeeng/__init__.py": PATCHED_INIT,
            "fakeeng/_kvcached_build.py": b'LABEL = "kvcached.1"\n',
        },
        "build_label": "kvcached.1",
        "provenance": {"cell": "fakeeng-0.9", "transforms": ["pool-seam"]},
    }
    values.update(changes)
    return RepackSpec(**values)  # type: ignore[arg-type]


def raw_member(wheel: Path, name: str) -> tuple[bytes, int]:
    """A member's compressed bytes exactly as stored, and its method (read with struct)."""
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(name)
    data = wheel.read_bytes()
    fields = struct.unpack_from("<4sHHHHHLLLHH", data, info.header_offset)
    start = info.header_offset + 30 + fields[9] + fields[10]
    return data[start : start + info.compress_size], info.compress_type


def record_rows(wheel: Path) -> dict[str, tuple[str, str]]:
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        text = archive.read(record).decode()
    return {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(text)) if row}


# ---- versions ----


@pytest.mark.parametrize(
    ("base", "label", "expected"),
    [
        ("0.9.2", "kvcached.1", "0.9.2+kvcached.1"),
        ("0.25.1+cu130", "kvcached.1", "0.25.1+cu130.kvcached.1"),
        ("0.25.1+CU130", "kvcached-2", "0.25.1+cu130.kvcached.2"),
        ("1.0.0.post1", "kvcached.3", "1.0.0.post1+kvcached.3"),
        ("v2.0", "kvcached.1", "2.0+kvcached.1"),
    ],
)
def test_version_composition(base: str, label: str, expected: str) -> None:
    assert compose_version(base, label) == expected


@pytest.mark.parametrize(
    ("base", "label", "message"),
    [
        ("0.9.2+kvcached.1", "kvcached.2", "already carries a kvcached label"),
        ("0.25.1+cu130.KVcached.1", "kvcached.2", "already carries a kvcached label"),
        ("0.9.2", "kvcached 1", "not a valid PEP 440 local label"),
        ("0.9.2", "+kvcached.1", "not a valid PEP 440 local label"),
        ("not-a-version", "kvcached.1", "not PEP 440"),
    ],
)
def test_bad_versions_and_labels_are_refused(base: str, label: str, message: str) -> None:
    with pytest.raises(WheelError, match=message):
        compose_version(base, label)


# ---- the re-packed wheel ----


def test_repacked_wheel_keeps_tags_and_gets_the_label(make_wheel: WheelFactory, tmp_path: Path):
    base = make_wheel()
    out = repack_wheel(spec_for(base), tmp_path / "dist")
    assert out.name == "fakeeng-0.9.2+kvcached.1-cp38-abi3-manylinux1_x86_64.whl"
    with zipfile.ZipFile(base) as old, zipfile.ZipFile(out) as new:
        names = new.namelist()
        assert not any(n.startswith("fakeeng-0.9.2.dist-info/") for n in names)
        new_info = "fakeeng-0.9.2+kvcached.1.dist-info/"
        assert new.read(new_info + "WHEEL") == old.read("fakeeng-0.9.2.dist-info/WHEEL")
        assert b"Tag: cp38-abi3-linux_x86_64" in new.read(new_info + "WHEEL")
        metadata = new.read(new_info + "METADATA").decode()
        assert "\nVersion: 0.9.2+kvcached.1\n" in metadata
        # only the header changes: the description's quoted "Version:" line stays
        assert "Version: 1.0 is not this package's version." in metadata
        assert new.read("fakeeng/__init__.py") == PATCHED_INIT
        assert new.read("fakeeng/core.py") == old.read("fakeeng/core.py")
        assert new.read(new_info + "entry_points.txt") == old.read(
            "fakeeng-0.9.2.dist-info/entry_points.txt"
        )


def test_existing_local_label_and_build_tag_are_kept(make_wheel: WheelFactory, tmp_path: Path):
    base = make_wheel(version="0.25.1+cu130", build_tag="1", tags="cp38-abi3-manylinux_2_28_x86_64")
    out = repack_wheel(spec_for(base), tmp_path / "dist")
    assert out.name == "fakeeng-0.25.1+cu130.kvcached.1-1-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(out) as new:
        assert b"Build: 1\n" in new.read("fakeeng-0.25.1+cu130.kvcached.1.dist-info/WHEEL")
    assert verify_wheel(out) > 0


def test_record_lists_every_file_with_matching_hashes(make_wheel: WheelFactory, tmp_path: Path):
    out = repack_wheel(spec_for(make_wheel()), tmp_path / "dist")
    rows = record_rows(out)
    with zipfile.ZipFile(out) as archive:
        files = [n for n in archive.namelist() if not n.endswith("/")]
        assert archive.testzip() is None
        for name in files:
            if name.endswith("/RECORD"):
                assert rows[name] == ("", "")
                continue
            data = archive.read(name)
            assert rows[name] == (record_hash(data), str(len(data))), name
    assert set(rows) == set(files)
    assert verify_wheel(out) == len(files) - 1


def test_provenance_is_added_and_listed(make_wheel: WheelFactory, tmp_path: Path) -> None:
    base = make_wheel()
    out = repack_wheel(spec_for(base), tmp_path / "dist")
    document = read_provenance(out)
    assert document["cell"] == "fakeeng-0.9"
    assert document["transforms"] == ["pool-seam"]
    assert document["repack"]["base_sha256"] == sha256_file(base)
    assert document["repack"]["version"] == "0.9.2+kvcached.1"
    assert document["repack"]["rewritten"] == ["fakeeng/__init__.py"]
    assert document["repack"]["added"] == ["fakeeng/_kvcached_build.py"]
    assert f"fakeeng-0.9.2+kvcached.1.dist-info/{PROVENANCE_FILE}" in record_rows(out)


def test_new_files_go_just_before_the_dist_info(make_wheel: WheelFactory, tmp_path: Path) -> None:
    out = repack_wheel(spec_for(make_wheel()), tmp_path / "dist")
    with zipfile.ZipFile(out) as archive:
        names = archive.namelist()
    first_dist_info = next(i for i, n in enumerate(names) if ".dist-info/" in n)
    assert names[first_dist_info - 1] == "fakeeng/_kvcached_build.py"
    assert names[-1].endswith(".dist-info/RECORD")
    assert all(".dist-info/" in n for n in names[first_dist_info:])


def test_unchanged_members_are_copied_raw(make_wheel: WheelFactory, tmp_path: Path) -> None:
    base = make_wheel()
    out = repack_wheel(spec_for(base), tmp_path / "dist")
    for name in ("fakeeng/_C.abi3.so", "fakeeng/data/table.txt", "fakeeng/stored.bin"):
        assert raw_member(out, name) == raw_member(base, name), name
    # the check can fail: zlib's default level would have produced other bytes
    for name, content in (("fakeeng/data/table.txt", TABLE), ("fakeeng/_C.abi3.so", SO_BYTES)):
        level_6 = zlib.compressobj(6, zlib.DEFLATED, -15)
        assert level_6.compress(content) + level_6.flush() != raw_member(base, name)[0]


def test_rewritten_members_keep_compression_and_attributes(
    make_wheel: WheelFactory, tmp_path: Path
) -> None:
    base = make_wheel()
    spec = spec_for(
        base,
        replacements={
            "fakeeng/stored.bin": b"new stored bytes",
            "fakeeng/bin/tool.sh": b"#!/bin/sh\n",
        },
    )
    out = repack_wheel(spec, tmp_path / "dist")
    with zipfile.ZipFile(out) as archive:
        assert archive.getinfo("fakeeng/stored.bin").compress_type == zipfile.ZIP_STORED
        assert archive.read("fakeeng/stored.bin") == b"new stored bytes"
        tool = archive.getinfo("fakeeng/bin/tool.sh")
        assert tool.compress_type == zipfile.ZIP_DEFLATED
        assert tool.external_attr >> 16 == 0o100755


def test_a_replaced_dist_info_file_stays_in_the_dist_info(make_wheel: WheelFactory, tmp_path):
    entry_points = b"[console_scripts]\nfakeeng = fakeeng.core:main\n"
    spec = spec_for(
        make_wheel(), replacements={"fakeeng-0.9.2.dist-info/entry_points.txt": entry_points}
    )
    out = repack_wheel(spec, tmp_path / "dist")
    with zipfile.ZipFile(out) as archive:
        names = archive.namelist()
        assert archive.read("fakeeng-0.9.2+kvcached.1.dist-info/entry_points.txt") == entry_points
    first_dist_info = next(i for i, n in enumerate(names) if ".dist-info/" in n)
    assert all(".dist-info/" in n for n in names[first_dist_info:])
    assert verify_wheel(out) == len(names) - 1


def test_rebuild_is_byte_identical_whatever_the_clock_umask_or_zone(
    make_wheel: WheelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel()
    first = repack_wheel(spec_for(base), tmp_path / "one")
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 10 * 365 * 86400)
    monkeypatch.setenv("TZ", "Pacific/Kiritimati")
    monkeypatch.setenv("LC_ALL", "C")
    time.tzset()
    old_umask = os.umask(0o077)
    try:
        second = repack_wheel(spec_for(base), tmp_path / "two")
    finally:
        os.umask(old_umask)
        monkeypatch.undo()
        time.tzset()
    assert first.name == second.name
    assert first.read_bytes() == second.read_bytes()
    assert (second.stat().st_mode & 0o777) == 0o644


def test_written_members_carry_the_base_record_timestamp(make_wheel: WheelFactory, tmp_path: Path):
    base = make_wheel()
    with zipfile.ZipFile(base) as archive:
        stamp = archive.getinfo("fakeeng-0.9.2.dist-info/RECORD").date_time
    out = repack_wheel(spec_for(base), tmp_path / "dist")
    with zipfile.ZipFile(out) as archive:
        for name in ("fakeeng/__init__.py", "fakeeng/_kvcached_build.py"):
            assert archive.getinfo(name).date_time == stamp


def test_data_descriptors_crlf_record_and_data_dir(make_wheel: WheelFactory, tmp_path: Path):
    base = make_wheel(
        data_descriptors=True,
        record_terminator="\r\n",
        package={
            "fakeeng/__init__.py": Member(b'BUILD = "stock"\n'),
            "fakeeng-0.9.2.data/scripts/fakeeng-run": Member(b"#!python\n"),
        },
    )
    out = repack_wheel(spec_for(base), tmp_path / "dist", verify=True)
    with zipfile.ZipFile(out) as archive:
        names = archive.namelist()
        record = archive.read("fakeeng-0.9.2+kvcached.1.dist-info/RECORD")
    assert "fakeeng-0.9.2+kvcached.1.data/scripts/fakeeng-run" in names
    assert not any(n.startswith("fakeeng-0.9.2.") for n in names)
    assert record.count(b"\r\n") == record.count(b"\n")
    assert verify_wheel(out) == len(names) - 1


def test_progress_lines_and_summary(make_wheel: WheelFactory, tmp_path: Path) -> None:
    lines: list[str] = []
    repack_wheel(spec_for(make_wheel()), tmp_path / "dist", progress=lines.append)
    assert any("members" in line for line in lines[:-1])
    assert "copied raw" in lines[-1] and "1 added" in lines[-1] and " s" in lines[-1]
    assert len(lines) <= 4


# ---- refusals ----


def assert_nothing_written(out_dir: Path) -> None:
    assert not out_dir.exists() or list(out_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("replacements", "message"),
    [
        ({"fakeeng-0.9.2.dist-info/METADATA": b""}, "written by the re-pack"),
        ({"fakeeng-0.9.2.dist-info/RECORD": b""}, "written by the re-pack"),
        ({"/etc/passwd": b""}, "not a relative archive path"),
        ({"fakeeng/../x.py": b""}, "not a relative archive path"),
        ({"fakeeng/data": b""}, "not a file path"),
    ],
)
def test_bad_replacements_are_refused(
    make_wheel: WheelFactory, tmp_path: Path, replacements: dict[str, bytes], message: str
) -> None:
    base = make_wheel(
        package={
            "fakeeng/__init__.py": Member(b""),
            "fakeeng/data/": Member(b"", method=zipfile.ZIP_STORED),
        }
    )
    with pytest.raises(WheelError, match=message):
        repack_wheel(spec_for(base, replacements=replacements), tmp_path / "dist")
    assert_nothing_written(tmp_path / "dist")


def test_base_that_changed_after_verification_is_refused(make_wheel: WheelFactory, tmp_path: Path):
    base = make_wheel()
    spec = spec_for(base)
    data = bytearray(base.read_bytes())
    with zipfile.ZipFile(base) as archive:
        offset = archive.getinfo("fakeeng/_C.abi3.so").header_offset + 200
    data[offset] ^= 0x01  # one flipped bit inside the compressed bytes of a raw-copied member
    base.write_bytes(bytes(data))
    with pytest.raises(
        WheelError, match=r"^fakeeng-0\.9\.2-.*\.whl: sha256 is [0-9a-f]+, expected"
    ):
        repack_wheel(spec, tmp_path / "dist")
    assert_nothing_written(tmp_path / "dist")


def test_verify_finds_a_corrupt_member_the_pinned_digest_cannot(
    make_wheel: WheelFactory, tmp_path: Path
) -> None:
    base = make_wheel()
    data = bytearray(base.read_bytes())
    with zipfile.ZipFile(base) as archive:
        info = archive.getinfo("fakeeng/stored.bin")
    data[info.header_offset + 30 + len(info.filename) + 5] ^= 0xFF
    base.write_bytes(bytes(data))  # pinned digest of the broken file: only verify can tell
    with pytest.raises(WheelError, match=rf"fakeeng/stored.bin at offset {info.header_offset}"):
        repack_wheel(spec_for(base), tmp_path / "dist", verify=True)
    assert_nothing_written(tmp_path / "dist")


def test_local_header_crc_mismatch_is_refused(make_wheel: WheelFactory, tmp_path: Path) -> None:
    base = make_wheel()
    data = bytearray(base.read_bytes())
    with zipfile.ZipFile(base) as archive:
        offset = archive.getinfo("fakeeng/core.py").header_offset
    data[offset + 14] ^= 0xFF
    base.write_bytes(bytes(data))
    with pytest.raises(WheelError, match=rf"member fakeeng/core.py at offset {offset}: CRC"):
        repack_wheel(spec_for(base), tmp_path / "dist")
    assert_nothing_written(tmp_path / "dist")


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_wheel_is_refused(make_wheel: WheelFactory, tmp_path: Path, keep: float):
    base = make_wheel()
    data = base.read_bytes()
    base.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(WheelError, match=r"^fakeeng-0\.9\.2-.*\.whl: .*truncated"):
        repack_wheel(spec_for(base), tmp_path / "dist")
    assert_nothing_written(tmp_path / "dist")


def test_bytes_cut_from_the_middle_are_found(make_wheel: WheelFactory, tmp_path: Path) -> None:
    base = make_wheel()
    data = base.read_bytes()
    base.write_bytes(data[:1000] + data[1100:])
    with pytest.raises(WheelError, match=r"central directory at offset \d+"):
        repack_wheel(spec_for(base), tmp_path / "dist")


def test_not_a_zip_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "fakeeng-0.9.2-py3-none-any.whl"
    base.write_bytes(b"<html>404 not found</html>\n" * 20)
    with pytest.raises(WheelError, match="not a zip archive"):
        repack_wheel(spec_for(base), tmp_path / "dist")
    assert_nothing_written(tmp_path / "dist")


@pytest.mark.parametrize("leaf", ["METADATA", "WHEEL", "RECORD"])
def test_missing_dist_info_file_is_refused(make_wheel: WheelFactory, tmp_path: Path, leaf: str):
    base = make_wheel(omit=(leaf,))
    with pytest.raises(WheelError, match=f"fakeeng-0.9.2.dist-info/{leaf} is missing"):
        repack_wheel(spec_for(base), tmp_path / "dist")


def test_missing_dist_info_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "fakeeng-0.9.2-py3-none-any.whl"
    with zipfile.ZipFile(base, "w") as archive:
        archive.writestr("fakeeng/__init__.py", "")
    with pytest.raises(WheelError, match="expected one .dist-info directory, found none"):
        repack_wheel(spec_for(base), tmp_path / "dist")


def test_record_hash_mismatch_of_a_dist_info_file_is_refused(
    make_wheel: WheelFactory, tmp_path: Path
) -> None:
    path = "fakeeng-0.9.2.dist-info/entry_points.txt"
    base = make_wheel(record_overrides={path: (record_hash(b"other"), "48")})
    with pytest.raises(WheelError, match=f"{path} does not match its RECORD"):
        repack_wheel(spec_for(base), tmp_path / "dist")


def test_record_hash_mismatch_of_a_raw_member_is_found_by_verify(
    make_wheel: WheelFactory, tmp_path: Path
) -> None:
    base = make_wheel(record_overrides={"fakeeng/core.py": (record_hash(b"other"), "28")})
    with pytest.raises(WheelError, match="fakeeng/core.py does not match its RECORD hash"):
        repack_wheel(spec_for(base), tmp_path / "dist", verify=True)


def test_record_size_mismatch_is_refused_without_inflating(make_wheel: WheelFactory, tmp_path):
    data = b"def answer():\n    return 42\n"
    base = make_wheel(record_overrides={"fakeeng/core.py": (record_hash(data), "999")})
    with pytest.raises(WheelError, match="RECORD gives fakeeng/core.py size 999"):
        repack_wheel(spec_for(base), tmp_path / "dist")


def test_file_missing_from_record_is_refused(make_wheel: WheelFactory, tmp_path: Path) -> None:
    base = make_wheel(record_omits=("entry_points.txt",))
    with pytest.raises(WheelError, match="RECORD does not list .*entry_points.txt"):
        repack_wheel(spec_for(base), tmp_path / "dist")


def test_bad_sha256_argument_is_refused(make_wheel: WheelFactory, tmp_path: Path) -> None:
    with pytest.raises(WheelError, match="not a sha256 hex digest"):
        repack_wheel(spec_for(make_wheel(), base_sha256="abc"), tmp_path / "dist")


def test_failure_while_writing_leaves_nothing(make_wheel: WheelFactory, tmp_path: Path) -> None:
    def interrupt(line: str) -> None:
        raise KeyboardInterrupt

    out_dir = tmp_path / "dist"
    out_dir.mkdir()
    (out_dir / "other.whl").write_bytes(b"kept")
    with pytest.raises(KeyboardInterrupt):
        repack_wheel(spec_for(make_wheel()), out_dir, progress=interrupt)
    assert [p.name for p in out_dir.iterdir()] == ["other.whl"]


def test_provenance_must_be_json(make_wheel: WheelFactory, tmp_path: Path) -> None:
    with pytest.raises(WheelError, match="provenance cannot be written as JSON"):
        repack_wheel(spec_for(make_wheel(), provenance={"x": object()}), tmp_path / "dist")
    assert_nothing_written(tmp_path / "dist")


def test_verify_wheel_catches_a_broken_record(make_wheel: WheelFactory, tmp_path: Path) -> None:
    base = make_wheel(record_overrides={"fakeeng/core.py": (record_hash(b"x"), "28")})
    with pytest.raises(WheelError, match="fakeeng/core.py does not match its RECORD hash"):
        verify_wheel(base)
