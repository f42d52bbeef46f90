"""upgrade-check and upgrade-scan against a real local index serving a small synthetic vLLM.

The synthetic releases' sources are the transform fixtures' "before" files placed where the
transforms look for them, so every vLLM transform finds its anchor; a second release lacks one
anchor and has no sdist, a third is a pre-release.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import shutil
import socket
import sys
import tarfile
import threading
import tomllib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from forge.build import approve_diffs, check_reviewed_diff
from forge.cli import main
from forge.errors import DiffMismatchError
from forge.index import LocalIndex
from forge.matrix import load_matrix
from forge.registry import PATCHES_ROOT, default_registry
from forge.trial import PROOF_TRIAL_ENV, trial_matrix_path, trial_registry
from tests.forge.conftest import Member, WheelRecipe, build_wheel
from tests.transforms.test_vllm_startup_memory_codemods import REQUEST_MEMORY

FIXTURES = Path(__file__).resolve().parents[1] / "transforms" / "fixtures"
WHEEL_TAGS = "cp38-abi3-manylinux_2_28_x86_64"


def fake_vllm_sources(*, without_allocate_slots: bool = False) -> dict[str, str]:
    """vllm/ sources on which every transform of the vllm-0.32 set finds its anchor."""
    def before(transform: str) -> str:
        return (FIXTURES / transform / "before.py").read_text(encoding="utf-8")

    manager = before("vllm-allocate-slots-race")
    if without_allocate_slots:
        manager = manager.replace("def allocate_slots(", "def allocate_blocks(")
    return {
        "vllm/__init__.py": '__version__ = "fake"\n',
        "vllm/v1/core/kv_cache_coordinator.py": before("vllm-block-pool"),
        "vllm/v1/core/kv_cache_manager.py": manager,
        "vllm/v1/engine/core.py": before("vllm-kv-budget-planned"),
        "vllm/v1/worker/utils.py": REQUEST_MEMORY + "\n\n" + before("vllm-kv-buffers-shared"),
        # The worker as 0.32 has it: the snapshot (startup window) and the profile assertion.
        "vllm/v1/worker/gpu_worker.py": before("vllm-startup-window"),
    }


def fake_wheel(version: str, sources: dict[str, str], out: Path) -> Path:
    metadata = (f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n"
                "Requires-Python: >=3.10,<3.15\nRequires-Dist: torch==2.14.0\n"
                "Requires-Dist: numpy\n\nA synthetic vllm.\n").encode()
    recipe = WheelRecipe(name="vllm", version=version, tags=WHEEL_TAGS,
                         package={path: Member(text.encode()) for path, text in sources.items()},
                         extra_dist_info={"METADATA": metadata})
    return build_wheel(recipe, out)


def fake_sdist(version: str, sources: dict[str, str], out: Path) -> Path:
    path = out / f"vllm-{version}.tar.gz"
    top = f"vllm-{version}"
    members = {f"{top}/PKG-INFO": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n",
               **{f"{top}/{name}": text for name, text in sources.items()}}
    with tarfile.open(path, "w:gz") as archive:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Project:
    root: Path
    matrix: Path
    patches: Path
    cache: Path
    index_url: str

    def args(self, *rest: str) -> list[str]:
        return [*rest, "--matrix", str(self.matrix), "--patches-dir", str(self.patches),
                "--cache-dir", str(self.cache), "--index-url", self.index_url]


MATRIX = """schema = 1
index_url = "https://pypi.org/simple"

[[cell]]
engine = "vllm"
series = "0.32"
version = "0.32.0"
build = 1
python = ">=3.10,<3.15"
torch = "2.11.0"
status = "supported"

[cell.proof]
torch = "2.13.0"
l1_tests = ["tests/v1/core/test_prefix_caching.py"]
l1_min_passed = 533
block_pool_args = "True, 16"

[cell.proof.kv_manager]
setup = "upstream.init_none_hash(upstream.sha256)"
manager = "upstream.make_kv_cache_manager(config, max_model_len=8192)"
request = "upstream.make_request(request_id, tokens, 16, upstream.sha256)"

