"""Start-up hook of the processes the SGLang tests run (this directory is on their PYTHONPATH).

SGLang up to 0.5.1 asks torch whether the CPU has AMX tiles through
`torch._C._cpu._is_amx_tile_supported()`, at import. The one CPU torch that installs here (2.13)
answers that question as `torch.cpu._is_amx_tile_supported()` and no longer has the old name, so
those releases could not be imported at all. The old name is bound to torch's own current
answer; a torch that still has it is left alone, and no other name is touched.
"""

from __future__ import annotations

import torch

_MOVED_TO_TORCH_CPU = ("_is_amx_tile_supported",)

for _name in _MOVED_TO_TORCH_CPU:
    if not hasattr(torch._C._cpu, _name) and hasattr(torch.cpu, _name):
        setattr(torch._C._cpu, _name, getattr(torch.cpu, _name))
