"""nox sessions, generated from matrix.toml.

Per cell: build-<engine>-<series>, test-<engine>-<series> (requires the build) and
publish-<engine>-<series> (not run by default). Project sessions: tests, lint.
`nox -l --json` is what a CI matrix reads (see ci/matrix.py).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
FORGE_DEPS = nox.project.dependency_groups(PYPROJECT, "forge")
TEST_DEPS = nox.project.dependency_groups(PYPROJECT, "test")
# The runtime extension is built without isolation, so its build requirements go in first.
NATIVE_BUILD_DEPS = ["setuptools>=70", "pybind11>=2.12", "nvidia-cuda-runtime-cu12"]
PYTHON = "3.11"

nox.options.default_venv_backend = "uv|virtualenv"


def _cells() -> list[dict]:
    with open(ROOT / "matrix.toml", "rb") as f:
        return tomllib.load(f).get("cell", [])


def _install_runtime(session: nox.Session) -> None:
    session.install(*NATIVE_BUILD_DEPS)
    session.install("--no-build-isolation", "-e", ".")


@nox.session(python=PYTHON, tags=["project"])
def tests(session: nox.Session) -> None:
    """The project's tests: runtime, toolkit, transforms and every cell's L0 proof."""
    session.install("torch==2.13.0", *FORGE_DEPS, *TEST_DEPS)
    _install_runtime(session)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python=PYTHON, tags=["project"])
def lint(session: nox.Session) -> None:
    """ruff over the project's own code."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


def _make_cell_sessions(cell: dict) -> None:
    engine, series, status = cell["engine"], cell["series"], cell["status"]
    name = f"{engine}-{series}"
    tags = [engine, status]

    @nox.session(name=f"build-{name}", python=PYTHON, tags=["build", *tags])
    def build(session: nox.Session) -> None:
        session.install(*FORGE_DEPS)
        session.run("python", "-m", "forge", "build", name, *session.posargs)

    build.__doc__ = (f"Build the patched {engine} {cell['version']} wheels and meta wheel "
                     f"into dist/{name}/.")

    @nox.session(name=f"test-{name}", python=PYTHON, tags=["test", *tags],
                 requires=[f"build-{name}"])
    def test(session: nox.Session) -> None:
        session.install("torch==2.13.0", *FORGE_DEPS, *TEST_DEPS)
        _install_runtime(session)
        session.run("python", "-m", "pytest", "tests/cells", f"--cell={name}",
                    f"--dist={ROOT / 'dist' / name}", *session.posargs)

    test.__doc__ = f"Prove cell {name} on the wheels in dist/{name}/."

    @nox.session(name=f"publish-{name}", python=PYTHON, tags=["publish", *tags],
                 requires=[f"build-{name}"], default=False)
    def publish(session: nox.Session) -> None:
        url = session.posargs[0] if session.posargs else os.environ.get("KVCACHED_INDEX_URL")
        if not url:
            session.error("give the index's upload URL: nox -s publish-<cell> -- <url> "
                          "(or set KVCACHED_INDEX_URL)")
        session.install(*FORGE_DEPS)
        session.run("python", "-m", "forge", "publish", name, "--repository-url", url)

    publish.__doc__ = f"Upload dist/{name}/ to an index (not run by default)."


for _cell in _cells():
    _make_cell_sessions(_cell)