[[cell.artifact]]
role = "wheel"
filename = "{wheel}"
sha256 = "{sha256}"
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    """A local index with vllm 0.32.0 (the cell), 0.33.0 (wheel + sdist), 0.34.0 (wheel only,
    allocate_slots renamed) and 0.35.0rc1; the cell's reviewed diff approved as forge does."""
    root = tmp_path_factory.mktemp("upgrade")
    with LocalIndex(root / "index") as index:
        packages = index.packages_dir
        cell_wheel = fake_wheel("0.32.0", fake_vllm_sources(), packages)
        fake_wheel("0.33.0", fake_vllm_sources(), packages)
        fake_sdist("0.33.0", fake_vllm_sources(), packages)
        fake_wheel("0.34.0", fake_vllm_sources(without_allocate_slots=True), packages)
        fake_wheel("0.35.0rc1", fake_vllm_sources(), packages)
        matrix = root / "matrix.toml"
        matrix.write_text(MATRIX.format(wheel=cell_wheel.name, sha256=sha256_of(cell_wheel)),
                          encoding="utf-8")
        patches = root / "patches"
        (patches / "vllm" / "0.32").mkdir(parents=True)
        shutil.copyfile(PATCHES_ROOT / "vllm" / "0.32" / "series",
                        patches / "vllm" / "0.32" / "series")
        found = Project(root, matrix, patches, root / "cache", index.simple_url.rstrip("/"))
        approve_diffs("vllm-0.32", matrix_path=matrix, cache_dir=found.cache,
                      registry=default_registry(patches_root=patches),
                      index_url=found.index_url, progress=lambda _line: None)
        yield found


def reviewed_files(project: Project) -> list[str]:
    return sorted(p.name for p in project.patches.rglob("reviewed/*"))


def entry_floor(out: Path) -> int:
    entry = tomllib.loads((out / "matrix-entry.toml").read_text(encoding="utf-8"))["cell"][0]
    return int(entry["proof"]["l1_min_passed"])


@dataclass
class ProofCall:
    argv: list[str]
    env: dict[str, str]
    cwd: Path


class FakeProofs:
    """Stands in for the L0/L1 pytest runs: records each call; L1 writes its count as the real
    L1 test does (`--proof-results`), unless told to fail."""

    def __init__(self, *, fail: str = "", counts_on_failure: bool = False, patched: int = 7,
                 stock: int = 7, collected: int = 9) -> None:
        self.calls: list[ProofCall] = []
        self.fail, self.counts = fail, (patched, stock, collected)
        # The release's own tests passed (their count written) but another L1 test failed.
        self.counts_on_failure = counts_on_failure

    def __call__(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path,
                 progress: Callable[[str], None]) -> tuple[int, str]:
        self.calls.append(ProofCall(list(argv), dict(env), cwd))
        step = "L1" if "tests/contract" in argv else "L0"
        with log.open("a", encoding="utf-8") as sink:
            sink.write(f"{step} ran\n")
        if step == self.fail and not self.counts_on_failure:
            return 1, ("..F.\nFAILED tests/contract/test_vllm_core_contract.py::"
                       "test_core_tests_pass_on_the_patched_tree[vllm-0.33] - assert\n"
                       "1 failed, 3 passed in 2.00s")
        if step == "L1":
            results = Path(next(a for a in argv if a.startswith("--proof-results="))
                           .split("=", 1)[1])
            cell = next(a for a in argv if a.startswith("--cell=")).split("=", 1)[1]
            patched, stock, collected = self.counts
            (results / f"l1-{cell}.json").write_text(json.dumps(
                {"cell": cell, "proof": "l1", "patched_passed": patched,
                 "stock_passed": stock, "collected": collected}), encoding="utf-8")
            if step == self.fail:
                return 1, ("FAILED tests/contract/test_vllm_allocate_race.py::test_lost_page_race"
                           "_leaves_the_request_as_before[vllm-0.33] - TypeError\n"
                           "1 failed, 3 passed in 3.00s")
            return 0, "....\n4 passed in 3.00s"
        return 0, "....\n12 passed, 1 skipped in 5.00s"


@pytest.fixture
def fake_proofs(monkeypatch: pytest.MonkeyPatch) -> FakeProofs:
    fake = FakeProofs()
    monkeypatch.setattr("forge.upgrade.trial.run_proof_command", fake)
    return fake


