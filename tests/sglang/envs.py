"""The SGLang engine venvs the proofs and the soak run, built once per test run and cell.

`patched_venv_for(cell)` holds the sglang wheel this checkout builds for the cell plus the
kvcached-core wheel built from this checkout (`core_wheel_for`; KVCACHED_CORE_WHEEL names an
already built one instead), layered on the cell's cached base venv (`_venv.py`). tests/sglang's
proofs and tests/e2e/test_soak.py (the newest SGLang cell beside vLLM engines) share them:
whichever test asks first builds. Import this module as `tests.sglang.envs` only: pytest
imports tests/sglang/conftest.py under another name, and a second copy of this module would
build everything again.

`engine_env` is the environment of a process in such a venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from forge.build import build_cell
from forge.fetch import default_cache_dir
from forge.matrix import Cell
from tests.proof_cells import ROOT, proof_matrix_path, proof_registry
from tests.sglang import _venv

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "shims"
INSIDE = HERE / "inside"
ADAPTER_MEMBER = "kvcached_core/integration/sglang/allocators.py"

_core_wheel: list[Path] = []
_patched: dict[str, _venv.EngineVenv] = {}


def core_wheel_for(factory: pytest.TempPathFactory) -> Path:
    """The kvcached-core wheel built from this checkout (or the one KVCACHED_CORE_WHEEL names)."""
    if _core_wheel:
        return _core_wheel[0]
    given = os.environ.get("KVCACHED_CORE_WHEEL")
    if given:
        wheel = Path(given)
    else:
        out = factory.mktemp("core-wheel")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                        "--no-build-isolation", "--wheel-dir", str(out), str(ROOT)], check=True)
        (wheel,) = out.glob("kvcached_core-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        if ADAPTER_MEMBER not in archive.namelist():
            pytest.fail(f"{wheel.name} lacks {ADAPTER_MEMBER}: pyproject.toml must package "
                        "kvcached_core.integration.sglang")
    _core_wheel.append(wheel)
    return wheel


def patched_venv_for(cell: Cell, factory: pytest.TempPathFactory) -> _venv.EngineVenv:
    """The cell's sglang wheel as this checkout builds it, with kvcached-core."""
    if cell.name not in _patched:
        built = build_cell(cell.name, matrix_path=proof_matrix_path(),
                           dist_dir=factory.mktemp(f"dist-{cell.name}"),
                           cache_dir=default_cache_dir(), registry=proof_registry(),
                           progress=lambda _line: None)
        engine = next(w for w in built.wheels if w.name.startswith("sglang-"))
        _patched[cell.name] = _venv.engine_venv(
            factory.mktemp("venv") / "patched", _venv.base_venv(cell),
            [engine, core_wheel_for(factory)])
    return _patched[cell.name]


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
