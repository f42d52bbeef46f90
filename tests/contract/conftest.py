"""The vLLM contract tests run once per selected vLLM cell: `--cell NAME`, default every cell."""

from __future__ import annotations

import pytest

from tests.proof_cells import parametrize_cells


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_cells(metafunc, "vllm")