def test_every_seam_finds_the_cells_change_and_a_cell_is_proposed(
        project: Project, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        fake_proofs: FakeProofs) -> None:
    matrix_before = project.matrix.read_text(encoding="utf-8")
    out = tmp_path / "report"
    assert main(project.args("upgrade-check", "vllm", "0.33.0", "--out", str(out))) == 0
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))

    assert report["nearest_cell"] == "vllm-0.32"
    assert report["sources"] == "sdist vllm-0.33.0.tar.gz"
    required = default_registry().required_for("vllm", "0.33.0")
    assert [row["seam"] for row in report["seams"]] == required
    chosen = {row["seam"]: (row["chosen"], row["result"]) for row in report["seams"]}
    assert chosen["block-pool"] == ("vllm-block-pool", "same change")
    assert chosen["kv-budget"] == ("vllm-kv-budget-planned", "same change")
    assert chosen["kv-buffers-v2-runner"] == ("vllm-kv-buffers-shared", "same change")
    assert chosen["provenance"] == ("provenance", "applied")
    variants = {v["id"]: v for v in report["variants"]}
    # Tried regardless of its registered range (<0.11): it finds the budget but not the
    # workers' plan of a release that does not unify its ranks.
    assert variants["vllm-kv-budget-planned-unified"]["result"] == "partial"
    assert variants["vllm-kv-buffers-per-layer"]["result"] == "not found"
    assert variants["vllm-block-pool"]["compile_check"] == "ok"
    assert variants["vllm-block-pool"]["import_check"] == \
        "ok: uses _kvcached_vllm.make_block_pool"

    assert report["cell_proposed"] and not report["cell_written"]
    entry = tomllib.loads((out / "matrix-entry.toml").read_text(encoding="utf-8"))["cell"][0]
    assert (entry["series"], entry["version"], entry["status"]) == ("0.33", "0.33.0",
                                                                    "experimental")
    assert (entry["python"], entry["torch"]) == (">=3.10,<3.15", "2.14.0")
    packages = project.root / "index" / "packages"
    assert {a["filename"]: a["sha256"] for a in entry["artifact"]} == {
        name: sha256_of(packages / name)
        for name in (f"vllm-0.33.0-{WHEEL_TAGS}.whl", "vllm-0.33.0.tar.gz")}
    assert (out / "unreviewed" / "vllm-block-pool.diff").is_file()
    assert "| block-pool | vllm-block-pool | same change |" in \
        (out / "report.md").read_text(encoding="utf-8")
    assert project.matrix.read_text(encoding="utf-8") == matrix_before
    assert reviewed_files(project) == ["vllm.diff"]
    assert "vllm 0.33.0: every required seam has one working variant" in capsys.readouterr().out
    # The chosen transforms applied together build trial wheels, all inside the report folder.
    assert report["build"].startswith("built vllm-0.33.0+kvcached.1-")
    assert sorted(p.name for p in (out / "dist" / "vllm-0.33").glob("*.whl")) == [
        "kvcached_vllm-0.33.0+kvcached.1-py3-none-any.whl",
        f"vllm-0.33.0+kvcached.1-{WHEEL_TAGS}.whl"]
    assert (out / "trial-patches" / "vllm" / "0.33" / "reviewed" / "vllm.diff").is_file()

    # Then L0 and L1 of the proposed cell, on that trial, as their own pytest runs.
    root = Path(__file__).resolve().parents[2]
    results = (out / "proof-results").resolve()
    common = ["--cell=vllm-0.33", "--heavy=all", f"--proof-results={results}", "-q", "-rfE",
              "-p", "no:cacheprovider"]
    l0, l1 = fake_proofs.calls
    assert l0.argv == [sys.executable, "-m", "pytest", "tests/cells", *common,
                       f"--built-dist={(out / 'dist' / 'vllm-0.33').resolve()}"]
    assert l1.argv == [sys.executable, "-m", "pytest", "tests/contract", *common]
    for call in (l0, l1):
        assert call.cwd == root
        assert call.env[PROOF_TRIAL_ENV] == str(out.resolve())
        assert call.env["KVCACHED_FORGE_CACHE"] == str(project.cache.resolve())
        assert call.env["KVCACHED_FORGE_INDEX_URL"] == project.index_url
    # The trial the env var names is the one the wheels were built with.
    trial = trial_registry(out)
    chosen_ids = {row["chosen"] for row in report["seams"]}
    assert [t.id for t in trial.codemods] == [t.id for t in default_registry().codemods
                                              if t.id in chosen_ids]  # catalogue order
    trial_cell = load_matrix(trial_matrix_path(out)).get_cell("vllm-0.33")
    assert trial_cell.proof is not None and trial_cell.proof.l1_min_passed == 1
    assert report["l0_l1"] == "L0 passed (12 passed, 1 skipped); L1 7/9 on both trees"
    assert {"trial build", "L0", "L1"} <= set(report["timings"])
    assert "- L0/L1: L0 passed (12 passed, 1 skipped); L1 7/9 on both trees" in \
        (out / "report.md").read_text(encoding="utf-8")
    assert (out / "l0-l1.log").read_text(encoding="utf-8") == "L0 ran\nL1 ran\n"
    # The measured count is the proposed cell's L1 floor.
    assert entry_floor(out) == 7


