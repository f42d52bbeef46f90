"""Seam config-guard, 0.5.13 - 0.5.15: hybrid sliding-window models pass, Mamba models do not,
first in the model runner's ``init_memory_pool``.

``config_guard_model_runner``'s place and settings (the runner's ``ServerArgs``, no
post-capture KV sizing yet) with ``config_guard_swa``'s rule: a window model is served (its
composite allocator is elastic from 0.5.13, ``allocator_swa_model_runner``), unless one of the
features that build other pools or allocators around the window layers is on. Unified memory
is a server argument from 0.5.15 only, hence the ``getattr``. Kept apart from
``config_guard_model_runner``, whose source is part of the patch-set fingerprint of 0.5.10 -
0.5.12, where window models stay refused.
"""

from __future__ import annotations

from codemods.sglang.config_guard_model_runner import RefuseUnsupportedAtInitMemoryPool

GUARD = """if _KVCACHED_ELASTIC_GUARD():
    from kvcached_core.integration.sglang.startup import refuse_unsupported

    refuse_unsupported(
        enable_memory_saver=self.server_args.enable_memory_saver,
        custom_mem_pool=envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get() is not None,
        post_capture_kv_sizing=False,
        mamba_layers=self.mambaish_config is not None,
        sliding_window=self.is_hybrid_swa,
        sliding_window_with={
            "--enable-unified-memory": getattr(self.server_args, "enable_unified_memory", False),
            "--enable-hierarchical-cache": self.server_args.enable_hierarchical_cache,
            "an MLA attention backend": self.use_mla_backend,
            "speculative decoding": not self.spec_algorithm.is_none(),
        },
    )
"""


class RefuseUnsupportedAtInitMemoryPoolSwa(RefuseUnsupportedAtInitMemoryPool):
    DESCRIPTION = ("Refuse memory saver, custom mem pool and Mamba pools first in the model "
                   "runner's init_memory_pool; hybrid sliding-window models pass.")
    GUARD = GUARD
