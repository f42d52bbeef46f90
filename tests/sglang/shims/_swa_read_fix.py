"""Test-side fix of an upstream SGLang bug: the torch-native attention backend reads a
sliding-window (SWA) layer's KV at the wrong slots (tests only; on with
KVCACHED_TEST_SWA_READ_FIX=1, in stock and elastic engines alike).

A hybrid SWA model keeps two KV pools (`SWAKVPool`, mem_cache/swa_memory_pool.py): the
full-attention layers' and the window layers'. `req_to_token` holds full-pool slots; the SWA
slot of a token is `SWAKVPool.full_to_swa_index_mapping[full slot]` (SWATokenToKVPoolAllocator,
mem_cache/allocator/swa.py; a slot whose SWA peer was freed maps to 0, the padding slot).
`TorchNativeAttnBackend` (layers/attention/torch_native_backend.py) translates when it WRITES
(`init_forward_metadata` computes `swa_out_cache_loc` with `translate_loc_from_full_to_swa`,
which `forward_extend` / `forward_decode` hand to `set_kv_buffer`), but when it READS
(`_run_sdpa_forward_extend` / `_run_sdpa_forward_decode`, called from `forward_extend` /
`forward_decode`) it indexes the SWA sub-pool's buffers with the untranslated full-pool slots of
`req_to_token` (SGLang 0.5.23 and the releases around it; the Triton backend translates on
reads). Stock gets the right tokens only while both sub-allocators hand slots out in lockstep,
so that full slot == SWA slot; once SWA eviction frees window slots early (or an allocator
such as kvcached's best-fit one hands slots out in another order) it attends to other tokens'
keys and values.

The fix: for an SWA layer (`pool.layers_mapping[layer_id][1]`), the rows of `req_to_token`
the read uses are translated with `translate_loc_from_full_to_swa` first. Slots that left the
window translate to the padding slot, which the backend's window mask hides. Full layers and
non-SWA pools are untouched. A release whose backend already translates on its read path
(its `forward_extend` / `forward_decode` / `_run_sdpa_*` source names the mapping) is left
alone rather than translated twice.

The backend module is patched when it is first imported (a `sys.meta_path` hook), so that a
process that never builds an engine does not import SGLang because of this.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

ENV = "KVCACHED_TEST_SWA_READ_FIX"
BACKEND_MODULE = "sglang.srt.layers.attention.torch_native_backend"
_PATCHED = "_kvcached_test_swa_read_fix"
_READS = ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode")
_FORWARDS = ("forward_extend", "forward_decode")
# Names a backend that translates on its read path would use there.
_ALREADY_TRANSLATES = ("translate_loc_from_full_to_swa", "full_to_swa_index_mapping")


def _swa_pool_of(backend: Any, layer: Any) -> Any:
    """The backend's SWAKVPool when ``layer`` is one of its window layers, else None."""
    pool = getattr(backend, "token_to_kv_pool", None)
    layers_mapping = getattr(pool, "layers_mapping", None)
    if not layers_mapping or getattr(pool, "full_to_swa_index_mapping", None) is None:
        return None
    _, is_swa_layer = layers_mapping[layer.layer_id]
    return pool if is_swa_layer else None


def _wrap_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """forward_extend / forward_decode that tell the read below which pool to translate for."""

    @functools.wraps(forward)
    def wrapper(self: Any, q: Any, k: Any, v: Any, layer: Any, *args: Any,
                **kwargs: Any) -> Any:
        self._kvcached_swa_read_pool = _swa_pool_of(self, layer)
        try:
            return forward(self, q, k, v, layer, *args, **kwargs)
        finally:
            self._kvcached_swa_read_pool = None

    return wrapper


def _wrap_read(read: Callable[..., Any]) -> Callable[..., Any]:
    """_run_sdpa_forward_extend / _decode reading an SWA layer through translated slots."""

    @functools.wraps(read)
    def wrapper(self: Any, query: Any, output: Any, k_cache: Any, v_cache: Any,
                req_to_token: Any, req_pool_indices: Any, *args: Any, **kwargs: Any) -> Any:
        pool = getattr(self, "_kvcached_swa_read_pool", None)
        if pool is not None:
            # Only the batch's rows: row i of the translated table is request i's.
            req_to_token = pool.translate_loc_from_full_to_swa(
                req_to_token[req_pool_indices].long())
            req_pool_indices = _arange_like(req_pool_indices)
        return read(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                    *args, **kwargs)

    return wrapper


def _arange_like(indices: Any) -> Any:
    import torch

    return torch.arange(indices.shape[0], device=indices.device, dtype=torch.int64)


def _translates_on_read(cls: type, names: Sequence[str]) -> bool:
    for name in names:
        try:
            source = inspect.getsource(getattr(cls, name))
        except (OSError, TypeError):
            continue
        if any(word in source for word in _ALREADY_TRANSLATES):
            return True
    return False


def patch_torch_native_swa_reads(module: types.ModuleType) -> bool:
    """Patch ``module.TorchNativeAttnBackend`` (see the module's docstring); True if patched
    now or before, False when the release has nothing to patch or already translates."""
    cls = getattr(module, "TorchNativeAttnBackend", None)
    if cls is None or not all(hasattr(cls, name) for name in _READS + _FORWARDS):
        return False
    if getattr(cls, _PATCHED, False):
        return True
    if _translates_on_read(cls, _READS + _FORWARDS):
        return False
    for name in _FORWARDS:
        setattr(cls, name, _wrap_forward(getattr(cls, name)))
    for name in _READS:
        setattr(cls, name, _wrap_read(getattr(cls, name)))
    cls._kvcached_swa_read_pool = None
    setattr(cls, _PATCHED, True)
    return True


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader,
                 patch: Callable[[types.ModuleType], object]) -> None:
        self.loader = loader
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...
        return getattr(self.loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders and patches the module once it has run."""

    def __init__(self, name: str, patch: Callable[[types.ModuleType], object]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, self.patch)
                return spec
        return None


def install() -> None:
    """Patch the torch-native backend when it is imported (now, if it already is)."""
    if BACKEND_MODULE in sys.modules:
        patch_torch_native_swa_reads(sys.modules[BACKEND_MODULE])
        return
    if not any(isinstance(f, _PatchOnImport) and f.name == BACKEND_MODULE
               for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(BACKEND_MODULE, patch_torch_native_swa_reads))