def test_write_cell_appends_an_experimental_cell_that_validates(
        project: Project, tmp_path: Path) -> None:
    matrix = tmp_path / "matrix.toml"
    shutil.copyfile(project.matrix, matrix)
    args = project.args("upgrade-check", "vllm", "0.33.0", "--out", str(tmp_path / "r"),
                        "--write-cell", "--no-build")
    args[args.index("--matrix") + 1] = str(matrix)
    assert main(args) == 0
    cell = load_matrix(matrix).get_cell("vllm-0.33")
    assert (cell.status, cell.version, cell.torch) == ("experimental", "0.33.0", "2.14.0")
    assert reviewed_files(project) == ["vllm.diff"]
    report = json.loads((tmp_path / "r" / "report.json").read_text(encoding="utf-8"))
    assert report["l0_l1"] == ("not run: the proofs run on the trial build, which --no-build "
                               "leaves out")
    # Without a measurement the floor is the nearest cell's.
    assert cell.proof is not None and cell.proof.l1_min_passed == 533


def test_write_cell_after_the_proofs_appends_the_measured_floor_once(
        project: Project, tmp_path: Path, fake_proofs: FakeProofs) -> None:
    matrix = tmp_path / "matrix.toml"
    shutil.copyfile(project.matrix, matrix)
    args = project.args("upgrade-check", "vllm", "0.33.0", "--out", str(tmp_path / "r"),
                        "--write-cell")
    args[args.index("--matrix") + 1] = str(matrix)
    assert main(args) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text(encoding="utf-8"))
    assert report["build"].startswith("built ")  # the trial matrix holds the cell once
    cell = load_matrix(matrix).get_cell("vllm-0.33")
    assert cell.proof is not None and cell.proof.l1_min_passed == 7
    assert len(fake_proofs.calls) == 2


def test_a_failing_proof_is_a_line_of_the_report_and_keeps_the_placeholder_floor(
        project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeProofs(fail="L1")
    monkeypatch.setattr("forge.upgrade.trial.run_proof_command", fake)
    out = tmp_path / "r"
    # A proposed cell whose proofs fail has its own exit status: the scheduled job goes red.
    assert main(project.args("upgrade-check", "vllm", "0.33.0", "--out", str(out))) == 4
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert (report["outcome"], report["exit_status"]) == ("proof-failed", 4)
    assert report["l0_l1"] == (
        "L0 passed (12 passed, 1 skipped); L1 failed: tests/contract/test_vllm_core_contract.py"
        "::test_core_tests_pass_on_the_patched_tree[vllm-0.33]; see l0-l1.log")
    assert report["cell_proposed"] and len(report["seams"]) == len(
        default_registry().required_for("vllm", "0.33.0"))
    assert entry_floor(out) == 533
    assert {"L0", "L1"} <= set(report["timings"])

    monkeypatch.setattr("forge.upgrade.trial.run_proof_command",
                        FakeProofs(fail="L1", counts_on_failure=True, patched=5, stock=6))
    assert main(project.args("upgrade-check", "vllm", "0.33.0", "--out", str(out))) == 4
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["l0_l1"] == (
        "L0 passed (12 passed, 1 skipped); L1 failed: tests/contract/test_vllm_allocate_race.py"
        "::test_lost_page_race_leaves_the_request_as_before[vllm-0.33] (5/9 on the patched "
        "tree, 6 on the stock tree in the release's own tests); see l0-l1.log")
    assert entry_floor(out) == 533


def test_no_l1_runs_l0_only_and_says_so(project: Project, tmp_path: Path,
                                        fake_proofs: FakeProofs) -> None:
    out = tmp_path / "r"
    assert main(project.args("upgrade-check", "vllm", "0.33.0", "--out", str(out),
                             "--no-l1")) == 0
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert [call.argv[3] for call in fake_proofs.calls] == ["tests/cells"]
    assert report["l0_l1"] == "L0 passed (12 passed, 1 skipped); L1 not run (--no-l1)"
    assert "L1" not in report["timings"]
    assert entry_floor(out) == 533


def test_a_missing_anchor_is_a_row_and_no_cell_is_proposed(
        project: Project, tmp_path: Path) -> None:
    out = tmp_path / "report"
    # A release that cannot be proposed has its own exit status: the scheduled job goes red.
    assert main(project.args("upgrade-check", "vllm", "latest", "--out", str(out),
                             "--no-build")) == 3
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert (report["outcome"], report["exit_status"]) == ("not-proposable", 3)
    assert report["version"] == "0.34.0"  # latest final release; 0.35.0rc1 is not final
    assert report["sources"] == "wheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl " \
                                "(the release has no sdist)"
    rows = {row["seam"]: row for row in report["seams"]}
    assert rows["allocate-slots-race"]["chosen"] is None
    assert rows["allocate-slots-race"]["result"] == "no working variant"
    assert rows["block-pool"]["result"] == "same change"
    assert len(report["seams"]) == len(default_registry().required_for("vllm", "0.34.0"))
    assert not report["cell_proposed"]
    assert report["verdict"] == \
        "seams without exactly one working variant: allocate-slots-race"
    assert not (out / "matrix-entry.toml").exists()
    # The nearest cell's variant first, with exactly why it failed ...
    assert rows["allocate-slots-race"]["note"].startswith(
        "the nearest cell's vllm-allocate-slots-race: not found: ")
    # ... and where its code went: allocate_slots is allocate_blocks in this release.
    (guide,) = report["guides"]
    assert (guide["seam"], guide["nearest_variant"]) == \
        ("allocate-slots-race", "vllm-allocate-slots-race")
    assert "def allocate_slots(self, request, n):" in guide["anchor_code"]
    best = guide["candidates"][0]
    assert best["function"] == "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_blocks"
    assert best["path"] == "vllm/v1/core/kv_cache_manager.py"
    assert best["text"] == "def allocate_blocks(self, request, n):"
    assert guide["file_stats"] == ["vllm/v1/core/kv_cache_manager.py: +1 -1"]
    # The anchor's class, method by method: what was renamed is gone and new.
    assert guide["class_changes"][0].startswith(
        "`KVCacheManager` at vllm/v1/core/kv_cache_manager.py:")
    assert any(line.startswith("new `allocate_blocks` at vllm/v1/core/kv_cache_manager.py:")
               for line in guide["class_changes"])
    assert any(line.startswith("gone `allocate_slots`") for line in guide["class_changes"])
    summary = report["summary"]
    assert summary.startswith("**vllm 0.34.0: not-proposable** (nearest cell vllm-0.32")
    assert "`vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_blocks` at " \
           "vllm/v1/core/kv_cache_manager.py:" in summary
    report_md = (out / "report.md").read_text(encoding="utf-8")
    assert "## Where the failing seams' code went" in summary
    assert "## Where the failing seams' code went" in report_md
    assert "`vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_blocks` at " in report_md


def test_upgrade_scan_lists_final_releases_newer_than_the_newest_cell(
        project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(project.args("upgrade-scan")) == 0
    assert capsys.readouterr().out == (
        "vllm: newer than vllm-0.32 (0.32.0): 0.33.0, 0.34.0\n"
        "  to check: vllm 0.33.0: newer than the newest cell vllm-0.32\n"
        "  to check: vllm 0.34.0: newer than the newest cell vllm-0.32\n")
    assert main(project.args("upgrade-scan", "--json")) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"engine": "vllm", "newest_cell": "vllm-0.32", "newest_cell_version": "0.32.0",
         "newer": ["0.33.0", "0.34.0"], "unchecked": ["0.33.0", "0.34.0"],
         "why": {"0.33.0": "newer than the newest cell vllm-0.32",
                 "0.34.0": "newer than the newest cell vllm-0.32"},
         "skipped": {}}]


