"""Which SGLang trees keep prefixes (so the bound and the limit's eviction may evict from them):
asked through the tree's own method where the release has it (0.5.22+), else by its kind."""

from __future__ import annotations

from kvcached_core.integration.sglang.prefix_cache import shares_prefixes


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
