"""Options every proof suite shares: `--cell NAME` (repeatable) selects matrix cells in
tests/cells, tests/contract and tests/sglang alike; `--dist DIR` proves an earlier build."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cell", action="append", default=[],
                     help="prove only this matrix cell (repeatable; default: every cell)")
    parser.addoption("--dist", default=None, help="dist dir of an earlier build of --cell")
