"""Fixtures for the wheel tests: small synthetic engine wheels built here with the standard
library's zipfile (independent of forge's own zip code), and a running local index."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from forge.index import LocalIndex


def pseudo_random(size: int, seed: bytes = b"seed") -> bytes:
    """Incompressible, deterministic bytes (a stand-in for a compiled extension)."""
    out = bytearray()
    block = seed
    while len(out) < size:
        block = hashlib.sha256(block).digest()
        out += block
    return bytes(out[:size])


def record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Member:
    data: bytes
    method: int = zipfile.ZIP_DEFLATED
    level: int | None = None
    mode: int = 0o644


@dataclass
class WheelRecipe:
    """What goes into a synthetic engine wheel; tests adjust it before building."""

    name: str = "fakeeng"
    version: str = "0.9.2"
    tags: str = "cp38-abi3-manylinux1_x86_64"
    build_tag: str | None = None
    wheel_tag_line: str = "cp38-abi3-linux_x86_64"  # upstream WHEEL and file name disagree
    package: Mapping[str, Member] = field(default_factory=dict)
    extra_dist_info: Mapping[str, bytes] = field(default_factory=dict)
    omit: tuple[str, ...] = ()  # dist-info leaves to leave out ("WHEEL", ...)
    record_overrides: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    record_omits: tuple[str, ...] = ()
    record_terminator: str = "\n"
    data_descriptors: bool = False

    @property
    def dist_info(self) -> str:
        return f"{self.name}-{self.version}.dist-info"

    @property
    def filename(self) -> str:
        build = f"-{self.build_tag}" if self.build_tag else ""
        return f"{self.name}-{self.version}{build}-{self.tags}.whl"


SO_BYTES = pseudo_random(6000) + b"\0" * 3000
TABLE = "".join(
    f"row {i} of the table: {i * i % 977} {i * 7 % 131}\n" for i in range(2000)
).encode()


def default_package(name: str = "fakeeng") -> dict[str, Member]:
    return {
        f"{name}/__init__.py": Member(
            f'BUILD = "stock"\nfrom {name}.core import answer\n'.encode(), level=6
        ),
        f"{name}/core.py": Member(b"def answer():\n    return 42\n", level=6),
        # an unusual compression level: a re-pack that recompresses would change these bytes
        f"{name}/_C.abi3.so": Member(SO_BYTES, level=1),
        f"{name}/data/table.txt": Member(TABLE, level=9),
        f"{name}/stored.bin": Member(pseudo_random(700, b"stored"), method=zipfile.ZIP_STORED),
        f"{name}/bin/tool.sh": Member(b"#!/bin/sh\necho tool\n", level=6, mode=0o755),
    }


def metadata_text(recipe: WheelRecipe) -> bytes:
    return (
        "Metadata-Version: 2.4\n"
        f"Name: {recipe.name}\n"
        f"Version: {recipe.version}\n"
        "Summary: a small engine for tests\n"
        "\n"
        "The description may quote a header:\n"
        "Version: 1.0 is not this package's version.\n"
    ).encode()


class _Unseekable(io.RawIOBase):
    """Forces zipfile to write data descriptors after each member."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.buffer += data
        return len(data)


def build_wheel(recipe: WheelRecipe, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    package = dict(recipe.package) or default_package(recipe.name)
    wheel_text = "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: false\n"
    if recipe.build_tag:
        wheel_text += f"Build: {recipe.build_tag}\n"
    wheel_text += f"Tag: {recipe.wheel_tag_line}\n"
    dist_files: dict[str, bytes] = {
        "METADATA": metadata_text(recipe),
        "WHEEL": wheel_text.encode(),
        "entry_points.txt": b"[console_scripts]\nfakeeng = fakeeng.core:answer\n",
        **recipe.extra_dist_info,
    }
    members: list[tuple[str, Member]] = list(package.items())
    members += [
        (f"{recipe.dist_info}/{leaf}", Member(data))
        for leaf, data in dist_files.items()
        if leaf not in recipe.omit
    ]
    rows = []
    for path, member in members:
        if path.endswith("/") or path.removeprefix(f"{recipe.dist_info}/") in recipe.record_omits:
            continue
        digest, size = recipe.record_overrides.get(
            path, (record_hash(member.data), str(len(member.data)))
        )
        rows.append((path, digest, size))
    rows.append((f"{recipe.dist_info}/RECORD", "", ""))
    record = io.StringIO()
    csv.writer(record, lineterminator=recipe.record_terminator).writerows(rows)
    if "RECORD" not in recipe.omit:
        members.append((f"{recipe.dist_info}/RECORD", Member(record.getvalue().encode())))

    sink: io.BytesIO | _Unseekable = _Unseekable() if recipe.data_descriptors else io.BytesIO()
    with zipfile.ZipFile(sink, "w") as archive:
        for index, (path, member) in enumerate(members):
            info = zipfile.ZipInfo(path, date_time=(2025, 7, 7, 17, 26, 18 + index % 2 * 2))
            info.compress_type = member.method
            info.external_attr = (0o100000 | member.mode) << 16
            info.create_system = 3
            archive.writestr(info, member.data, compresslevel=member.level)
    data = bytes(sink.buffer) if isinstance(sink, _Unseekable) else sink.getvalue()
    wheel = out_dir / recipe.filename
    wheel.write_bytes(data)
    return wheel


WheelFactory = Callable[..., Path]


@pytest.fixture
def make_wheel(tmp_path: Path) -> WheelFactory:
    """Builds a synthetic engine wheel in `tmp_path/base`; keyword arguments adjust the recipe."""

    def factory(**changes: object) -> Path:
        return build_wheel(WheelRecipe(**changes), tmp_path / "base")  # type: ignore[arg-type]

    return factory


@pytest.fixture
def local_index(tmp_path: Path) -> Iterator[LocalIndex]:
    with LocalIndex(tmp_path / "index") as index:
        yield index
