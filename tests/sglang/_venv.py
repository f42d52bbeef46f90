"""The SGLang test environments: one heavy base venv per set of pins, two thin engine venvs.

The base venv (the cell's proof torch, numpy and the small pure-Python dependencies SGLang
imports, with the cell's test pins) is built once under the cache and reused while its pins
stay the same. The engine venvs are layered on it: each has its own site-packages with one
sglang wheel (patched or stock, installed ``--no-deps``) plus kvcached-core, and a ``.pth``
file that appends the base venv's site-packages, so the heavy part exists once on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet

from forge.matrix import Cell
from tests.proof_cells import proof_of

# What sglang imports on the CPU path, after torch. A package the cell's `test_pins` names is
# pinned to that version (matrix.toml); the order is part of the venv's cache key.
BASE_PACKAGES: tuple[str, ...] = (
    "numpy",
    "orjson",
    "psutil",
    "pyzmq",
    "requests",
    "msgspec",
    "packaging",
    "pillow",
    "pybase64",
    "pydantic",
    "aiohttp",
    "IPython",
    "tqdm",
    "dill",
    "transformers",
    "tokenizers",
    "triton",
    "apache-tvm-ffi",
    "sentencepiece",
    "compressed-tensors",
    "gguf",
    "einops",
    "openai",
    "partial-json-parser",
    "uvicorn",
    "fastapi",
    "uvloop",
    "setproctitle",
    "xgrammar",
    "pytest",
    "prometheus_client",
    # What SGLang's HTTP server (`sglang.launch_server`, behind tests/e2e/test_router.py)
    # imports beyond the engine: its OpenAI routes' schema checks, audio and form parsing.
    "jsonschema",
    "soundfile",
    "python-multipart",
)
# Packages only some releases import on the CPU path: installed only for a cell whose
# `test_pins` names them (0.5.5 and earlier import torchao whenever the model runner starts).
OPTIONAL_PACKAGES: tuple[str, ...] = ("torchao",)
# Packages that would drag in another torch build; the tests shim their import instead.
FORBIDDEN = ("torchvision", "torchaudio", "torchcodec")


@dataclass(frozen=True)
class EngineVenv:
    """A venv holding one sglang build (layered on the base venv)."""

    root: Path
    python: Path
    site_packages: Path


def torch_pin(cell: Cell) -> str:
    return f"torch=={proof_of(cell).torch}"


def base_requirements(cell: Cell) -> tuple[str, ...]:
    """The base venv's requirements: the proof torch first, then BASE_PACKAGES with pins, then
    the OPTIONAL_PACKAGES the cell pins."""
    unknown = sorted(set(cell.test_pins) - set(BASE_PACKAGES) - set(OPTIONAL_PACKAGES))
    if unknown:
        raise ValueError(f"{cell.name}: test_pins {unknown} name no package of the SGLang base "
                         "venv (tests/sglang/_venv.py BASE_PACKAGES, OPTIONAL_PACKAGES)")
    pinned = tuple(f"{name}=={cell.test_pins[name]}" if name in cell.test_pins else name
                   for name in BASE_PACKAGES)
    optional = tuple(f"{name}=={cell.test_pins[name]}" for name in OPTIONAL_PACKAGES
                     if name in cell.test_pins)
    return (torch_pin(cell), *pinned, *optional)


def cache_root() -> Path:
    base = os.environ.get("KVCACHED_FORGE_CACHE") or str(Path.home() / ".cache" / "kvcached-forge")
    return Path(base) / "test-venvs"


def pins_key(requirements: Sequence[str]) -> str:
    text = json.dumps({"python": sys.version_info[:2], "requirements": list(requirements)})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _python_of(root: Path) -> Path:
    return root / "bin" / "python"


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    )
    return Path(out.stdout.strip())


def _pip(python: Path, torch: str, *args: str) -> None:
    env = dict(os.environ, PIP_CONSTRAINT="", PIP_DISABLE_PIP_VERSION_CHECK="1")
    with_constraint = ["--constraint", str(_constraints_file(python.parent.parent, torch))]
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *with_constraint, *args],
                   check=True, env=env)


def _constraints_file(root: Path, torch: str) -> Path:
    path = root / "kvcached-constraints.txt"
    if not path.exists():
        # Anything that pulls torch must not replace the pinned CPU build.
        path.write_text(f"{torch}\n", encoding="utf-8")
    return path


def base_venv(cell: Cell) -> Path:
    """The base venv for the cell's pins: built once (atomically), then reused."""
    python_version = ".".join(map(str, sys.version_info[:3]))
    if python_version not in SpecifierSet(cell.python):
        raise RuntimeError(f"{cell.name}: the release needs Python {cell.python}; the base "
                           f"venv would be built with {python_version}")
    requirements = base_requirements(cell)
    root = cache_root() / f"sglang-base-{pins_key(requirements)}"
    if (root / "READY").exists():
        return root
    staging = root.with_name(root.name + f".building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(staging)
    python = _python_of(staging)
    torch = torch_pin(cell)
    _pip(python, torch, torch)
    _pip(python, torch, *requirements)
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *FORBIDDEN],
                   check=False, capture_output=True)
    (staging / "READY").write_text(json.dumps(list(requirements)), encoding="utf-8")
    if root.exists():
        shutil.rmtree(root)
    # Paths inside a venv are absolute: the venv is built where it will live, under a
    # staging name, and the scripts' shebangs are not used (we run `python -m`).
    staging.rename(root)
    _fix_venv_paths(staging, root)
    return root


def _fix_venv_paths(old: Path, new: Path) -> None:
    config = new / "pyvenv.cfg"
    text = config.read_text(encoding="utf-8").replace(str(old), str(new))
    config.write_text(text, encoding="utf-8")


def engine_venv(root: Path, base: Path, wheels: Sequence[Path]) -> EngineVenv:
    """A fresh venv at ``root`` whose own site-packages hold ``wheels`` (no dependencies)."""
    shutil.rmtree(root, ignore_errors=True)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = _python_of(root)
    site = _site_packages(python)
    base_site = _site_packages(_python_of(base))
    (site / "zz_sglang_base_venv.pth").write_text(f"{base_site}\n", encoding="utf-8")
    subprocess.run(
        [str(_python_of(base)), "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--target", str(site), *map(str, wheels)],
        check=True, env=dict(os.environ, PIP_CONSTRAINT=""),
    )
    return EngineVenv(root, python, site)


if __name__ == "__main__":
    from forge.matrix import load_matrix
    from tests.proof_cells import proof_matrix_path

    print(base_venv(load_matrix(proof_matrix_path()).get_cell(sys.argv[1])))
