"""Seam: the KV buffers of vLLM 0.10.1 - 0.23, one unpacked buffer per KVCacheTensor.

These releases have neither the runner's `attn_backends` list that 0.9 - 0.10.0 pass
(`vllm-kv-buffers-per-layer`) nor the packed backings of 0.24 - 0.28
(`vllm-kv-buffers-tensors`): each KVCacheTensor gets its own
`torch.zeros(size, dtype=torch.int8, device=...)`, which the runner views through the attention
backends of its attention groups. The rewritten call site goes to the same adapter as 0.24 - 0.28
(`kv_tensor_buffer`) with `block_stride=0` (nothing is packed) and the layouts, as each release
names them:

- V1 `GPUModelRunner._allocate_kv_cache_tensors` (0.10.1 - 0.23): `self.attn_groups`, a list
  per KV cache group of AttentionGroups (backend, layer names);
- Model Runner V2 `gpu/attn_utils._allocate_kv_cache` (0.22 - 0.23), which is not given the
  layouts, so its one caller `init_kv_cache` passes them in as a new keyword: in 0.22 that caller
  holds `attn_backends`, a dict of layer name to backend class; in 0.23 `attn_groups`, as in
  0.24.
"""

from __future__ import annotations

from codemods.vllm.kv_buffers import ModelRunnerV2KVBuffers, PerLayerKVBuffers

_UNPACKED = ("kv_cache_config=kv_cache_config, kv_cache_tensor=kv_cache_tensor, "
             "block_stride=0, ")


def _groups_layouts(attn_groups: str) -> str:
    return (f"kv_layouts=[(g.layer_names, g.backend.get_kv_cache_shape, "
            f"g.backend.get_kv_cache_stride_order) for gs in {attn_groups} for g in gs]")


class AttentionGroupKVBuffers(PerLayerKVBuffers):
    DESCRIPTION = ("GPUModelRunner._allocate_kv_cache_tensors: torch.zeros -> kv_tensor_buffer "
                   "(attention groups, unpacked)")
    ADAPTER = "kv_tensor_buffer"
    EXTRA = _UNPACKED + _groups_layouts("self.attn_groups")


class ModelRunnerV2BackendsKVBuffers(ModelRunnerV2KVBuffers):
    # Three places: the zeros site, the new `attn_backends=()` parameter, and the keyword in
    # the call from `init_kv_cache`. `dict(...)` reads the empty default as no layouts.
    DESCRIPTION = ("gpu/attn_utils._allocate_kv_cache: torch.zeros -> kv_tensor_buffer "
                   "(layer backends, unpacked)")
    GROUPS = "attn_backends"
    EXTRA = _UNPACKED + (
        "kv_layouts=[((name,), backend.get_kv_cache_shape, "
        "backend.get_kv_cache_stride_order) for name, backend in dict(attn_backends).items()]")


class ModelRunnerV2GroupsKVBuffers(ModelRunnerV2KVBuffers):
    # As ModelRunnerV2BackendsKVBuffers, with the caller's attention groups (0.23).
    DESCRIPTION = ("gpu/attn_utils._allocate_kv_cache: torch.zeros -> kv_tensor_buffer "
                   "(attention groups, unpacked)")
    GROUPS = "attn_groups"
    EXTRA = _UNPACKED + _groups_layouts("attn_groups")
