"""codemods/sglang: before/after cases, hit counting, idempotency and fail-closed no-matches."""
# ruff: noqa: E501  (the expected output holds the generated import line verbatim)

from __future__ import annotations

import textwrap

import pytest
from libcst.codemod import CodemodContext, TransformSuccess, transform_module

from codemods.base import BuildContext, HitCountingCodemod
from codemods.catalog import CODEMODS
from codemods.sglang.allocator_paged import ElasticPagedAllocator
from codemods.sglang.allocator_token import ElasticTokenAllocator
from codemods.sglang.capacity import KVBudgetCapacity
from codemods.sglang.config_guard import RefuseUnsupportedAtConfigure
from codemods.sglang.pool_mha import ElasticMHAPool
from codemods.sglang.pool_mla import ElasticMLAPool
from codemods.sglang.prefix_cache_bound import BoundPrefixCacheOnRelease

BUILD = BuildContext(
    cell="sglang-0.5", engine="sglang", package="sglang", upstream_version="0.5.23",
    built_version="0.5.23+kvcached.1", base_artifact="sglang.whl", base_sha256="00" * 32,
    transform_ids=(), fingerprint="11" * 32, toolkit_version="0.1.0",
)


def run(codemod: type[HitCountingCodemod], source: str) -> tuple[HitCountingCodemod, str]:
    command = codemod(CodemodContext(filename="x.py"), BUILD)
    result = transform_module(command, textwrap.dedent(source))
    assert isinstance(result, TransformSuccess)
    return command, result.code


TOKEN = """\
    class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
        def __init__(self): ...
        def clear(self): ...
        def available_size(self): ...
        def alloc(self, need_size): ...
        def free(self, free_index): ...
        def free_page_ids(self, page_ids): ...
    """

TOKEN_AFTER_TAIL = '''

# kvcached: elastic TokenToKVPoolAllocator, written at build time.
# KVCACHED_ENABLE=0 keeps the class above.
from kvcached_core.integration.sglang import ELASTIC as _KVCACHED_ELASTIC
from kvcached_core.integration.sglang.allocators import ElasticTokenAllocatorMixin as _KvcachedElasticTokenAllocatorMixin


class ElasticTokenToKVPoolAllocator(_KvcachedElasticTokenAllocatorMixin, TokenToKVPoolAllocator):
    """TokenToKVPoolAllocator whose slots come from kvcached_core (elastic KV memory)."""

    _kvcached_elastic_leaf = True


if _KVCACHED_ELASTIC:
    TokenToKVPoolAllocator = ElasticTokenToKVPoolAllocator
'''


def test_token_allocator_gets_an_elastic_subclass_and_a_guarded_rebinding() -> None:
    command, code = run(ElasticTokenAllocator, TOKEN)
    assert (command.hits, command.already_applied) == (1, 0)
    assert code == textwrap.dedent(TOKEN) + TOKEN_AFTER_TAIL
    again, same = run(ElasticTokenAllocator, code)
    assert (again.hits, again.already_applied, same) == (0, 1, code)


@pytest.mark.parametrize(("codemod", "source"), [
    # upstream renamed a method the mixin overrides: no match, the build stops
    (ElasticTokenAllocator, TOKEN.replace("free_page_ids", "release_ids")),
    # the class is not defined here (moved to another module)
    (ElasticTokenAllocator, "from x import TokenToKVPoolAllocator\n"),
    (ElasticPagedAllocator, TOKEN.replace("TokenToKV", "PagedTokenToKV")),
    (ElasticMHAPool, "class MHATokenToKVPool:\n    def _create_buffers(self): ...\n"),
    (ElasticMLAPool, "class MLATokenToKVPool:\n    def __init__(self): ...\n"),
])
def test_a_moved_or_changed_anchor_matches_nothing(codemod: type[HitCountingCodemod],
                                                   source: str) -> None:
    command, code = run(codemod, source)
    assert (command.hits, command.already_applied) == (0, 0)
    assert code == textwrap.dedent(source)


