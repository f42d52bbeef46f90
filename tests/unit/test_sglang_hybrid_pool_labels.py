"""The two MHA pools of a hybrid sliding-window model name their side in their limit records
(sglang-mha-full-* / sglang-mha-swa-*), also where the release does not label them (SGLang
0.5.13 - 0.5.16 build the window side, then the full side, with no `allocation_label`)."""

from __future__ import annotations

from typing import Any

from kvcached_core.integration.sglang.pools import _hybrid_side_label


class SidePool:
    """Stands in for an MHA pool: records the side it finds while it builds its buffers."""

    def __init__(self, size: int, layer_num: int) -> None:
        self.size, self.layer_num = size, layer_num
        self.label = self._create_buffers()

    def _create_buffers(self) -> str | None:
        return self._back_kv()

    def _back_kv(self) -> str | None:
        return _hybrid_side_label(self)


class HybridPool:
    """The shape of SGLang 0.5.16's SWAKVPool.__init__: sizes and layer counts first, then the
    window side, then the full side."""

    def __init__(self, size: int, size_swa: int, swa_layers: int, full_layers: int) -> None:
        self.size, self.size_swa = size, size_swa
        self.swa_layer_nums, self.full_layer_nums = swa_layers, full_layers
        self.swa_kv_pool = SidePool(size=size_swa, layer_num=swa_layers)
        self.full_kv_pool = SidePool(size=size, layer_num=full_layers)


def test_each_side_is_found_by_its_size_and_layers() -> None:
    pool = HybridPool(size=4096, size_swa=1024, swa_layers=3, full_layers=1)
    assert (pool.swa_kv_pool.label, pool.full_kv_pool.label) == ("SWA", "Full")


def test_sides_alike_are_told_apart_by_the_order_they_are_built() -> None:
    pool = HybridPool(size=2048, size_swa=2048, swa_layers=2, full_layers=2)
    assert (pool.swa_kv_pool.label, pool.full_kv_pool.label) == ("SWA", "Full")


def test_a_pool_built_on_its_own_has_no_side() -> None:
    assert SidePool(size=2048, layer_num=2).label is None

    class Unrelated:
        def __init__(self) -> None:
            self.inner: Any = SidePool(size=16, layer_num=1)

    assert Unrelated().inner.label is None
