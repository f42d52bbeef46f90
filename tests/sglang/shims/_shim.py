"""Import-only stand-ins for packages SGLang imports but the CPU tests never run (tests only).

`sgl_kernel` has no CPU wheel for this machine and `torchvision` would replace the pinned torch.
Every attribute of a shim module is a function that records its call (to the file named by
`KVCACHED_SHIM_CALL_LOG`, so engine subprocesses report too) and raises: a test asserts that
the log stayed empty, i.e. that none of them ran.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

LOG_ENV = "KVCACHED_SHIM_CALL_LOG"


def _record(name: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{os.getpid()} {name}\n")


def _stand_in(qualified: str) -> Any:
    def called(*args: object, **kwargs: object) -> None:
        _record(qualified)
        raise RuntimeError(f"test shim: {qualified} was called; it has no implementation here")

    called.__name__ = qualified.rpartition(".")[2]
    called.__qualname__ = qualified
    return called


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ShimModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        value = _stand_in(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = ShimModule(spec.name)
        module.__path__ = []  # every shim is a package: any submodule imports
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the submodules of one shim package: all of them, or only those listed."""

    def __init__(self, root: str, submodules: tuple[str, ...] | None) -> None:
        self.root = root
        self.submodules = submodules

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        root, dot, rest = fullname.partition(".")
        if root != self.root or not dot:
            return None
        if self.submodules is not None and rest.split(".")[0] not in self.submodules:
            return None  # ImportError: SGLang's own fallbacks take over
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def make_package(module: types.ModuleType, submodules: tuple[str, ...] | None) -> None:
    """Turn an imported shim package into one whose attributes are stand-ins."""
    module.__class__ = ShimModule
    if not any(isinstance(f, _Finder) and f.root == module.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(module.__name__, submodules))
