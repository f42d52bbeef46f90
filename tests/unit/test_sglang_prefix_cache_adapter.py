"""Which SGLang trees keep prefixes (so the bound and the limit's eviction may evict from them):
asked through the tree's own method where the release has it (0.5.22+), else by its kind."""

from __future__ import annotations

from kvcached_core.integration.sglang.prefix_cache import (
    bound_radix_tree,
    evictable_tokens,
    protected_tokens,
    shares_prefixes,
)


class RadixTree:
    """A tree of a release from 0.5.22: it answers the question itself."""

    def __init__(self, sharing: bool) -> None:
        self.sharing = sharing

    def supports_prefix_sharing(self) -> bool:
        return self.sharing

    def is_chunk_cache(self) -> bool:
        raise AssertionError("not asked when the tree answers supports_prefix_sharing")


class OlderTree:
    """A tree of 0.5.20 or 0.5.21: no supports_prefix_sharing; the chunk cache keeps nothing."""

    def __init__(self, chunk: bool) -> None:
        self.chunk = chunk

    def is_chunk_cache(self) -> bool:
        return self.chunk


def test_a_tree_that_answers_is_asked() -> None:
    assert shares_prefixes(RadixTree(sharing=True))
    assert not shares_prefixes(RadixTree(sharing=False))


def test_an_older_tree_shares_unless_it_is_the_chunk_cache() -> None:
    assert shares_prefixes(OlderTree(chunk=False))
    assert not shares_prefixes(OlderTree(chunk=True))


def test_no_tree_shares_nothing() -> None:
    assert not shares_prefixes(None)


class WindowTree:
    """A sliding-window model's SWARadixCache up to 0.5.15: asked for its sizes as a whole, it
    raises (they are per side); its entries are full-pool slots."""

    def __init__(self, cached: int, locked: int) -> None:
        self.cached, self.locked = cached, locked
        self.evicted: list[int] = []
        self.token_to_kv_pool_allocator = object()  # not elastic: no page bound

    def evictable_size(self) -> int:
        raise NotImplementedError

    def protected_size(self) -> int:
        raise NotImplementedError

    def full_evictable_size(self) -> int:
        return self.cached

    def full_protected_size(self) -> int:
        return self.locked

    def evict(self, tokens: int) -> None:
        self.evicted.append(tokens)
        self.cached -= min(tokens, self.cached)


def test_a_window_tree_is_bounded_by_its_full_side(monkeypatch) -> None:
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "100")
    tree = WindowTree(cached=900, locked=0)
    assert evictable_tokens(tree) == 900 and protected_tokens(tree) == 0
    assert bound_radix_tree(tree) == 800
    assert tree.evicted == [800] and evictable_tokens(tree) == 100
    # Within the bound, nothing more is evicted.
    assert bound_radix_tree(tree) == 0 and tree.evicted == [800]
