"""Elastic MHA and MLA pools: SGLang's KV buffers as views of VMM-backed tensors.

Each layer's buffers keep SGLang's shapes, strides and dtype; only their storage changes. One
`KVPool` per SGLang pool reserves the virtual range once (so every `data_ptr()` is stable for
the pool's life) and maps physical pages as the allocator hands out blocks. A ledger block is
one SGLang page (`page_size` token slots) of every layer; block 0 is SGLang's padding page.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import TYPE_CHECKING, Any

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.sglang.ranks import engine_rank_agreement
from kvcached_core.integration.sglang.switch import sglang_settings
from kvcached_core.native import as_tensor
from kvcached_core.pool import BackendKind, KVPool, PoolPolicy, PoolSpec

if TYPE_CHECKING:
    import torch

#: The attribute under which an elastic SGLang pool keeps its `KVPool`.
POOL_ATTRIBUTE = "kvcached_pool"
_pool_numbers = itertools.count()


def kvcached_pool_of(kvcache: object) -> KVPool:
    """The `KVPool` behind an elastic SGLang pool; refuses any other pool, clearly."""
    pool = getattr(kvcache, POOL_ATTRIBUTE, None) if kvcache is not None else None
    if isinstance(pool, KVPool):
        return pool
    raise KVCachedConfigError(
        "kvcached: the elastic token allocator needs an elastic KV pool, got "
        f"{type(kvcache).__name__}; this pool layout is not supported with KVCACHED_ENABLE=1 "
        "(supported: MHATokenToKVPool and MLATokenToKVPool). Set KVCACHED_ENABLE=0 to run "
        "SGLang's own memory pools."
    )


def _ceil_to(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _backend_of(device: str) -> tuple[BackendKind, int]:
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        if index:
            return "cuda", int(index)
        import torch

        return "cuda", torch.cuda.current_device()
    if device == "cpu":
        return "host", 0
    raise KVCachedConfigError(
        f"kvcached: SGLang device {device!r} is not supported (cpu or cuda)"
    )


def create_kv_pool(
    *, kind: str, device: str, num_layers: int, num_buffers: int, page_tokens: int,
    token_bytes: int, rows: int,
) -> tuple[KVPool, int]:
    """A `KVPool` whose per-layer buffers each hold at least `rows` token rows.

    Returns the pool and the rows each buffer region really spans (whole physical pages).
    """
    engine_rank_agreement()  # refuses ranks that do not share every batch
    settings = sglang_settings()
    block_bytes = page_tokens * token_bytes
    unit = max(settings.page_size, block_bytes)
    region_bytes = _ceil_to(rows * token_bytes, unit)
    backend, index = _backend_of(device)
    pool = KVPool.create(
        f"sglang-{kind}-{os.getpid()}-{next(_pool_numbers)}",
        PoolSpec.from_settings(settings, num_layers=num_layers, num_kv_buffers=num_buffers,
                               block_bytes=block_bytes,
                               virtual_bytes_per_layer=region_bytes * num_buffers),
        PoolPolicy.from_settings(settings),
        backend=backend,
        device=index,
        export_metrics=False,
    )
    return pool, pool.geometry.bytes_per_layer_per_buffer // token_bytes


#: Set in the body of the class the build writes; a subclass of it does not inherit the claim.
LEAF_MARKER = "_kvcached_elastic_leaf"


def refuse_unless_leaf(instance: object, what: str) -> None:
    """Elastic storage is wired only for the exact classes the build wrote.

    A subclass (SGLang's page-major, unified or sharded pools and allocators) lays out or
    hands out memory in its own way, so it is refused rather than run half-elastic.
    """
    cls = type(instance)
    if not cls.__dict__.get(LEAF_MARKER, False):
        raise KVCachedConfigError(
            f"kvcached: {cls.__module__}.{cls.__qualname__} derives from the elastic {what} "
            "but is not supported with KVCACHED_ENABLE=1 (its own memory layout or "
            "allocation); set KVCACHED_ENABLE=0 for this configuration"
        )


def _refuse_unless_plain(pool: Any, what: str) -> None:
    if pool.memory_saver_adapter.enabled:
        raise KVCachedConfigError(
            f"kvcached: {what} with --enable-memory-saver is not supported (both own the KV "
            "memory); drop the flag or set KVCACHED_ENABLE=0"
        )
    if pool.enable_custom_mem_pool:
        raise KVCachedConfigError(
            f"kvcached: {what} with a custom memory pool (SGLANG_MOONCAKE_CUSTOM_MEM_POOL) is "
            "not supported; unset it or set KVCACHED_ENABLE=0"
        )


def _hybrid_side_label(pool: Any) -> str | None:
    """"SWA" or "Full" when `pool` is being built as one side of a hybrid sliding-window pool
    (`SWAKVPool`) by a release that does not label its sides (before 0.5.17), else None.

    The hybrid pool is the `self` of an `__init__` a few frames up: it sets both sides' sizes
    and layer counts before it builds them, so the side whose (size, layer count) this pool
    has is the one being built. When both sides have the same, the window side is the one
    built first (0.5.13 - 0.5.16 build `swa_kv_pool`, then `full_kv_pool`).
    """
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner: Any = frame.f_locals.get("self")
        if (frame.f_code.co_name != "__init__" or owner is pool
                or not hasattr(owner, "swa_layer_nums") or not hasattr(owner, "full_layer_nums")):
            continue
        mine = (pool.size, pool.layer_num)
        sides = [label for label, key in (("SWA", (owner.size_swa, owner.swa_layer_nums)),
                                          ("Full", (owner.size, owner.full_layer_nums)))
                 if key == mine]
        if len(sides) == 2:
            return "Full" if hasattr(owner, "swa_kv_pool") else "SWA"
        return sides[0] if sides else None
    return None


class ElasticMHAPoolMixin:
    """MHATokenToKVPool whose fused per-layer K/V buffer is a view of a VMM-backed tensor."""

    kvcached_pool: KVPool | None = None

    def _create_buffers(self) -> None:
        pool: Any = self
        refuse_unless_leaf(self, "MHA pool")
        if pool.is_quantized_kv_cache or pool.post_capture_active:
            raise KVCachedConfigError(
                "kvcached: quantized KV caches and post-capture KV sizing are not supported "
                "with elastic pools; set KVCACHED_ENABLE=0 for them"
            )
        super()._create_buffers()  # type: ignore[misc]

    def _create_buffers_normal(self) -> None:
        pool: Any = self
        _refuse_unless_plain(pool, "an elastic MHA pool")
        k_shape, v_shape = pool._kv_buffer_shapes()
        if pool.kv_cache_layout != "nhd" or k_shape != v_shape:
            raise KVCachedConfigError(
                f"kvcached: the {pool.kv_cache_layout!r} KV layout with K shape {k_shape} and "
                f"V shape {v_shape} is not supported; elastic pools need the NHD layout with "
                "equal K and V head dims"
            )
        self._kvcached_back_kv(k_shape)

    def _kvcached_back_kv(self, shape: tuple[int, ...]) -> None:
        """Reserve one KV pool for every layer's K and V of ``shape`` (rows, H, D) and set
        ``k_buffer`` / ``v_buffer`` to views of it laid out as the release lays them out."""
        pool: Any = self
        store_dtype: torch.dtype = pool.store_dtype
        row_elems = shape[1] * shape[2]
        # A hybrid window model's two MHA pools say which they are ("Full", "SWA"), so that
        # `kvctl`, `kvtop` and a limit per pool tell the window layers' pool apart:
        # sglang-mha-swa-<pid>-<n>. Before 0.5.17 SGLang does not label them.
        label = getattr(pool, "allocation_label", None) or _hybrid_side_label(pool)
        kind = f"mha-{label.lower()}" if label else "mha"
        kv_pool, region_rows = create_kv_pool(
            kind=kind, device=str(pool.device), num_layers=pool.layer_num, num_buffers=2,
            page_tokens=pool.page_size, token_bytes=row_elems * store_dtype.itemsize,
            rows=shape[0],
        )
        pool.kvcached_pool = kv_pool
        pool.k_buffer, pool.v_buffer = self._kvcached_kv_views(kv_pool, region_rows, shape)

    def _kvcached_kv_views(self, kv_pool: KVPool, region_rows: int, shape: tuple[int, ...]
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, K and V as SGLang 0.5.23 lays them out: the halves of one
        (2, rows, H, D) allocation; here the halves are the layer's two buffer regions."""
        store_dtype: torch.dtype = self.store_dtype  # type: ignore[attr-defined]
        row_elems = shape[1] * shape[2]
        fused = [
            as_tensor(tensor, store_dtype, (2, region_rows, *shape[1:]),
                      strides=(region_rows * row_elems, row_elems, shape[2], 1))
            for tensor in kv_pool.tensors
        ]
        rows = shape[0]
        return [buffer[0, :rows] for buffer in fused], [buffer[1, :rows] for buffer in fused]

    def _clear_buffers(self) -> None:
        super()._clear_buffers()  # type: ignore[misc]
        close_kv_pool(self)


class ElasticMHASeparateKVPoolMixin(ElasticMHAPoolMixin):
    """MHATokenToKVPool of a release that allocates K and V of a layer separately (up to
    0.5.22): each buffer is a tensor of its own over one of the layer's two regions."""

    def _kvcached_kv_views(self, kv_pool: KVPool, region_rows: int, shape: tuple[int, ...]
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        store_dtype: torch.dtype = self.store_dtype  # type: ignore[attr-defined]
        row_elems = shape[1] * shape[2]
        strides = (row_elems, shape[2], 1)
        region_bytes = region_rows * row_elems * store_dtype.itemsize
        rows = shape[0]
        keys, values = [], []
        for tensor in kv_pool.tensors:
            keys.append(as_tensor(tensor, store_dtype, (rows, *shape[1:]), strides=strides))
            values.append(as_tensor(tensor, store_dtype, (rows, *shape[1:]), strides=strides,
                                    offset=region_bytes))
        return keys, values


class ElasticMHAInlineBuffersPoolMixin(ElasticMHASeparateKVPoolMixin):
    """MHATokenToKVPool of a release whose ``_create_buffers`` allocates K and V inline (up
    to 0.5.15: no ``_create_buffers_normal``, no quantized or post-capture paths): K and V
    apart as in the separate-KV mixin, then the per-layer pointer and stride tables that
    ``_create_buffers`` derives from the buffers for SGLang's copy kernels."""

    def _create_buffers(self) -> None:
        pool: Any = self
        refuse_unless_leaf(self, "MHA pool")
        _refuse_unless_plain(pool, "an elastic MHA pool")
        # Releases without these attributes have V's head dim equal to K's (before 0.5.6) and
        # only the NHD layout (before AITER's vectorized layout, 0.5.13).
        k_shape = (pool.size + pool.page_size, pool.head_num, pool.head_dim)
        v_shape = (pool.size + pool.page_size, pool.head_num,
                   getattr(pool, "v_head_dim", pool.head_dim))
        layout = getattr(pool, "kv_cache_layout", "nhd")
        if layout != "nhd" or k_shape != v_shape:
            raise KVCachedConfigError(
                f"kvcached: the {layout!r} KV layout with K shape {k_shape} and "
                f"V shape {v_shape} is not supported; elastic pools need the NHD layout with "
                "equal K and V head dims"
            )
        if "float4" in str(pool.dtype):
            # 0.5.5.post3 allocates an FP4 cache inline (half-width K and V plus per-block
            # scale buffers), which these views do not describe.
            raise KVCachedConfigError(
                "kvcached: the FP4 KV cache (--kv-cache-dtype fp4_e2m1) is not supported with "
                "elastic pools; set KVCACHED_ENABLE=0 for it"
            )
        self._kvcached_back_kv(k_shape)
        import torch

        # What the release computes right after allocating: the copy kernels read every
        # layer's K then V base address and its bytes per token row from these tables.
        buffers = [*pool.k_buffer, *pool.v_buffer]
        pool.k_data_ptrs = torch.tensor([b.data_ptr() for b in pool.k_buffer],
                                        dtype=torch.uint64, device=pool.device)
        pool.v_data_ptrs = torch.tensor([b.data_ptr() for b in pool.v_buffer],
                                        dtype=torch.uint64, device=pool.device)
        pool.data_ptrs = torch.cat([pool.k_data_ptrs, pool.v_data_ptrs], dim=0)
        pool.data_strides = torch.tensor(
            [b[0].numel() * b.element_size() for b in buffers], device=pool.device)


class ElasticMLAPoolMixin:
    """MLATokenToKVPool whose per-layer latent buffer is a view of a VMM-backed tensor (up to
    0.5.5 the build moved the release's inline allocation into ``_create_buffers`` first)."""

    kvcached_pool: KVPool | None = None

    def _create_buffers(self) -> None:
        pool: Any = self
        refuse_unless_leaf(self, "MLA pool")
        _refuse_unless_plain(pool, "an elastic MLA pool")
        if "float4" in str(pool.dtype):
            # Up to 0.5.5 the pool itself allocates an FP4 cache (half-width latent plus
            # scale buffers), which these views do not describe; later releases give FP4 a
            # subclass of its own, refused as any subclass is.
            raise KVCachedConfigError(
                "kvcached: the FP4 KV cache (--kv-cache-dtype fp4_e2m1) is not supported with "
                "elastic pools; set KVCACHED_ENABLE=0 for it"
            )
        rows = pool.size + pool.page_size
        store_dtype: torch.dtype = pool.store_dtype
        # Releases before 0.5.3 keep no kv_cache_dim: the latent is the LoRA rank plus rope.
        dim = getattr(pool, "kv_cache_dim", None) or pool.kv_lora_rank + pool.qk_rope_head_dim
        kv_pool, region_rows = create_kv_pool(
            kind="mla", device=str(pool.device), num_layers=pool.layer_num, num_buffers=1,
            page_tokens=pool.page_size, token_bytes=dim * store_dtype.itemsize, rows=rows,
        )
        pool.kvcached_pool = kv_pool
        pool.kv_buffer = [
            as_tensor(tensor, store_dtype, (region_rows, 1, dim), strides=(dim, dim, 1))[:rows]
            for tensor in kv_pool.tensors
        ]

    def _clear_buffers(self) -> None:
        super()._clear_buffers()  # type: ignore[misc]
        close_kv_pool(self)


def close_kv_pool(sglang_pool: object) -> None:
    """Stop the pool's background work (its memory goes with the last view)."""
    pool = getattr(sglang_pool, POOL_ATTRIBUTE, None)
    if isinstance(pool, KVPool):
        pool.close()
