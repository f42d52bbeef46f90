"""Options every proof suite shares: `--cell NAME` (repeatable) selects matrix cells in
tests/cells, tests/contract and tests/sglang alike; `--dist DIR` proves an earlier build;
`--heavy` picks the cells whose heavy proofs run; `--proof-results DIR` collects what the
heavy proofs measured (docs/testing.md)."""

from __future__ import annotations

import os

import pytest

HEAVY_CHOICES = ("newest", "all", "none")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cell", action="append", default=[],
                     help="prove only this matrix cell (repeatable; default: every cell)")
    parser.addoption("--dist", default=None, help="dist dir of an earlier build of --cell")
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
