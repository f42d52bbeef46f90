"""The meta wheel: `kvcached-vllm==0.9.2+kvcached.1`, which holds no files and pins the build.

Installing it pulls exactly the patched engine build it names (local label included) and the
core runtime. It carries only dist-info, so it never owns a file of the engine.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from forge import TOOLKIT_VERSION
from forge.errors import WheelError
from forge.wheelfile import (
    DEFLATED,
    REGULAR_FILE_ATTR,
    ZIP_EPOCH,
    RecordRow,
    ZipWriter,
    format_record,
    record_hash,
)

_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
META_TAG = "py3-none-any"


def build_meta_wheel(
    *,
    meta_name: str,
    engine_dist: str,
    engine_version: str,
    core_requirement: str,
    summary: str,
    out_dir: Path,
    requires_python: str | None = None,
) -> Path:
    """Writes `<meta>-<engine_version>-py3-none-any.whl` to `out_dir` and returns its path.

    Its version is the engine build's version; it requires `engine_dist==engine_version`
    exactly (local label included) and `core_requirement`. `requires_python` (the Pythons the
    cell allows that the core wheels cover) makes pip say "requires a different Python" on
    any other, instead of failing to find a core wheel.
    """
    for label, value in (("meta name", meta_name), ("engine distribution", engine_dist)):
        if not _NAME_RE.fullmatch(value):
            raise WheelError(f"{label} {value!r} is not a valid distribution name")
    try:
        version = str(Version(engine_version))
    except InvalidVersion as exc:
        raise WheelError(f"engine version {engine_version!r} is not PEP 440") from exc
    try:
        core = Requirement(core_requirement)
    except InvalidRequirement as exc:
        raise WheelError(f"core requirement {core_requirement!r} is invalid: {exc}") from exc
    if "\n" in summary or "\r" in summary:
        raise WheelError("meta wheel summary must be a single line")
    if requires_python is not None:
        try:
            requires_python = str(SpecifierSet(requires_python))
        except InvalidSpecifier as exc:
            raise WheelError(f"Requires-Python {requires_python!r} is invalid: {exc}") from exc

    name = canonicalize_name(meta_name)
    engine = canonicalize_name(engine_dist)
    if name == engine:
        raise WheelError(f"meta wheel {name} cannot pin a distribution of the same name")
    escaped = name.replace("-", "_")
    dist_info = f"{escaped}-{version}.dist-info/"
    metadata = "".join(
        [
            "Metadata-Version: 2.1\n",
            f"Name: {name}\n",
            f"Version: {version}\n",
            f"Summary: {summary}\n",
            *([f"Requires-Python: {requires_python}\n"] if requires_python else []),
            f"Requires-Dist: {engine}=={version}\n",
            f"Requires-Dist: {core}\n",
        ]
    ).encode("utf-8")
    wheel = "".join(
        [
            "Wheel-Version: 1.0\n",
            f"Generator: forge {TOOLKIT_VERSION}\n",
            "Root-Is-Purelib: true\n",
            f"Tag: {META_TAG}\n",
        ]
    ).encode("utf-8")

    buffer = io.BytesIO()
    writer = ZipWriter(buffer)
    rows: list[RecordRow] = []
    for leaf, data in (("METADATA", metadata), ("WHEEL", wheel)):
        writer.add(
            dist_info + leaf,
            data,
            method=DEFLATED,
            date_time=ZIP_EPOCH,
            external_attr=REGULAR_FILE_ATTR,
        )
        rows.append(RecordRow(dist_info + leaf, record_hash(data), str(len(data))))
    rows.append(RecordRow(dist_info + "RECORD", "", ""))
    writer.add(
        dist_info + "RECORD",
        format_record(rows),
        method=DEFLATED,
        date_time=ZIP_EPOCH,
        external_attr=REGULAR_FILE_ATTR,
    )
    writer.close()
    return write_atomically(out_dir / f"{escaped}-{version}-{META_TAG}.whl", buffer.getvalue())


def write_atomically(target: Path, data: bytes) -> Path:
    """Writes `target` through a temporary file in its directory: it appears whole or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(prefix=".meta-", suffix=".whl.part", dir=target.parent)
    try:
        with open(fd, "wb") as out:
            out.write(data)
        os.chmod(temp_name, 0o644)
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return target
