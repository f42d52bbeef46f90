"""Publishing to a real local index, and installing from it into a fresh environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from forge.errors import PublishError
from forge.index import LocalIndex
from forge.meta import build_meta_wheel
from forge.publish import publish
from forge.repack import RepackSpec, repack_wheel
from tests.forge.conftest import Member, WheelRecipe, build_wheel, sha256_file


def engine_base(out_dir: Path) -> Path:
    recipe = WheelRecipe(
        tags="py3-none-any",
        wheel_tag_line="py3-none-any",
        package={
            "fakeeng/__init__.py": Member(b'BUILD = "stock"\n'),
            "fakeeng/core.py": Member(b"def answer():\n    return 42\n"),
        },
    )
    return build_wheel(recipe, out_dir)


def patched_build(base: Path, label: str, out_dir: Path) -> Path:
    spec = RepackSpec(
        base_wheel=base,
        base_sha256=sha256_file(base),
        replacements={"fakeeng/__init__.py": f'BUILD = "{label}"\n'.encode()},
        build_label=label,
        provenance={"cell": "fakeeng-0.9"},
    )
    return repack_wheel(spec, out_dir)


def core_wheel(out_dir: Path) -> Path:
    recipe = WheelRecipe(
        name="kvcached_core",
        version="0.1.0",
        tags="py3-none-any",
        wheel_tag_line="py3-none-any",
        package={"kvcached_core/__init__.py": Member(b'RUNTIME = "core"\n')},
    )
    return build_wheel(recipe, out_dir)


def meta_wheel(out_dir: Path, engine_version: str) -> Path:
    return build_meta_wheel(
        meta_name="kvcached-fakeeng",
        engine_dist="fakeeng",
        engine_version=engine_version,
        core_requirement="kvcached-core==0.1.0",
        summary="fakeeng with elastic KV cache",
        out_dir=out_dir,
    )


def clean_pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def test_round_trip_installs_the_patched_build(local_index: LocalIndex, tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    base = engine_base(tmp_path / "upstream")
    build_1 = patched_build(base, "kvcached.1", dist)
    build_2 = patched_build(base, "kvcached.2", dist)
    lines: list[str] = []
    # the stock engine and a newer build are on the index too: the meta wheel must pick build 1
    publish(
        [
            base,
            build_1,
            build_2,
            core_wheel(tmp_path / "core"),
            meta_wheel(dist, "0.9.2+kvcached.1"),
        ],
        local_index.url,
        progress=lines.append,
    )
    assert sum(line.startswith("uploaded ") for line in lines) == 5

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--index-url",
            local_index.simple_url,
            "kvcached-fakeeng==0.9.2",
        ],
        env=clean_pip_env(),
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import fakeeng, kvcached_core, importlib.metadata as m; "
            "print(fakeeng.BUILD, m.version('fakeeng'), m.version('kvcached-fakeeng'))",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["kvcached.1", "0.9.2+kvcached.1", "0.9.2+kvcached.1"]


def test_republishing_skips_files_already_there(local_index: LocalIndex, tmp_path: Path) -> None:
    base = engine_base(tmp_path / "upstream")
    build = patched_build(base, "kvcached.1", tmp_path / "dist")
    publish([build], local_index.url)
    fresh = core_wheel(tmp_path / "core")
    lines: list[str] = []
    result = publish([build, fresh], local_index.url, progress=lines.append)
    assert result.skipped == [build.name] and result.uploaded == [fresh.name]
    assert f"skip {build.name}: already on the index with the same sha256" in lines
    assert sorted(p.name for p in local_index.packages_dir.iterdir()) == sorted(
        [build.name, fresh.name])
    assert (local_index.packages_dir / build.name).read_bytes() == build.read_bytes()


def test_a_different_file_under_a_published_name_is_refused_whole(
    local_index: LocalIndex, tmp_path: Path
) -> None:
    base = engine_base(tmp_path / "upstream")
    build = patched_build(base, "kvcached.1", tmp_path / "dist")
    publish([build], local_index.url)
    published = build.read_bytes()
    # Same cell, same build number, different content: the name is the same, the bytes are not.
    changed_spec = RepackSpec(
        base_wheel=base, base_sha256=sha256_file(base),
        replacements={"fakeeng/__init__.py": b'BUILD = "changed"\n'},
        build_label="kvcached.1", provenance={"cell": "fakeeng-0.9"},
    )
    changed = repack_wheel(changed_spec, tmp_path / "changed")
    assert changed.name == build.name and changed.read_bytes() != published
    fresh = core_wheel(tmp_path / "core")
    with pytest.raises(PublishError) as refused:
        publish([fresh, changed], local_index.url)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{build.name} is already on {local_index.url} with a different "
                              f"sha256 ({sha256_file(build)[:12]}… there, "
                              f"{sha256_file(changed)[:12]}… here)")
    # refused before any upload: the new core wheel is not there, the published file unchanged
    assert sorted(p.name for p in local_index.packages_dir.iterdir()) == [build.name]
    assert (local_index.packages_dir / build.name).read_bytes() == published


def test_an_interrupted_publish_completes_when_run_again(local_index: LocalIndex,
                                                         tmp_path: Path) -> None:
    base = engine_base(tmp_path / "upstream")
    files = [patched_build(base, "kvcached.1", tmp_path / "dist"),
             core_wheel(tmp_path / "core"), meta_wheel(tmp_path / "dist", "0.9.2+kvcached.1")]

    def crash_after_first_upload(line: str) -> None:
        if line.startswith("uploaded "):
            local_index.kill()

    with pytest.raises(PublishError) as interrupted:
        publish(files, local_index.url, progress=crash_after_first_upload)
    assert "\n" not in str(interrupted.value)
    assert sorted(p.name for p in local_index.packages_dir.iterdir()) == [files[0].name]
    local_index.start()
    result = publish(files, local_index.url)
    assert result.skipped == [files[0].name]
    assert result.uploaded == [files[1].name, files[2].name]
    assert sorted(p.name for p in local_index.packages_dir.iterdir()) == sorted(
        f.name for f in files)


def test_unreachable_index_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    build = patched_build(engine_base(tmp_path / "upstream"), "kvcached.1", tmp_path / "dist")
    with pytest.raises(PublishError) as refused:
        publish([build], url)
    message = str(refused.value)
    assert "\n" not in message
    assert f"127.0.0.1:{port}" in message and "unreachable" in message
    assert "refused" in message.lower()


def test_only_wheels_can_be_published(tmp_path: Path) -> None:
    sdist = tmp_path / "fakeeng-0.9.2.tar.gz"
    sdist.write_bytes(b"")
    with pytest.raises(PublishError, match="only wheels"):
        publish([sdist], "http://127.0.0.1:9/")
    with pytest.raises(PublishError, match="no such file"):
        publish([tmp_path / "missing-1.0-py3-none-any.whl"], "http://127.0.0.1:9/")


def test_local_index_serves_and_stops(tmp_path: Path) -> None:
    index = LocalIndex(tmp_path / "idx")
    with index:
        url = index.url
        with urllib.request.urlopen(url + "health", timeout=5) as response:
            assert response.status == 200
        assert index.simple_url == url + "simple/"
        # no fallback to PyPI: an unknown project is simply not there
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(index.simple_url + "requests/", timeout=5)
        assert missing.value.code == 404
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "health", timeout=5)
