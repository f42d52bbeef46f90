"""Seam startup-free-memory up to 0.5.20: the pre-load figure is read in
``init_torch_distributed`` (srt/distributed/bootstrap.py), which 0.5.21 split into
``measure_pre_model_load_memory``; the read and its rewrite are the same
(codemods/sglang/startup_memory.py).
"""

from __future__ import annotations

from codemods.sglang.startup_memory import _ElasticFreeMemory


class ElasticPreModelLoadMemoryAtInit(_ElasticFreeMemory):
    DESCRIPTION = ("init_torch_distributed: get_available_gpu_memory(distributed=...) "
                   "through elastic_free_memory_gb(..., startup_window=\"begin\" unless "
                   "is_draft_worker)")
    METHOD = "init_torch_distributed"
    STARTUP_WINDOW = "begin"
    NO_WINDOW_WHEN = "is_draft_worker"
