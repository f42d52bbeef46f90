"""Options every proof suite shares: `--cell NAME` (repeatable) selects matrix cells in
tests/cells, tests/contract and tests/sglang alike; `--built-dist DIR` proves an earlier build;
`--heavy` picks the cells whose heavy proofs run; `--proof-results DIR` collects what the
heavy proofs measured (docs/testing.md)."""

from __future__ import annotations

import os
from typing import Any

import pytest

HEAVY_CHOICES = ("newest", "all", "none")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cell", action="append", default=[],
                     help="prove only this matrix cell (repeatable; default: every cell)")
    parser.addoption("--built-dist", default=None, help="dist dir of an earlier build of --cell")
    parser.addoption("--heavy", choices=HEAVY_CHOICES, default="newest",
                     help="cells whose heavy proofs (full build, L1, L2) run: the newest "
                          "supported cell of each engine (default), every selected cell, or "
                          "none; every selected cell runs its cheap L0 sources proof")
    parser.addoption("--proof-results", default=None,
                     help="directory the heavy proofs write their measured counts to "
                          "(JSON, read by nox -s verify-<cell>)")


def pytest_configure(config: pytest.Config) -> None:
    # A named trial that lacks its files stops the run here with one line, before any cell
    # proof could fall back to the repository's matrix. Imported only then: the runtime's
    # tests run where the toolkit's dependencies are not installed.
    if os.environ.get("KVCACHED_PROOF_TRIAL", "").strip():
        from tests.proof_cells import proof_matrix_path, proof_registry

        proof_matrix_path()
        proof_registry()


# Which tests share one xdist worker (`nox -s tests` runs `pytest -n auto --dist loadscope`, and
# with `--dist loadscope` the groups below are xdist's scopes):
# - "checkout": the tests that write into the checkout itself (the e2e tests publish into dist/
#   and build the README's engine venv; test_readme and test_workflows run nox sessions, which
#   install the runtime editable and so rebuild its extension in place): two at once would
#   write the same files;
# - one group per proof suite whose session-scoped environments are built for the run and
#   shared by its modules (SGLang venvs, vLLM contract trees): on one worker they are built once;
# - every other module is its own group, so its module-scoped fixtures are built once (the two
#   modules of tests/cells share nothing: each builds its own cells' sources or wheels).
# A worker takes its next group when the one it runs is nearly done, in collection order, which
# puts the longest groups first (`--no-loadscope-reorder` keeps that order): the longest starts
# at once on one worker while the others work through the rest, and the shorter ones fill in
# behind them (on two workers: the checkout on one, the contract and SGLang suites and the
# cells' modules on the other, the small modules wherever a worker is free).
_WRITES_TO_CHECKOUT = ("e2e/", "forge/test_readme.py", "forge/test_workflows.py")
_SUITE_GROUPS = ("sglang/", "contract/")
_GROUP_ORDER = ("checkout", "contract", "sglang", "cells/test_cell_sources.py",
                "cells/test_cell_build.py")


def worker_group(nodeid: str) -> str:
    """The group of a test, from its node id (`tests/<module path>::...`)."""
    path = nodeid.split("::", 1)[0].removeprefix("tests/")
    if path.startswith(_WRITES_TO_CHECKOUT):
        return "checkout"
    for suite in _SUITE_GROUPS:
        if path.startswith(suite):
            return suite.rstrip("/")
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(_GROUP_ORDER)}
    # Stable: collection order within a group and among the modules.
    items.sort(key=lambda item: rank.get(worker_group(item.nodeid), len(rank)))
    # A test marked verify_only proves its cell in the cell's verify-<cell> record only.
    if config.getoption("--heavy") != "all":
        skip = pytest.mark.skip(reason="proven in each cell's verify-<cell> record "
                                       "(--heavy=all), not on every CI run: docs/testing.md")
        for item in items:
            if item.get_closest_marker("verify_only") is not None:
                item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `--dist loadscope`, xdist's scopes are `worker_group`'s groups.

    (xdist's own `loadgroup` marks tests by rewriting their node ids, which pytest 9.2 no
    longer reads; a scheduler sees the ids as they are.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkerGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return WorkerGroupScheduling(config, log)
