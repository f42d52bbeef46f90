"""The engine-executor seam on the release's own EngineCore (patched sdist tree).

While vLLM's own `EngineCore._initialize_kv_caches` runs, every call it makes to its executor
(the KV budget's `determine_available_memory` among them) must find that executor handed to
kvcached, so that the KV budget can reach the Ray executor's workers through its RPC; before
and after the call nothing is handed over. The method runs on a stand-in core whose executor
stops it at its first call: what is proven is the release's method, decorated, not a copy.
The Ray executor end to end is tests/e2e/test_vllm_ray_executor.py (cells with a CPU build).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.matrix import Cell
from tests.contract.vllm_contract import (
    contract_venv,
    run_on_patched_tree,
    tree_workspace,
    unpacked_sdist,
)

pytestmark = pytest.mark.slow

CELL_NEEDS_TRANSFORMS = ("vllm-engine-executor",)

SCRIPT = """
from unittest import mock

import vllm.v1.engine.core as release
from kvcached_core.integration.vllm import engine as kvcached_engine


class Stop(Exception):
    pass


class Executor:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, kvcached_engine._sizing_executor.get()))
            raise Stop(name)
        return call


class Core:
    pass


core = Core()
core.model_executor = Executor()
assert kvcached_engine._sizing_executor.get() is None
try:
    release.EngineCore._initialize_kv_caches(core, mock.MagicMock())
except Stop:
    pass
else:
    raise AssertionError("the release's _initialize_kv_caches never called its executor")
assert core.model_executor.calls, "no executor call was seen"
name, seen = core.model_executor.calls[0]
assert seen is core.model_executor, (name, seen)
assert kvcached_engine._sizing_executor.get() is None, "the executor outlived the call"
print("OK", name)
"""


def test_kv_caches_are_sized_with_the_engine_executor_in_reach(cell: Cell,
                                                                tmp_path: Path) -> None:
    python = contract_venv(cell)
    tree = unpacked_sdist(cell, tmp_path)
    tree_workspace(tree, patched=True, cell=cell)
    done = run_on_patched_tree(python, tree, SCRIPT, tmp_path)
    # The script's verdict is its last line: some releases (0.30) log to stdout before it.
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1].startswith("OK"), (
        done.stdout[-2000:] + done.stderr[-3000:])
