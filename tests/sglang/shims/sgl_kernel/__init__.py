"""Test-only import shim for sgl_kernel (see tests/sglang/shims/_shim.py)."""

import sys

from _shim import make_package

__version__ = "0.0.0+shim"
make_package(sys.modules[__name__], ("kvcacheio",))
