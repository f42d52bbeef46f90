"""The L0 sources checks on small modules shaped like the real rewrites: where a module calls
into kvcached_core, and which place a transform's anchor names."""

from __future__ import annotations

from dataclasses import replace

from forge.registry import default_registry

from .sources import anchor_scope, calls_in_scope, core_calls, diff_sections

STOCK = '''
class KVCacheManager:
    def allocate_slots(self, request):
        return self.pool.allocate(request)


class EngineCore:
    def __init__(self):
        self.block_pool = BlockPool(8)

    def step(self):
        return None
'''

PATCHED = '''
import kvcached_core.integration.vllm as _kvcached_vllm


class KVCacheManager:
    @_kvcached_vllm.none_on_pool_exhausted
    def allocate_slots(self, request):
        return self.pool.allocate(request)


class EngineCore:
    def __init__(self):
        self.block_pool = _kvcached_vllm.make_block_pool(8)

    def step(self):
        if _kvcached_vllm.ELASTIC:  # a read, not a call
            return None
        return None
'''

REBOUND = '''
class TokenAllocator:
    pass


from kvcached_core.integration.sglang import ELASTIC as _ELASTIC
from kvcached_core.integration.sglang.allocators import Mixin as _Mixin


class ElasticTokenAllocator(_Mixin, TokenAllocator):
    pass


if _ELASTIC:
    TokenAllocator = ElasticTokenAllocator
'''

LOCAL_IMPORT = '''
def release(req):
    from kvcached_core.integration.sglang.prefix_cache import bound
    bound(req)


def other():
    return len([])
'''


def test_calls_decorators_and_bases_count_where_they_are_written() -> None:
    assert core_calls(STOCK, "m.py") == []
    calls = core_calls(PATCHED, "m.py")
    assert calls_in_scope(calls, ("KVCacheManager", "allocate_slots")) == 1
    assert calls_in_scope(calls, ("EngineCore", "__init__")) == 1
    assert calls_in_scope(calls, ("EngineCore", "step")) == 0
    assert calls_in_scope(calls, ("EngineCore",)) == 1
    assert calls_in_scope(calls, ()) == 2


def test_a_rebound_class_name_is_the_class_that_calls_into_the_runtime() -> None:
    calls = core_calls(REBOUND, "m.py")
    assert calls_in_scope(calls, ("ElasticTokenAllocator",)) == 1
    assert calls_in_scope(calls, ("TokenAllocator",)) == 1
    # The runtime's mixin takes over the methods, the one the anchor names included.
    assert calls_in_scope(calls, ("TokenAllocator", "_create_buffers")) == 1
    without_rebinding = REBOUND.replace("    TokenAllocator = ElasticTokenAllocator",
                                        "    pass")
    stock_class = core_calls(without_rebinding, "m.py")
    assert calls_in_scope(stock_class, ("TokenAllocator",)) == 0
    assert calls_in_scope(stock_class, ("TokenAllocator", "_create_buffers")) == 0


def test_a_name_imported_inside_the_function_counts_there() -> None:
    calls = core_calls(LOCAL_IMPORT, "m.py")
    assert calls == [("release",)]


def test_a_same_named_import_from_elsewhere_is_not_the_runtime() -> None:
    lookalike = PATCHED.replace("import kvcached_core.integration.vllm as _kvcached_vllm",
                                "import vllm.utils as _kvcached_vllm")
    assert core_calls(lookalike, "m.py") == []


def test_the_anchor_names_a_place_in_the_module_it_targets() -> None:
    by_id = {t.id: t for t in default_registry().codemods}
    assert anchor_scope(by_id["vllm-block-pool"], "vllm",
                        "vllm/v1/core/kv_cache_coordinator.py") == ("KVCacheCoordinator",
                                                                     "__init__")
    assert anchor_scope(by_id["vllm-engine-step-release"], "vllm",
                        "vllm/v1/engine/core.py") == ("EngineCore", "step")
    assert anchor_scope(by_id["sglang-prefix-cache-bound"], "sglang",
                        "sglang/srt/mem_cache/common.py") == ("release_kv_cache",)
    assert anchor_scope(by_id["vllm-block-pool"], "vllm", "vllm/v1/engine/core.py") is None
    moved = replace(by_id["vllm-block-pool"], anchor="somewhere else entirely")
    assert anchor_scope(moved, "vllm", "vllm/v1/core/kv_cache_coordinator.py") is None


def test_diff_sections_split_a_git_diff_by_file() -> None:
    diff = ("diff --git a/p/a.py b/p/a.py\n--- a/p/a.py\n+++ b/p/a.py\n@@ -1 +1 @@\n-x\n+y\n"
            "diff --git a/p/b.py b/p/b.py\n--- a/p/b.py\n+++ b/p/b.py\n@@ -1 +1 @@\n-1\n+2\n")
    sections = diff_sections(diff)
    assert list(sections) == ["p/a.py", "p/b.py"]
    assert sections["p/b.py"].endswith("-1\n+2")
