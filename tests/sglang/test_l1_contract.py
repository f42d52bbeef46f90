"""L1 for cell sglang-0.5: the patched allocators, pools and radix cache, run in the patched
engine's venv (tests/sglang/inside: alloc, free, free groups, paged extend and decode,
evict, match, the prefix-cache bound, refusals)."""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from ._venv import EngineVenv
from .conftest import INSIDE, engine_env

INNER_FILES = ("test_allocators.py", "test_pools.py", "test_radix_cache.py")


def test_patched_mem_cache_contract(patched_venv: EngineVenv, tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [str(patched_venv.python), "-m", "pytest", "-q", "-c", str(INSIDE / "pytest.ini"),
         "--rootdir", str(INSIDE), "--confcutdir", str(INSIDE), f"--junitxml={report}",
         *(str(INSIDE / f) for f in INNER_FILES)],
        env=engine_env(tmp_path, elastic=True), capture_output=True, text=True, timeout=600,
        cwd=INSIDE,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    suite = ElementTree.parse(report).getroot().find("testsuite")
    assert suite is not None
    assert int(suite.get("failures", "1")) == 0 and int(suite.get("errors", "1")) == 0
    assert int(suite.get("skipped", "1")) == 0
    assert int(suite.get("tests", "0")) >= 15
    assert not (tmp_path / "shim-calls.log").exists()


def test_switch_off_exports_sglangs_own_classes(patched_venv: EngineVenv, tmp_path: Path) -> None:
    probe = (
        "from sglang.srt.mem_cache import common, kv_cache_configurator as c, memory_pool as m\n"
        "from sglang.srt.mem_cache.allocator import paged, token\n"
        "from sglang._kvcached_build import describe\n"
        "names = [token.TokenToKVPoolAllocator, paged.PagedTokenToKVPoolAllocator,\n"
        "         m.MHATokenToKVPool, m.MLATokenToKVPool, c.TokenToKVPoolAllocator]\n"
        "print([n.__name__ for n in names], len(describe()['transforms']))\n"
    )
    run = subprocess.run([str(patched_venv.python), "-c", probe],
                         env=engine_env(tmp_path, elastic=False), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip().splitlines()[-1] == (
        "['TokenToKVPoolAllocator', 'PagedTokenToKVPoolAllocator', 'MHATokenToKVPool', "
        "'MLATokenToKVPool', 'TokenToKVPoolAllocator'] 8"
    )
