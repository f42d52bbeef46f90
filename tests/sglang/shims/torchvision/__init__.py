"""Test-only import shim for torchvision (see tests/sglang/shims/_shim.py)."""

import sys

from _shim import make_package

__version__ = "0.28.0"
make_package(sys.modules[__name__], None)