def test_pools_and_paged_allocator_match_their_full_anchor() -> None:
    mha = ("class MHATokenToKVPool(KVCache):\n" + "".join(
        f"    def {name}(self): ...\n" for name in ElasticMHAPool.REQUIRED_METHODS))
    command, code = run(ElasticMHAPool, mha)
    assert command.hits == 1 and "MHATokenToKVPool = ElasticMHATokenToKVPool" in code
    mla = "class MLATokenToKVPool(KVCache):\n" + "".join(
        f"    def {name}(self): ...\n" for name in ElasticMLAPool.REQUIRED_METHODS)
    command, code = run(ElasticMLAPool, mha + mla)
    assert command.hits == 1 and code.count("class Elastic") == 1
    paged = "class PagedTokenToKVPoolAllocator:\n" + "".join(
        f"    def {name}(self): ...\n" for name in ElasticPagedAllocator.REQUIRED_METHODS)
    command, code = run(ElasticPagedAllocator, paged)
    assert command.hits == 1 and "ElasticPagedAllocatorMixin" in code


CONFIGURATOR = """\
    class KVCacheConfigurator:
        def configure(self, *, pre_model_load_memory):
            \"\"\"Apply a config.\"\"\"
            config = self._resolve(pre_model_load_memory)
            return config

        def _profile_available_bytes(self, pre_model_load_memory):
            gc.collect()
            def nested():
                return 0
            return int(rest_memory * (1 << 30))  # return in bytes

    def _profile_available_bytes():
        return 5
    """


def test_budget_wraps_every_return_of_the_method_only() -> None:
    command, code = run(KVBudgetCapacity, CONFIGURATOR)
    assert command.hits == 1
    assert "return _kvcached_kv_budget_bytes(int(rest_memory * (1 << 30)))  # return in bytes" \
        in code
    assert "            return 0\n" in code and "    return 5\n" in code  # others untouched
    assert code.index("import kv_budget_bytes as _kvcached_kv_budget_bytes") < \
        code.index("gc.collect()")
    again, same = run(KVBudgetCapacity, code)
    assert (again.hits, again.already_applied, same) == (0, 1, code)


def test_guard_goes_first_after_the_docstring() -> None:
    command, code = run(RefuseUnsupportedAtConfigure, CONFIGURATOR)
    assert command.hits == 1
    lines = code.splitlines()
    doc = lines.index('        """Apply a config."""')
    assert lines[doc + 1].strip().startswith("from kvcached_core.integration.sglang import")
    assert lines[doc + 2] == "        if _KVCACHED_ELASTIC_GUARD():"
    assert "post_capture_kv_sizing=self.post_capture_kv_active" in code
    again, same = run(RefuseUnsupportedAtConfigure, code)
    assert (again.hits, again.already_applied, same) == (0, 1, code)


def test_prefix_bound_is_appended_to_release_kv_cache() -> None:
    source = """\
        def release_kv_cache(req, tree_cache, *, checkpoint):
            if not req.kv.holds_kv:
                return
            tree_cache.on_release(req, checkpointed=checkpoint)
            req.kv.mark_kv_released()

        def other(tree_cache):
            pass
        """
    command, code = run(BoundPrefixCacheOnRelease, source)
    assert command.hits == 1
    body = code.split("def other")[0]
    assert body.rstrip().endswith("bound_prefix_cache(tree_cache)")
    assert body.index("req.kv.mark_kv_released()") < body.index("bound_prefix_cache")
    again, same = run(BoundPrefixCacheOnRelease, code)
    assert (again.hits, again.already_applied, same) == (0, 1, code)
    missing, _ = run(BoundPrefixCacheOnRelease, "def release(req):\n    pass\n")
    assert missing.hits == 0


def test_every_sglang_transform_is_registered_for_0_5_23_only() -> None:
    sglang = {t.id: t for t in CODEMODS if t.engine == "sglang"}
    assert set(sglang) == {
        "sglang-token-allocator", "sglang-paged-allocator", "sglang-mha-pool",
        "sglang-mla-pool", "sglang-kv-budget", "sglang-refuse-unsupported",
        "sglang-prefix-cache-bound", "sglang-startup-free-memory",
        "sglang-kv-profile-free-memory",
    }
    for transform in sglang.values():
        assert transform.applies_to("sglang", "0.5.23")
        assert not transform.applies_to("sglang", "0.5.22")
        assert not transform.applies_to("vllm", "0.5.23")
