"""Unbacked pages: read-only zero page by default, writable scratch on request (vLLM's choice).

A write into a read-only zero page kills the process (SIGSEGV on the host backend, an illegal
address on CUDA), so that case runs in a child process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.vllm.config import vllm_zero_page_writable
from kvcached_core.native import as_tensor
from kvcached_core.pool import KVPool
from kvcached_core.settings import KVCachedSettings
from tests.unit.pool_factory import create_pool

PAGE = 4096


def _pool(writable: bool) -> KVPool:
    return create_pool("zero-page-test", num_layers=2, num_kv_buffers=1, block_bytes=PAGE,
                         virtual_bytes_per_layer=4 * PAGE, page_size=PAGE, min_reserve_pages=0,
                         max_reserve_pages=0, prealloc=False, share_limits=False,
                         export_metrics=False, zero_page_writable=writable)


def test_a_writable_zero_page_takes_stray_writes_and_backed_pages_stay_separate() -> None:
    pool = _pool(writable=True)
    try:
        assert not pool.backend.zero_page_read_only
        layer = as_tensor(pool.tensors[1], torch.uint8, (4 * PAGE,))
        layer[3 * PAGE:3 * PAGE + 16] = 7  # page 3 is unbacked: a dummy run's stray write
        [page] = pool.alloc(1)  # the first free page after the null block's page
        assert page == 1
        layer[page * PAGE:(page + 1) * PAGE] = 9
        assert int(layer[page * PAGE:(page + 1) * PAGE].min()) == 9
        # The other layer's backed page is its own memory, untouched by layer 1's writes.
        other = as_tensor(pool.tensors[0], torch.uint8, (4 * PAGE,))
        assert int(other[page * PAGE:(page + 1) * PAGE].max()) == 0
    finally:
        pool.close()


def test_a_read_only_zero_page_faults_on_a_write() -> None:
    script = textwrap.dedent("""
        import torch
        from kvcached_core.native import as_tensor
        from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec
        pool = KVPool.create("zero-page-ro", PoolSpec(1, 1, 4096, 4 * 4096, 4096),
                             PoolPolicy(min_reserve_pages=0, max_reserve_pages=0, prealloc=False),
                             share_limits=False, export_metrics=False)
        assert pool.backend.zero_page_read_only
        layer = as_tensor(pool.tensors[0], torch.uint8, (4 * 4096,))
        assert int(layer[3 * 4096:].max()) == 0  # reads of unbacked pages are zeros
        print("read ok", flush=True)
        layer[3 * 4096] = 1
        print("write did not fault", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert "read ok" in done.stdout, done.stderr
    assert "write did not fault" not in done.stdout
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-500:])


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("writable", True),
                                                 ("read-only", False), ("READ-ONLY", False)])
def test_vllm_uses_a_writable_zero_page_unless_told_otherwise(value: str | None,
                                                              expected: bool) -> None:
    env = {} if value is None else {"KVCACHED_ZERO_PAGE": value}
    assert vllm_zero_page_writable(KVCachedSettings.from_env(env)) is expected


def test_a_bad_zero_page_setting_is_refused() -> None:
    with pytest.raises(KVCachedConfigError, match="KVCACHED_ZERO_PAGE"):
        KVCachedSettings.from_env({"KVCACHED_ZERO_PAGE": "rw"})
