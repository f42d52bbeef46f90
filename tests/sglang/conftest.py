"""SGLang L1/L2 environments, built once per selected cell (`--cell`, default every SGLang
cell).

`patched_venv` holds the sglang wheel this checkout builds for the cell plus the kvcached-core
wheel built from this checkout; `stock_venv` holds the cell's pinned upstream wheel. Both are
layered on the cell's cached base venv (tests/sglang/_venv.py). Set KVCACHED_CORE_WHEEL to
use an already built kvcached-core wheel instead of building one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from forge.build import BuildResult, build_cell
from forge.fetch import default_cache_dir, fetch_artifact, resolve_index_url
from forge.matrix import Cell, load_matrix
from tests.proof_cells import ROOT, parametrize_cells, proof_matrix_path, proof_registry

from . import _venv

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "shims"
INSIDE = HERE / "inside"
ADAPTER_MEMBER = "kvcached_core/integration/sglang/allocators.py"

collect_ignore = ["inside", "shims"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_cells(metafunc, "sglang")


@pytest.fixture(scope="session")
def sglang_cell(cell: Cell, tmp_path_factory: pytest.TempPathFactory) -> BuildResult:
    return build_cell(cell.name, matrix_path=proof_matrix_path(),
                      dist_dir=tmp_path_factory.mktemp(f"dist-{cell.name}"),
                      cache_dir=default_cache_dir(), registry=proof_registry(),
                      progress=lambda _line: None)


@pytest.fixture(scope="session")
def stock_wheel(cell: Cell) -> Path:
    matrix = load_matrix(proof_matrix_path())
    (artifact,) = cell.wheel_artifacts
    return fetch_artifact(artifact, index_url=resolve_index_url(matrix, None),
                          cache_dir=default_cache_dir())


@pytest.fixture(scope="session")
def core_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("KVCACHED_CORE_WHEEL")
    if given:
        wheel = Path(given)
    else:
        out = tmp_path_factory.mktemp("core-wheel")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                        "--no-build-isolation", "--wheel-dir", str(out), str(ROOT)], check=True)
        (wheel,) = out.glob("kvcached_core-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        if ADAPTER_MEMBER not in archive.namelist():
            pytest.fail(f"{wheel.name} lacks {ADAPTER_MEMBER}: pyproject.toml must package "
                        "kvcached_core.integration.sglang")
    return wheel


@pytest.fixture(scope="session")
def base_venv(cell: Cell) -> Path:
    return _venv.base_venv(cell)


@pytest.fixture(scope="session")
def patched_venv(tmp_path_factory: pytest.TempPathFactory, base_venv: Path,
                 sglang_cell: BuildResult, core_wheel: Path) -> _venv.EngineVenv:
    engine = next(w for w in sglang_cell.wheels if w.name.startswith("sglang-"))
    return _venv.engine_venv(tmp_path_factory.mktemp("venv") / "patched", base_venv,
                             [engine, core_wheel])


@pytest.fixture(scope="session")
def stock_venv(tmp_path_factory: pytest.TempPathFactory, base_venv: Path, stock_wheel: Path,
               core_wheel: Path) -> _venv.EngineVenv:
    # kvcached-core is there only so the engine script can look for (absent) pool records.
    return _venv.engine_venv(tmp_path_factory.mktemp("venv") / "stock", base_venv,
                             [stock_wheel, core_wheel])


def engine_env(tmp: Path, *, elastic: bool) -> dict[str, str]:
    """Environment of a test process in an SGLang venv (shims on the path, small pages)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "PYTHON"))}
    env.update(
        PYTHONPATH=str(SHIMS),
        KVCACHED_ENABLE="1" if elastic else "0",
        KVCACHED_PAGE_SIZE="4K",
        KVCACHED_MIN_RESERVED_PAGES="0",
        KVCACHED_MAX_RESERVED_PAGES="0",
        KVCACHED_MAX_CACHED_TOKENS="64",
        KVCACHED_SHM_DIR=str(tmp / "shm"),
        KVCACHED_SHIM_CALL_LOG=str(tmp / "shim-calls.log"),
        SGLANG_USE_CPU_ENGINE="1",
        OMP_NUM_THREADS="1",
    )
    (tmp / "shm").mkdir(exist_ok=True)
    return env
