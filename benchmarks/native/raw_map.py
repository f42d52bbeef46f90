"""Build (once) and load the benchmark-only raw driver extension `kvcached_raw_map`.

`bench_raw_map` times cuMemCreate + cuMemMap + cuMemSetAccess in C++, the floor that
`bench_map_page.py` compares the page allocator against. It is compiled from `raw_map.cpp` and
the product's CUDA backend sources into `build/bench-native/`, so the product extension
(`kvcached_core._C`) carries no benchmark code. Needs the build tools of the product (a C++17
compiler, pybind11, cuda.h; see setup.py).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
BUILD = ROOT / "build" / "bench-native"
SOURCES = [Path(__file__).with_name("raw_map.cpp"), CSRC / "cuda_backend.cpp",
           CSRC / "cuda_driver.cpp"]
MODULE = "kvcached_raw_map"


def _cuda_include_dir() -> str:
    """cuda.h from $CUDA_HOME, /usr/local/cuda or the nvidia-cuda-runtime wheel (as setup.py)."""
    candidates = [Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    candidates.append(Path("/usr/local/cuda/include"))
    try:
        import nvidia.cuda_runtime as runtime

        candidates += [Path(base) / "include" for base in runtime.__path__]
    except ImportError:
        pass
    for candidate in candidates:
        if (candidate / "cuda.h").is_file():
            return str(candidate)
    raise SystemExit(f"cuda.h not found (searched: {', '.join(map(str, candidates))})")


def _stale(built: list[Path]) -> bool:
    if not built:
        return True
    newest_source = max(p.stat().st_mtime for p in [*SOURCES, *CSRC.glob("*.hpp")])
    return min(p.stat().st_mtime for p in built) < newest_source


def load() -> ModuleType:
    """The extension, rebuilt when a source changed since the last build."""
    built = sorted(BUILD.glob(f"{MODULE}*.so"))
    if _stale(built):
        from pybind11.setup_helpers import Pybind11Extension, build_ext
        from setuptools import Distribution

        extension = Pybind11Extension(
            MODULE, sources=[str(p) for p in SOURCES],
            include_dirs=[_cuda_include_dir(), str(CSRC)], cxx_std=17,
            extra_compile_args=["-O2", "-Wall"], libraries=["dl"],
        )
        command = build_ext(Distribution({"name": MODULE, "ext_modules": [extension]}))
        command.build_lib = str(BUILD)
        command.build_temp = str(BUILD / "tmp")
        command.force = True
        command.ensure_finalized()
        command.run()
    if str(BUILD) not in sys.path:
        sys.path.insert(0, str(BUILD))
    return importlib.import_module(MODULE)
