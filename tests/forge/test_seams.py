"""Required seams: every cell covers each seam its engine requires exactly once, or fails closed
with one line naming the cell; the catalogue's seam table is complete; codemods never import
forge."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _fixtures import ENGINE, Project, fakeeng_project, make_registry, route_allocate

from codemods.catalog import CODEMODS, REQUIRED_SEAMS
from codemods.declare import ANY_ENGINE
from forge.cli import main
from forge.errors import TransformError
from forge.fingerprint import CODEMODS_ROOT
from forge.matrix import load_matrix
from forge.registry import Registry, default_registry
from forge.transforms import select_transforms

REPO = Path(__file__).resolve().parents[2]
CELL = "fakeeng-1.0"
SHA = "ab" * 32

VLLM_SEAMS = ["provenance", "block-pool", "allocate-slots-race", "step-end-release", "shutdown",
              "kv-budget", "engine-executor", "startup-free-memory", "memory-profile-check",
              "startup-window", "kv-buffers-v1-runner", "kv-buffers-v2-runner"]
SGLANG_SEAMS = ["provenance", "token-allocator", "paged-allocator", "mha-pool", "mla-pool",
                "capacity", "prefix-cache-bound", "config-guard", "startup-free-memory",
                "kv-profile-free-memory"]


def probe_matrix(path: Path, engine: str, series: str, version: str) -> Path:
    """A one-cell matrix for a release the repository has no cell for (nothing is fetched)."""
    path.write_text(
        'schema = 1\nindex_url = "https://pypi.org/simple"\n\n[[cell]]\n'
        f'engine = "{engine}"\nseries = "{series}"\nversion = "{version}"\nbuild = 1\n'
        'python = ">=3.11"\ntorch = "2.13.0"\nstatus = "experimental"\nreason = "probe"\n\n'
        f'[[cell.artifact]]\nrole = "wheel"\n'
        f'filename = "{engine}-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"\n'
        f'sha256 = "{SHA}"\n',
        encoding="utf-8")
    return path


def one_error_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("forge: error: ")
    return err.removeprefix("forge: error: ").rstrip("\n")


# --- the catalogue -----------------------------------------------------------------------------


def test_seam_table_names_the_seams_of_each_engine() -> None:
    registry = default_registry()
    before_ray = [seam for seam in VLLM_SEAMS if seam != "engine-executor"]  # Ray from 0.25
    assert registry.required_for("vllm", "0.24.0") == before_ray
    assert registry.required_for("vllm", "0.32.0") == VLLM_SEAMS
    assert registry.required_for("vllm", "0.25.1") == VLLM_SEAMS
    # Model Runner V2 is opt-in before 0.22: its KV buffers are not a required seam there.
    assert registry.required_for("vllm", "0.9.2") == before_ray[:-1]
    assert registry.required_for("vllm", "0.21.0") == before_ray[:-1]
    # 0.34 removed the V1 GPUModelRunner: Model Runner V2 is the only GPU runner.
    assert registry.required_for("vllm", "0.34.0") == \
        [s for s in VLLM_SEAMS if s != "kv-buffers-v1-runner"]
    # From 0.5.13 the window allocator is made elastic (the all-window one refused from 0.5.15,
    # where it exists); up to 0.5.20 the scheduler reads the capacity (the window model's sides
    # too) itself.
    assert registry.required_for("sglang", "0.5.23") == [
        *SGLANG_SEAMS, "swa-allocator", "pure-swa-refused"]
    assert registry.required_for("sglang", "0.5.20") == [
        *SGLANG_SEAMS, "scheduler-capacity", "swa-allocator", "pure-swa-refused"]
    assert registry.required_for("sglang", "0.5.14") == [
        *SGLANG_SEAMS, "scheduler-capacity", "swa-allocator"]
    assert registry.required_for("sglang", "0.5.13") == [
        *SGLANG_SEAMS, "scheduler-capacity", "swa-allocator"]
    assert registry.required_for("sglang", "0.5.12.post1") == [*SGLANG_SEAMS,
                                                              "scheduler-capacity"]


def test_every_transform_implements_a_declared_seam_and_every_seam_has_a_transform() -> None:
    declared = {(row.engine, row.seam) for row in REQUIRED_SEAMS}
    for declaration in CODEMODS:
        for seam in declaration.seams:
            assert (declaration.engine, seam) in declared or (ANY_ENGINE, seam) in declared, \
                f"{declaration.id}: seam {seam} is in no engine's seam table"
    implemented = {(d.engine, seam) for d in CODEMODS for seam in d.seams}
    for engine, seam in declared:
        assert (engine, seam) in implemented, f"{engine} seam {seam} has no codemod at all"


def test_every_codemod_states_a_description_and_no_docstring_competes_with_it() -> None:
    for declaration in CODEMODS:
        cls = declaration.codemod
        assert "DESCRIPTION" in vars(cls) and cls.DESCRIPTION.strip(), declaration.id
        assert cls.__doc__ is None, f"{cls.__name__}: DESCRIPTION is the description"


@pytest.mark.parametrize("cell", [c.name for c in load_matrix(REPO / "matrix.toml").cells])
def test_every_matrix_cell_covers_each_required_seam_exactly_once(cell: str) -> None:
    found = load_matrix(REPO / "matrix.toml").get_cell(cell)
    registry = default_registry()
    transforms = select_transforms(registry, found)
    covered = [seam for t in transforms for seam in t.seams]
    assert sorted(covered) == sorted(registry.required_for(found.engine, found.version))


def test_the_shared_allocation_of_0_29_covers_both_runners() -> None:
    transforms = default_registry().select("vllm-0.32", "vllm", "0.32", "0.32.0")
    shared = next(t for t in transforms if t.id == "vllm-kv-buffers-shared")
    assert shared.seams == ("kv-buffers-v1-runner", "kv-buffers-v2-runner")
    assert [t.id for t in transforms if "kv-buffers-v2-runner" in t.seams] == \
        ["vllm-kv-buffers-shared"]


def test_a_codemod_that_reads_the_build_says_so_and_only_then() -> None:
    # A build runs a codemod once per distinct file for all the cell's wheels unless it is
    # declared to write the build's facts (forge/transforms.py, CodemodMemo): a codemod that
    # reads `self.build` and did not say so would give every wheel the first wheel's facts.
    import inspect

    from forge.fingerprint import codemod_sources

    def reads_build(path: Path) -> bool:
        return any(isinstance(node, ast.Attribute) and node.attr == "build"
                   and isinstance(node.value, ast.Name) and node.value.id == "self"
                   and isinstance(node.ctx, ast.Load)
                   for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))))

    for declaration in CODEMODS:
        module = Path(inspect.getsourcefile(declaration.codemod) or "").resolve()
        reads = any(reads_build(path) for path in codemod_sources(module))
        assert reads == declaration.writes_build_facts, declaration.id
    assert [d.id for d in CODEMODS if d.writes_build_facts] == ["provenance"]


def test_codemods_never_import_forge() -> None:
    offenders = []
    for path in sorted(CODEMODS_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.relative_to(REPO)}:{node.lineno}: {name}"
                          for name in names if name.split(".")[0] == "forge"]
    assert offenders == []
    assert len(list(CODEMODS_ROOT.rglob("*.py"))) > 10  # the walk saw the package


# --- fail closed: the real catalogue against releases the matrix has no cell for ---------------


# Where each KV-buffer and start-up variant takes over, checked at the releases on both sides
# of each boundary (read in their sdists): 0.10.0 is the last runner with `attn_backends`,
# 0.10.1 the first with attention groups; 0.13 the last whose start-up check is in
# Worker.init_device, 0.14 the first with request_memory; Model Runner V2's caller passes
# `attn_backends` in 0.22 and `attn_groups` from 0.23; 0.24 packs KV tensors.
@pytest.mark.parametrize(("version", "v1_runner", "v2_runner", "startup"), [
    ("0.10.0", "vllm-kv-buffers-per-layer", None, "vllm-startup-free-memory-worker"),
    ("0.10.2", "vllm-kv-buffers-attn-groups", None, "vllm-startup-free-memory-worker"),
    ("0.11.2", "vllm-kv-buffers-attn-groups", None, "vllm-startup-free-memory-worker"),
    ("0.13.0", "vllm-kv-buffers-attn-groups", None, "vllm-startup-free-memory-worker"),
    ("0.14.0", "vllm-kv-buffers-attn-groups", None, "vllm-startup-free-memory"),
    ("0.21.0", "vllm-kv-buffers-attn-groups", None, "vllm-startup-free-memory"),
    ("0.22.1", "vllm-kv-buffers-attn-groups", "vllm-kv-buffers-mrv2-backends",
     "vllm-startup-free-memory"),
    ("0.23.0", "vllm-kv-buffers-attn-groups", "vllm-kv-buffers-mrv2-groups",
     "vllm-startup-free-memory"),
    ("0.24.0", "vllm-kv-buffers-tensors", "vllm-kv-buffers-mrv2", "vllm-startup-free-memory"),
])
def test_each_vllm_release_has_one_transform_per_seam(
        version: str, v1_runner: str, v2_runner: str | None, startup: str) -> None:
    series = version.rsplit(".", 1)[0]
    registry = default_registry()
    transforms = registry.select(f"vllm-{series}", "vllm", series, version)
    by_seam = {seam: t.id for t in transforms for seam in t.seams}
    assert sorted(by_seam) == sorted(registry.required_for("vllm", version))
    assert by_seam["kv-buffers-v1-runner"] == v1_runner
    assert by_seam.get("kv-buffers-v2-runner") == v2_runner
    assert by_seam["startup-free-memory"] == startup


def test_a_vllm_release_between_cells_passes_every_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = probe_matrix(tmp_path / "matrix.toml", "vllm", "0.17", "0.17.1")
    assert main(["check-matrix", "--matrix", str(matrix)]) == 0
    assert "vllm-0.17: 10 transforms" in capsys.readouterr().out


def test_a_release_older_than_every_transform_misses_its_seams(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = probe_matrix(tmp_path / "matrix.toml", "vllm", "0.8", "0.8.5")
    message = one_error_line(["check-matrix", "--matrix", str(matrix)], capsys)
    assert message == ("cell vllm-0.8: required seams block-pool, allocate-slots-race, "
                       "step-end-release, shutdown, kv-budget, startup-free-memory, "
                       "memory-profile-check, startup-window, kv-buffers-v1-runner have no "
                       "transform for vllm 0.8.5")


@pytest.mark.parametrize(("engine", "series", "version", "newest"), [
    ("vllm", "0.40", "0.40.0", "<0.35"),
    ("vllm", "0.35", "0.35.0", "<0.35"),
    ("sglang", "0.5", "0.5.24", "<0.5.24"),
    ("sglang", "0.6", "0.6.0", "<0.5.24"),
])
def test_a_release_above_every_registered_range_is_unknown(
        engine: str, series: str, version: str, newest: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    matrix = probe_matrix(tmp_path / "matrix.toml", engine, series, version)
    expected = (f"cell {engine}-{series}: {engine} version {version} is unknown "
                f"(newest registered: {newest})")
    assert one_error_line(["check-matrix", "--matrix", str(matrix)], capsys) == expected
    assert one_error_line(["transforms", f"{engine}-{series}", "--matrix", str(matrix)],
                          capsys) == expected


# --- fail closed: registries of the synthetic engine --------------------------------------------


def fakeeng_args(project: Project, command: str, registry: str) -> list[str]:
    args = project.args(command, *([CELL] if command != "check-matrix" else []),
                        registry=registry)
    if command != "build":  # only build takes --cache-dir and --dist
        cut = args.index("--cache-dir")
        args = args[:cut]
    return args


@pytest.mark.parametrize("command", ["check-matrix", "transforms", "build"])
def test_a_seam_covered_twice_fails_with_one_line(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        message = one_error_line(
            fakeeng_args(project, command, "_fixtures:registry_duplicate_seam"), capsys)
        assert not project.dist.exists() or not any(project.dist.iterdir())
        assert project.index.requests == []
    assert message == ("cell fakeeng-1.0: seam pool-allocate has 2 transforms for fakeeng "
                       "1.0.0: route-allocate, route-allocate-again")


@pytest.mark.parametrize("command", ["check-matrix", "transforms", "build"])
def test_a_missing_seam_fails_with_one_line(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        message = one_error_line(
            fakeeng_args(project, command, "_fixtures:registry_missing_seam"), capsys)
        assert project.index.requests == []
    assert message == "cell fakeeng-1.0: required seam pool-allocate has no transform for " \
                      "fakeeng 1.0.0"


def test_an_engine_without_a_seam_table_is_refused(tmp_path: Path) -> None:
    registry = Registry(codemods=[route_allocate()], patches_root=tmp_path)
    with pytest.raises(TransformError, match=r"^cell fakeeng-1.0: engine 'fakeeng' declares "
                                             r"no required seams"):
        registry.select(CELL, ENGINE, "1.0", "1.0.0")


def test_unknown_version_uses_the_range_of_diffs_and_codemods(tmp_path: Path) -> None:
    registry = make_registry(tmp_path)  # route-allocate is registered for >=1.0,<2
    assert [t.id for t in registry.select(CELL, ENGINE, "1.0", "1.9.9")] == \
        ["provenance", "route-allocate"]
    with pytest.raises(TransformError, match=r"fakeeng version 2.0.0 is unknown \(newest "
                                             r"registered: <2\)$"):
        registry.select("fakeeng-2.0", ENGINE, "2.0", "2.0.0")


def test_transforms_lists_each_seam_of_a_real_cell(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["transforms", "vllm-0.32", "--matrix", str(REPO / "matrix.toml")]) == 0
    out = capsys.readouterr().out
    table = [line.split("|")[:2] for line in out.splitlines() if line.count("|") == 4]
    rows = [(seam.strip(), transform_id.strip()) for seam, transform_id in table[1:]]
    assert rows == [
        ("provenance", "provenance"), ("block-pool", "vllm-block-pool"),
        ("allocate-slots-race", "vllm-allocate-slots-race"),
        ("step-end-release", "vllm-engine-step-release"), ("shutdown", "vllm-engine-shutdown"),
        ("engine-executor", "vllm-engine-executor"),
        ("kv-budget", "vllm-kv-budget-planned"),
        ("kv-buffers-v1-runner + kv-buffers-v2-runner", "vllm-kv-buffers-shared"),
        ("startup-free-memory", "vllm-startup-free-memory"),
        ("memory-profile-check", "vllm-memory-profile-check"),
        ("startup-window", "vllm-startup-window"),
    ]
    assert "    description:   allocate_kv_cache: torch.zeros -> shared_kv_buffer\n" in out
    assert f"required seams, each covered once: {', '.join(VLLM_SEAMS)}\n" in out


def test_check_matrix_reports_every_bad_cell_not_only_the_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = probe_matrix(tmp_path / "a.toml", "vllm", "0.40", "0.40.0").read_text()
    second = probe_matrix(tmp_path / "b.toml", "sglang", "0.6", "0.6.0").read_text()
    both = tmp_path / "matrix.toml"
    both.write_text(first + second[second.index("[[cell]]"):], encoding="utf-8")
    assert main(["check-matrix", "--matrix", str(both)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "forge: error: cell vllm-0.40: vllm version 0.40.0 is unknown (newest registered: <0.35)",
        "forge: error: cell sglang-0.6: sglang version 0.6.0 is unknown (newest registered: "
        "<0.5.24)",
    ]
