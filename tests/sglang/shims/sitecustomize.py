"""Start-up hook of the processes the SGLang tests run (this directory is on their PYTHONPATH).

SGLang up to 0.5.1 asks torch whether the CPU has AMX tiles through
`torch._C._cpu._is_amx_tile_supported()`, at import. The one CPU torch that installs here (2.13)
answers that question as `torch.cpu._is_amx_tile_supported()` and no longer has the old name, so
those releases could not be imported at all. The old name is bound to torch's own current
answer; a torch that still has it is left alone, and no other name is touched.

With KVCACHED_TEST_SWA_READ_FIX=1 it also installs `_swa_read_fix`: SGLang's torch-native
attention backend reads sliding-window layers' KV at untranslated full-pool slots (an upstream
bug, described there); the fix applies to stock and elastic engines alike.
"""

from __future__ import annotations

import os

import torch

_MOVED_TO_TORCH_CPU = ("_is_amx_tile_supported",)

for _name in _MOVED_TO_TORCH_CPU:
    if not hasattr(torch._C._cpu, _name) and hasattr(torch.cpu, _name):
        setattr(torch._C._cpu, _name, getattr(torch.cpu, _name))

# The torch-native backend's sliding-window read fix (see _swa_read_fix.py), when asked for.
if os.environ.get("KVCACHED_TEST_SWA_READ_FIX") == "1":
    import _swa_read_fix

    _swa_read_fix.install()
