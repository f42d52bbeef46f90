"""Model families: which kinds of KV cache each KV-buffer site makes elastic.

A model's family is what its KV cache groups are made of, as vLLM's own KV cache specs say
(`vllm/v1/kv_cache_interface.py`): full attention, sliding-window attention, MLA's compressed
latent, Mamba / linear-attention state; an fp8 KV cache is a dtype on any of them. Whether a
family can be elastic is decided by the KV-buffer site the cell's transform calls, not by a
version check here: each site function declares the families it serves (`SITE_FAMILIES`) and
refuses every other family at start with one line naming it, the cell and `KVCACHED_ENABLE=0`.
The version range of a family is then the range of the transforms that call its sites
(`codemods/catalog.py`); the README carries the table, checked against this module and the
catalog by `tests/unit/test_vllm_families.py`.

- `per_layer_kv_buffer` (vLLM 0.9 - 0.10.0) builds one buffer per layer from one backend's
  shape: one group of full attention (fp8 included).
- `kv_tensor_buffer` (vLLM 0.10.1 - 0.28) builds the buffer of each KVCacheTensor (or the one
  packed backing) from the attention groups' shapes: besides full attention, sliding-window
  groups (vLLM's hybrid allocator shares each tensor between one layer of every group, with
  one page size), MLA's one latent plane, and Mamba state beside attention (the runners lay a
  hybrid Mamba model's every buffer out blocks-first, so a block is one page-sized range).
- `shared_kv_buffer` (vLLM 0.29 - 0.34) is handed vLLM's one backing buffer and the
  KVCacheTensors every group overlays on it (each block id belongs to one group at a time).
  Backing block `b` of every tensor is the same bytes whatever the group's kind, so every family
  is served whose groups share one block geometry (`kv_buffers.shared_geometry` refuses those
  that do not). The site is not told the groups' kinds; the geometry is what it relies on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvcached_core.errors import KVCachedConfigError


@dataclass(frozen=True)
class Family:
    """One kind of KV cache group, told apart by its vLLM spec class names."""

    name: str
    #: As the README's model families table names it.
    title: str
    what: str
    #: vLLM KVCacheSpec class names whose groups belong to it (the most derived class wins).
    spec_classes: tuple[str, ...]


FULL_ATTENTION = Family("full-attention", "full attention", "full attention (dense decoders)",
                        ("FullAttentionSpec",))
SLIDING_WINDOW = Family("sliding-window", "sliding window", "sliding-window attention beside "
                        "full attention (Gemma 2/3, GPT-OSS, Mistral SWA)",
                        ("SlidingWindowSpec", "SlidingWindowMLASpec"))
MLA = Family("mla", "MLA", "MLA, one compressed latent per token (DeepSeek V2/V3, Kimi K2)",
             ("MLAAttentionSpec",))
MAMBA = Family("mamba", "Mamba / linear attention", "Mamba / linear-attention state beside "
               "attention (Qwen3-Next, Nemotron-H, Jamba, Granite 4)", ("MambaSpec",))
FP8_KV = Family("fp8-kv", "fp8 KV cache", "an fp8 KV cache (kv_cache_dtype=fp8*) on any of "
                "them; its scales are attributes of the attention layers, outside the KV "
                "buffer", ())
FAMILIES: tuple[Family, ...] = (FULL_ATTENTION, SLIDING_WINDOW, MLA, MAMBA, FP8_KV)

#: The families each KV-buffer site makes elastic.
SITE_FAMILIES: dict[str, frozenset[str]] = {
    "per_layer_kv_buffer": frozenset({FULL_ATTENTION.name, FP8_KV.name}),
    "kv_tensor_buffer": frozenset({FULL_ATTENTION.name, FP8_KV.name, SLIDING_WINDOW.name,
                                   MLA.name, MAMBA.name}),
    "shared_kv_buffer": frozenset(family.name for family in FAMILIES),
}

_BY_CLASS = {name: family for family in FAMILIES for name in family.spec_classes}
_FP8_DTYPES = ("float8", "uint8")  # torch.float8_e4m3fn / _e5m2 on GPUs; CPU stores uint8


def _specs(spec: Any) -> Iterator[Any]:
    """The per-layer specs of a group's spec (vLLM's UniformTypeKVCacheSpecs holds several)."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict):
        for value in inner.values():
            yield from _specs(value)
    else:
        yield spec


def family_of_spec(spec: Any) -> str:
    """The family of one KV cache spec: its most derived class with a known name."""
    for cls in type(spec).__mro__:
        family = _BY_CLASS.get(cls.__name__)
        if family is not None:
            return family.name
    return f"unknown ({type(spec).__name__})"


def families_of(kv_cache_config: Any) -> list[str]:
    """The families of a KVCacheConfig's groups, in FAMILIES order (unknown kinds last)."""
    found: set[str] = set()
    for group in kv_cache_config.kv_cache_groups:
        for spec in _specs(group.kv_cache_spec):
            found.add(family_of_spec(spec))
            if any(mark in str(getattr(spec, "dtype", "")) for mark in _FP8_DTYPES):
                found.add(FP8_KV.name)
    order = [family.name for family in FAMILIES]
    return sorted(found, key=lambda name: (order.index(name) if name in order else len(order),
                                           name))


def build_cell() -> str:
    """The cell of the running patched build (its `_kvcached_build` module), for messages."""
    try:
        from vllm import _kvcached_build
    except ImportError:
        return "this build"
    return str(getattr(_kvcached_build, "CELL", "this build"))


def require_served(site: str, families: Iterable[str]) -> None:
    """Refuse, with one line, a model with a family `site` does not make elastic."""
    served = SITE_FAMILIES[site]
    missing = [name for name in families if name not in served]
    if missing:
        what = {family.name: family.what for family in FAMILIES}
        named = "; ".join(f"{name}: {what.get(name, 'a KV cache kind kvcached does not know')}"
                          for name in missing)
        raise KVCachedConfigError(
            f"elastic KV cache (kvcached) does not serve the {', '.join(missing)} model "
            f"family in {build_cell()} ({named}); set KVCACHED_ENABLE=0 for the stock KV "
            "cache")
