"""The vLLM contract tests run once per selected vLLM cell: `--cell NAME`, default every cell."""

from __future__ import annotations

import pytest

from tests.proof_cells import add_cell_option, parametrize_cells


def pytest_addoption(parser: pytest.Parser) -> None:
    add_cell_option(parser)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_cells(metafunc, "vllm")