def test_upgrade_scan_checks_every_release_of_the_span_that_no_cell_or_skip_covers(
        project: Project, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not only releases newer than the newest cell: a series inside the span without a cell,
    and a newer release of a cell's series, need a check; a skipped series does not."""
    text = project.matrix.read_text(encoding="utf-8")
    cell = text[text.index("[[cell]]"):]
    newest = cell.replace('series = "0.32"', 'series = "0.34"').replace(
        'version = "0.32.0"', 'version = "0.34.0"').replace("vllm-0.32.0-", "vllm-0.34.0-")
    older = cell.replace('series = "0.32"', 'series = "0.31"').replace(
        'version = "0.32.0"', 'version = "0.31.0"').replace("vllm-0.32.0-", "vllm-0.31.0-")
    matrix = tmp_path / "matrix.toml"
    matrix.write_text(text[:text.index("[[cell]]")]
                      + '[engine.vllm]\nseries_parts = 2\nskipped = { "0.33" = "no reason '
                      'needed here but one is given" }\n\n' + older + "\n" + newest,
                      encoding="utf-8")
    args = project.args("upgrade-scan", "--json")
    args[args.index("--matrix") + 1] = str(matrix)
    assert main(args) == 0
    (line,) = json.loads(capsys.readouterr().out)
    # 0.32.0: its series has no cell and is not skipped; 0.33.0: skipped; 0.34.0: the cell.
    assert line["unchecked"] == ["0.32.0"]
    assert line["why"] == {"0.32.0": "series 0.32 is inside the span 0.31.0 - 0.34.0 and has "
                                     "no cell"}
    assert line["skipped"] == {"0.33": "no reason needed here but one is given"}
    matrix.write_text(matrix.read_text(encoding="utf-8").replace('"0.33" = "no reason needed '
                                                                 'here but one is given"',
                                                                 '"0.33" = ""'),
                      encoding="utf-8")
    assert main(args) == 1
    assert "field 'skipped': '0.33' must be a series of 2 version parts with a reason" in \
        capsys.readouterr().err


@pytest.mark.parametrize(("posargs", "problem"), [
    (["vllmm", "latest"], "unknown engine 'vllmm' (engines with cells: sglang, vllm)"),
    (["vllm", "0.x"], "'0.x' is not a version: nox -s upgrade-check -- vllm 0.34.0 (or latest)"),
    (["vllm"], "give the engine and the release first: nox -s upgrade-check -- vllm 0.34.0 (or "
               "latest)"),
    (["vllm", "latest", "--no-build"], None),
])
def test_the_upgrade_check_session_checks_its_arguments_before_installing(
        posargs: list[str], problem: str | None) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("project_noxfile",
                                                  Path(__file__).resolve().parents[2]
                                                  / "noxfile.py")
    assert spec is not None and spec.loader is not None
    noxfile = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():  # nox warns that the sessions are registered again
        warnings.simplefilter("ignore", FutureWarning)
        spec.loader.exec_module(noxfile)
    assert noxfile.upgrade_check_args_problem(posargs) == problem


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        return None  # the server's request log would mix into the CLI's stderr


@pytest.fixture
def lying_index(tmp_path: Path) -> Iterator[str]:
    """A static simple index on 127.0.0.1 whose sha256 for the 0.33.0 wheel is wrong."""
    root = tmp_path / "lying"
    wheel = fake_wheel("0.33.0", fake_vllm_sources(), root / "files")
    page = root / "simple" / "vllm"
    page.mkdir(parents=True)
    page.joinpath("index.html").write_text(
        f'<a href="/files/{wheel.name}#sha256={"0" * 64}">{wheel.name}</a>\n', encoding="utf-8")
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("case", ["no such version", "unknown engine", "index down",
                                  "hash differs"])
def test_bad_input_is_one_line_and_writes_nothing(
        case: str, project: Project, tmp_path: Path, lying_index: str,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default dist/ and reports/ would land here
    matrix_before = project.matrix.read_text(encoding="utf-8")
    engine, version, index = "vllm", "0.33.0", project.index_url
    if case == "no such version":
        version = "9.9.9"
    elif case == "unknown engine":
        engine = "tgi"
    elif case == "index down":
        index = f"http://127.0.0.1:{_free_port()}/simple"
    else:
        index = lying_index
    args = project.args("upgrade-check", engine, version)
    args[args.index("--index-url") + 1] = index
    args[args.index("--cache-dir") + 1] = str(tmp_path / "cache")

    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("forge: error: ")
    expected = {
        "no such version": f"vllm 9.9.9 does not exist on {index}; newest final release: "
                           "0.34.0",
        "unknown engine": "engine 'tgi' has no cell in matrix.toml (engines: vllm)",
        "index down": f"index {index} unreachable: [Errno 111] Connection refused",
        "hash differs": f"sha256 mismatch for vllm-0.33.0-{WHEEL_TAGS}.whl: expected "
                        f"{'0' * 64}, got ",
    }[case]
    assert expected in err
    assert project.matrix.read_text(encoding="utf-8") == matrix_before
    assert not (tmp_path / "reports").exists() and not (tmp_path / "dist").exists()
    assert not list((tmp_path / "cache").glob("artifacts/*.whl"))


def test_reviewed_diff_mismatch_names_the_file_that_differs_not_provenance(
        tmp_path: Path) -> None:
    from forge.matrix import Artifact, Cell

    def section(path: str, line: str) -> str:
        return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n"
                f"-old\n+{line}\n")

    cell = Cell(engine="vllm", series="0.32", version="0.32.0", build=1, python=">=3.10",
                torch="2.11.0", status="supported",
                artifacts=(Artifact(role="wheel", filename="vllm-0.32.0-py3-none-any.whl",
                                    sha256="0" * 64),))
    reviewed = tmp_path / "vllm.diff"
    reviewed.write_text(section("vllm/_kvcached_build.py", 'FP = "a"')
                        + section("vllm/v1/engine/core.py", "close()"), encoding="utf-8")
    both = section("vllm/_kvcached_build.py", 'FP = "b"') + section("vllm/v1/engine/core.py",
                                                                    "close(now=True)")
    with pytest.raises(DiffMismatchError, match=r"differs from vllm.diff at "
                                                r"vllm/v1/engine/core.py;"):
        check_reviewed_diff(cell, "vllm", both, reviewed)
    only_provenance = section("vllm/_kvcached_build.py", 'FP = "b"') + \
        section("vllm/v1/engine/core.py", "close()")
    with pytest.raises(DiffMismatchError, match=r"at vllm/_kvcached_build.py;"):
        check_reviewed_diff(cell, "vllm", only_provenance, reviewed)


def test_readme_upgrade_lines_name_a_session_and_arguments_the_cli_takes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import re
    import shlex

    import nox.registry

    from forge.cli import _parser

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    lines = [line.split("  #", 1)[0].strip()
             for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL)
             for line in block.splitlines() if line.startswith("nox -s upgrade")]
    assert lines == ["nox -s upgrade-scan", "nox -s upgrade-check -- vllm latest"]
    # An empty registry of its own: loading the noxfile again into nox's process-wide one
    # re-registers every session, one warning each.
    monkeypatch.setattr(nox.registry, "_REGISTRY", {})
    spec = importlib.util.spec_from_file_location("upgrade_noxfile", root / "noxfile.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    for line in lines:
        words = shlex.split(line)
        session, posargs = words[2], words[4:]
        assert session in nox.registry.get()
        parsed = _parser().parse_args([session, *posargs])
        assert parsed.command == session


def test_a_release_that_is_already_a_cell_is_reported_but_not_proposed(
        project: Project, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert main(project.args("upgrade-check", "vllm", "0.32.0", "--out", str(out))) == 0
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["outcome"] == "already-a-cell"
    assert all(row["result"] == "same change" for row in report["seams"]
               if row["seam"] != "provenance")
    assert not report["cell_proposed"]
    assert report["verdict"].endswith("vllm 0.32.0 is already cell vllm-0.32, so no cell is "
                                      "proposed")
    assert not (out / "matrix-entry.toml").exists() and not (out / "dist").exists()


def test_kvcached_use_check_accepts_every_fixture_and_catches_an_unused_import() -> None:
    from forge.upgrade.variants import _kvcached_use_check

    for folder in sorted(FIXTURES.iterdir()):
        after = (folder / "after.py").read_text(encoding="utf-8")
        assert _kvcached_use_check({"m.py": ("", after)}).startswith("ok: uses "), folder.name
    unused = "import kvcached_core.integration.vllm as _kvcached_vllm\n\ndef f():\n    return 1\n"
    assert _kvcached_use_check({"m.py": ("", unused)}) == \
        "fails: m.py imports kvcached_core but uses nothing from it"
    assert _kvcached_use_check({"m.py": ("", "x = 1\n")}) == "n/a: does not use kvcached"


def test_wheel_choice_prefers_the_nearest_cells_tags_then_its_python_and_skips_other_platforms(
        ) -> None:
    from packaging.version import Version

    from forge.fetch import IndexFile
    from forge.upgrade.release import _pick_wheel

    def files(*names: str) -> dict[str, IndexFile]:
        return {name: IndexFile(url=f"http://x/{name}", sha256="0" * 64) for name in names}

    arm = "sglang-0.6.0-cp311-cp311-manylinux_2_34_aarch64.whl"
    cp312 = "sglang-0.6.0-cp312-cp312-manylinux_2_34_x86_64.whl"
    cp311 = "sglang-0.6.0-cp311-cp311-manylinux_2_35_x86_64.whl"
    cell = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
    picked = _pick_wheel(files(arm, cp312, cp311), "sglang", Version("0.6.0"), cell)
    assert picked is not None and picked[0] == cp311
    pure = "sglang-0.6.0-py3-none-any.whl"
    picked = _pick_wheel(files(arm, pure), "sglang", Version("0.6.0"), cell)
    assert picked is not None and picked[0] == pure
    assert _pick_wheel(files(arm), "sglang", Version("0.6.0"), cell) is None
    # A pure nearest wheel names no CPython: the check's own Python decides (the sessions'),
    # not the lowest tag the release ships.
    running = f"cp{sys.version_info.major}{sys.version_info.minor}"
    builds = [f"sglang-0.6.0-cp{minor}-cp{minor}-manylinux_2_34_x86_64.whl"
              for minor in ("310", running.removeprefix("cp"), "313")]
    picked = _pick_wheel(files(*builds), "sglang", Version("0.6.0"),
                         "sglang-0.5.10-py3-none-any.whl")
    assert picked is not None and picked[0] == builds[1]


def test_two_working_variants_leave_the_seam_unresolved_naming_the_one_in_range() -> None:
    from forge.upgrade.check import _choose
    from forge.upgrade.variants import VariantResult

    def variant(id_: str, result: str, in_range: bool) -> VariantResult:
        return VariantResult(id=id_, kind="codemod", seams=("kv-budget",), registered_range="",
                             in_range=in_range, result=result, hits=1, expected="1", anchor="")

    old, new = variant("old", "applied", False), variant("new", "applied", True)
    row = _choose("kv-budget", [old, new])
    assert (row.chosen, row.result) == (None, "ambiguous")
    assert row.note == "2 variants work: old, new; the registry's range for this release holds new"
    row = _choose("kv-budget", [old, variant("new", "same change", True)])
    assert (row.chosen, row.result) == ("new", "same change")
    # The same change outside the registry's range does not win over a variant inside it.
    row = _choose("kv-budget", [variant("old", "same change", False), new])
    assert (row.chosen, row.result) == (None, "ambiguous")
    assert row.note.endswith("; the registry's range for this release holds new")
    row = _choose("kv-budget", [variant("old", "partial", False)])
    assert (row.chosen, row.result, row.note) == (None, "no working variant", "best: old partial")


def test_a_diff_variant_applies_with_zero_fuzz_or_is_reported_not_found(tmp_path: Path) -> None:
    from _fixtures import POOL_PY, TAKE_LOGGED, unified_diff, write_patch

    from codemods.base import BuildContext
    from forge.patches import read_patch
    from forge.registry import diff_transform
    from forge.upgrade.variants import try_variant

    patch = write_patch(tmp_path / "patches", "log-take",
                        unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED))
    transform = diff_transform(read_patch(patch), "fakeeng", "1.0")
    build = BuildContext(cell="fakeeng-2.0", engine="fakeeng", package="fakeeng",
                         upstream_version="2.0.0", built_version="2.0.0+kvcached.1",
                         base_artifact="fakeeng-2.0.0.tar.gz", base_sha256="0" * 64,
                         transform_ids=(), fingerprint="0" * 64, toolkit_version="0")
    sources = tmp_path / "sources"
    (sources / "fakeeng").mkdir(parents=True)
    (sources / "fakeeng" / "pool.py").write_text(POOL_PY, encoding="utf-8")
    applied = try_variant(transform, sources, build)
    assert (applied.result, applied.hits, applied.files, applied.compile_check) == \
        ("applied", 1, ("fakeeng/pool.py",), "ok")
    assert "+        print('take', count)\n" in applied.diff
    assert (sources / "fakeeng" / "pool.py").read_text(encoding="utf-8") == POOL_PY  # pristine

    (sources / "fakeeng" / "pool.py").write_text(POOL_PY.replace("take", "grab"),
                                                 encoding="utf-8")
    missing = try_variant(transform, sources, build)
    assert missing.result == "not found"
    assert missing.detail.startswith("does not apply with zero fuzz: ")


def test_a_proof_command_appends_its_output_to_the_log_and_reports_its_summary(
        tmp_path: Path) -> None:
    from forge.upgrade.trial import run_proof_command

    log = tmp_path / "l0-l1.log"
    log.write_text("earlier\n", encoding="utf-8")
    script = ("print('..F.'); print('FAILED tests/cells/test_x.py::test_y[vllm-0.33] - boom'); "
              "print('1 failed, 3 passed in 0.50s'); raise SystemExit(1)")
    progress: list[str] = []
    status, output = run_proof_command([sys.executable, "-c", script], {"PATH": "/usr/bin"},
                                       tmp_path, log, progress.append)
    assert status == 1
    assert output.splitlines()[-1] == "1 failed, 3 passed in 0.50s"
    assert progress == ["    FAILED tests/cells/test_x.py::test_y[vllm-0.33] - boom",
                        "    1 failed, 3 passed in 0.50s"]
    text = log.read_text(encoding="utf-8")
    assert text.startswith("earlier\n$ ") and text.endswith("[exit status 1]\n\n")


def test_a_release_is_named_by_its_engines_series_parts_whatever_cells_exist(
        tmp_path: Path) -> None:
    from forge.upgrade.check import _series_for

    sglang_cell = MATRIX.replace('engine = "vllm"', 'engine = "sglang"').replace(
        'series = "0.32"\nversion = "0.32.0"', 'series = "0.5.23"\nversion = "0.5.23"')
    text = sglang_cell.replace('index_url = "https://pypi.org/simple"\n',
                               'index_url = "https://pypi.org/simple"\n\n'
                               '[engine.sglang]\nseries_parts = 3\n')
    path = tmp_path / "matrix.toml"
    path.write_text(text.format(wheel="sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
                                sha256="0" * 64), encoding="utf-8")
    matrix = load_matrix(path)
    # Before and after the existing cell alike: the release's own three parts.
    assert _series_for(matrix, "sglang", "0.5.22") == "0.5.22"
    assert _series_for(matrix, "sglang", "0.5.24") == "0.5.24"
    assert _series_for(matrix, "sglang", "0.4.10.post2") == "0.4.10"
    # vLLM declares no table here: major.minor, never the full version.
    assert _series_for(matrix, "vllm", "0.32.1") == "0.32"
