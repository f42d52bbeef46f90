"""Declares the native extension kvcached_core._C (project metadata lives in pyproject.toml).

The extension links neither libtorch nor libcuda: it needs only the cuda.h header at build time
(types and constants) and loads libcuda.so.1 at run time. The header is taken from $CUDA_HOME,
/usr/local/cuda or the nvidia-cuda-runtime wheel, in that order.
"""

from __future__ import annotations

import os
from pathlib import Path

import setuptools

# pyproject's `license = "Apache-2.0"` (an SPDX expression) needs setuptools >= 70; older ones fail
# deep inside metadata validation. Build isolation would install it from [build-system].requires,
# `pip install --no-build-isolation` does not: say so in one line.
_NEEDED_SETUPTOOLS = (70, 0)
if tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit()) < _NEEDED_SETUPTOOLS:
    raise SystemExit(
        f"kvcached_core: building needs setuptools>=70 (this environment has "
        f"{setuptools.__version__}): pip install 'setuptools>=70' 'pybind11>=2.12' "
        "nvidia-cuda-runtime-cu12"
    )

try:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
except ImportError:
    raise SystemExit(
        "kvcached_core: building needs pybind11>=2.12: pip install 'setuptools>=70' "
        "'pybind11>=2.12' nvidia-cuda-runtime-cu12"
    ) from None

ROOT = Path(__file__).resolve().parent
SOURCES = [
    "bindings.cpp",
    "cuda_backend.cpp",
    "cuda_driver.cpp",
    "dlpack_export.cpp",
    "ftensor.cpp",
    "ftensor_allocator.cpp",
    "host_backend.cpp",
    "page_allocator.cpp",
    "shared_budget.cpp",
]


def _wheel_cuda_include() -> Path | None:
    try:
        import nvidia.cuda_runtime as runtime  # the nvidia-cuda-runtime-cu12 wheel
    except ImportError:
        return None
    for base in runtime.__path__:
        candidate = Path(base) / "include"
        if (candidate / "cuda.h").is_file():
            return candidate
    return None


def cuda_include_dir() -> str:
    candidates: list[Path] = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    wheel_dir = _wheel_cuda_include()
    if wheel_dir is not None:
        candidates.append(wheel_dir)
    for candidate in candidates:
        if (candidate / "cuda.h").is_file():
            return str(candidate)
    searched = ", ".join(str(c) for c in candidates) or "(none)"
    raise SystemExit(
        "kvcached_core: cuda.h not found (searched: "
        f"{searched}). Set CUDA_HOME to a CUDA toolkit, or `pip install nvidia-cuda-runtime-cu12` "
        "into the build environment. Only the header is needed; no GPU or libcuda at build time."
    )


# One compiler per core (KVCACHED_BUILD_JOBS to choose): `nox -s build-core` compiles the
# extension once per CPython minor.
ParallelCompile("KVCACHED_BUILD_JOBS", default=0).install()

extension = Pybind11Extension(
    "kvcached_core._C",
    sources=[str(Path("csrc") / name) for name in SOURCES],
    include_dirs=[cuda_include_dir(), "csrc"],
    cxx_std=17,
    extra_compile_args=["-O2", "-Wall"],
    libraries=["dl"],
)

setuptools.setup(ext_modules=[extension], cmdclass={"build_ext": build_ext})
