"""Stand-ins for what vLLM hands the KV-buffer adapter: its KVCacheConfig (tensors, groups and
their specs) and its attention backends' shape and stride-order functions.

The unit tests drive the adapter with these; the contract tests run the same adapter on vLLM's
own classes. Only the fields the adapter reads are here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def blocks_first_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
    """FlashAttention / FlashInfer in vLLM 0.23 - 0.25."""
    return (num_blocks, 2, block_size, num_kv_heads, head_size)


def kv_first_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
    """K and V planes outermost (FlashAttention <= 0.22, ROCm attention)."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def cpu_shape(num_blocks: int, block_size: int, num_kv_heads: int,
              head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
    """CPU attention in vLLM 0.23 - 0.28."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def nhd() -> tuple[int, ...]:
    return (0, 1, 2, 3, 4)


def hnd() -> tuple[int, ...]:
    return (0, 1, 3, 2, 4)


def no_stride_order() -> tuple[int, ...]:
    raise NotImplementedError


@dataclass
class FullAttentionSpec:
    """An attention layer's KV cache spec: tokens per block, heads, head size, block bytes
    (named as vLLM's: the adapter tells model families apart by spec class names)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    page_size_bytes: int


@dataclass
class SlidingWindowSpec(FullAttentionSpec):
    """A sliding-window layer's spec (vLLM's is a sibling of FullAttentionSpec; the class
    name is what counts)."""

    sliding_window: int = 64


@dataclass
class MambaSpec:
    """A Mamba layer's state spec (no attention shape)."""

    block_size: int
    page_size_bytes: int


@dataclass
class Group:
    kv_cache_spec: FullAttentionSpec | MambaSpec
    layer_names: list[str]


@dataclass
class Tensor:
    size: int
    shared_by: list[str]
    offset: int = 0
    block_stride: int = 0


@dataclass
class Config:
    kv_cache_tensors: list[Tensor]
    kv_cache_groups: list[Group] = field(default_factory=list)


def set_elastic_env(monkeypatch: Any, shm_dir: Any, pool: str, page: int) -> None:
    """The environment of an elastic vLLM adapter test: only these KVCACHED_ settings, no
    reserve and no preallocation (a test sees exactly the pages its blocks need)."""
    import os

    for key in [k for k in os.environ if k.startswith("KVCACHED_")]:
        monkeypatch.delenv(key)
    for key, value in {"KVCACHED_ENABLE": "1", "KVCACHED_PAGE_SIZE": str(page),
                       "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "0",
                       "KVCACHED_PREALLOC": "0", "KVCACHED_POOL_NAME": pool,
                       "KVCACHED_SHM_DIR": str(shm_dir)}.items():
        monkeypatch.setenv(key, value)

