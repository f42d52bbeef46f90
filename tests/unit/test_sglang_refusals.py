"""What SGLang's configuration guard stops at start with elastic memory on
(`kvcached_core/integration/sglang/startup.py`, called where each cell's guard codemod put it)."""

from __future__ import annotations

import pytest

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.sglang.startup import refuse_unsupported

PLAIN = dict(enable_memory_saver=False, custom_mem_pool=False, post_capture_kv_sizing=False)
WINDOW_SHAPES = {"--enable-unified-memory": False, "--enable-hierarchical-cache": False,
                 "an MLA attention backend": False, "speculative decoding": False}


def test_a_plain_model_and_a_hybrid_window_model_start_from_0_5_21() -> None:
    refuse_unsupported(**PLAIN)
    refuse_unsupported(**PLAIN, mamba_layers=False, sliding_window=True,
                       sliding_window_with=WINDOW_SHAPES)


@pytest.mark.parametrize("shape", sorted(WINDOW_SHAPES))
def test_a_window_model_with_pools_around_its_window_layers_is_refused(shape: str) -> None:
    with pytest.raises(KVCachedConfigError) as refused:
        refuse_unsupported(**PLAIN, sliding_window=True,
                           sliding_window_with={**WINDOW_SHAPES, shape: True})
    message = str(refused.value)
    assert f"a sliding-window model with {shape}" in message
    assert "KVCACHED_ENABLE=0" in message and "\n" not in message


def test_the_same_features_without_a_window_model_are_not_refused_for_it() -> None:
    refuse_unsupported(**PLAIN, sliding_window=False,
                       sliding_window_with=dict.fromkeys(WINDOW_SHAPES, True))


def test_mamba_and_older_cells_hybrid_models_are_refused_in_one_line() -> None:
    with pytest.raises(KVCachedConfigError, match="Mamba / linear-attention state pools"):
        refuse_unsupported(**PLAIN, mamba_layers=True, sliding_window=True,
                           sliding_window_with=WINDOW_SHAPES)
    with pytest.raises(KVCachedConfigError, match="hybrid sliding-window or linear-attention"):
        refuse_unsupported(**PLAIN, hybrid_layers=True)


def test_ranks_that_schedule_different_batches_are_refused_before_any_pool_exists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached_core.integration.sglang import pools, ranks

    monkeypatch.setattr(ranks, "distributed_world_size", lambda: 2)
    monkeypatch.setattr(ranks, "_ranks_not_sharing_batches", lambda _: "pipeline parallelism")
    with pytest.raises(KVCachedConfigError) as refused:
        pools.create_kv_pool(kind="mha", device="cpu", num_layers=2, num_buffers=2,
                             page_tokens=16, token_bytes=64, rows=1024)
    message = str(refused.value)
    assert "over 2 ranks" in message and "pipeline parallelism" in message
    assert "KVCACHED_ENABLE=0" in message and "\n" not in message
    monkeypatch.setattr(ranks, "distributed_world_size", lambda: 1)
    pool, rows = pools.create_kv_pool(kind="mha", device="cpu", num_layers=2, num_buffers=2,
                                      page_tokens=16, token_bytes=64, rows=1024)
    try:
        assert rows >= 1024
    finally:
        pool.close()
