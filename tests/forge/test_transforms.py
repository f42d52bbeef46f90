"""The transform runner fails closed, reports offsets, and is idempotent; the registry's rules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _fixtures import (
    ENGINE,
    POOL_PY,
    TAKE_LOGGED,
    make_registry,
    patch_header,
    route_allocate,
    sha256,
    unified_diff,
    wheel_bytes,
    wheel_name,
    write_patch,
)

from codemods.base import BuildContext
from forge.errors import TransformError
from forge.registry import Kind, Registry
from forge.report import ALREADY_APPLIED, APPLIED
from forge.transforms import patch_set_fingerprint, run_transforms
from forge.workspace import VENDOR_BRANCH, Workspace, wheel_workspace


def build_context(transform_ids: tuple[str, ...] = ()) -> BuildContext:
    return BuildContext(
        cell="fakeeng-1.0", engine=ENGINE, package=ENGINE, upstream_version="1.0.0",
        built_version="1.0.0+kvcached.1", base_artifact=wheel_name(), base_sha256="ab" * 32,
        transform_ids=transform_ids, fingerprint="cd" * 32, toolkit_version="0.1.0",
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[Workspace]:
    data = wheel_bytes()
    wheel = tmp_path / wheel_name()
    wheel.write_bytes(data)
    with wheel_workspace(wheel, sha256(data), tmp_path / "cache") as ws:
        yield ws


def cell_set(registry: Registry) -> list:
    return registry.transforms_for(ENGINE, "1.0", "1.0.0")


def commits_on_top(ws: Workspace) -> list[str]:
    return ws.repo.git.log("--format=%s", f"{VENDOR_BRANCH}..HEAD").splitlines()


def test_codemods_then_diffs_one_commit_each(workspace: Workspace, tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    write_patch(patches, "log-take",
                unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED).replace(
                    "allocate(count)\n", "kvcached_hook.allocate(count)\n"))
    transforms = cell_set(make_registry(patches))
    assert [t.id for t in transforms] == ["provenance", "route-allocate", "log-take"]
    outcomes = run_transforms(workspace, transforms, build_context(), flavour="fakeeng")
    assert [(o.transform.id, o.hits, o.result) for o in outcomes] == [
        ("provenance", 1, APPLIED), ("route-allocate", 2, APPLIED), ("log-take", 1, APPLIED),
    ]
    assert [s.split(":")[0] for s in reversed(commits_on_top(workspace))] == \
        ["provenance", "route-allocate", "log-take"]
    pool = (workspace.root / "fakeeng/pool.py").read_text()
    assert pool.count("kvcached_hook.allocate(") == 2 and "print('take', count)" in pool
    assert workspace.changed_files() == ["fakeeng/_kvcached_build.py", "fakeeng/pool.py"]


def test_second_run_is_a_clean_no_op(workspace: Workspace, tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    write_patch(patches, "log-take", unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED)
                .replace("allocate(count)\n", "kvcached_hook.allocate(count)\n"))
    transforms = cell_set(make_registry(patches))
    run_transforms(workspace, transforms, build_context(), flavour="fakeeng")
    head, diff = workspace.head_commit, workspace.diff()
    again = run_transforms(workspace, transforms, build_context(), flavour="fakeeng")
    assert [o.result for o in again] == [ALREADY_APPLIED] * 3
    assert workspace.head_commit == head and workspace.diff() == diff


def test_zero_hits_stops_the_build(workspace: Workspace, tmp_path: Path) -> None:
    registry = make_registry(tmp_path, route_allocate(targets=("{package}/engine.py",)))
    with pytest.raises(TransformError) as caught:
        run_transforms(workspace, cell_set(registry), build_context(), flavour="fakeeng")
    assert str(caught.value) == ("cell fakeeng-1.0: seam pool-allocate: transform route-allocate: "
                       "fakeeng/engine.py: "
                                 "matches nothing (expected 2 hit(s)); "
                                 "anchor looked for: fakeeng.pool.allocate")


def test_too_many_hits_stops_the_build(workspace: Workspace, tmp_path: Path) -> None:
    registry = make_registry(tmp_path, route_allocate(expected_hits=1))
    with pytest.raises(TransformError) as caught:
        run_transforms(workspace, cell_set(registry), build_context(), flavour="fakeeng")
    assert str(caught.value) == ("cell fakeeng-1.0: seam pool-allocate: transform route-allocate: "
                       "fakeeng/pool.py: "
                                 "matched 2 place(s), expected 1; "
                                 "anchor looked for: fakeeng.pool.allocate")


def test_hit_range_accepts_counts_inside_it(workspace: Workspace, tmp_path: Path) -> None:
    registry = make_registry(tmp_path, route_allocate(expected_hits="1..3"))
    outcomes = run_transforms(workspace, cell_set(registry), build_context(), flavour="fakeeng")
    assert outcomes[-1].hits == 2


def test_missing_target_file(workspace: Workspace, tmp_path: Path) -> None:
    registry = make_registry(tmp_path, route_allocate(targets=("{package}/absent.py",)))
    with pytest.raises(TransformError, match="fakeeng/absent.py: target file does not exist"):
        run_transforms(workspace, cell_set(registry), build_context(), flavour="fakeeng")


def test_provenance_does_not_overwrite_an_upstream_file(workspace: Workspace,
                                                        tmp_path: Path) -> None:
    (workspace.root / "fakeeng/_kvcached_build.py").write_text("UPSTREAM = 1\n")
    workspace.commit_all("upstream has a file of that name")
    with pytest.raises(TransformError, match="transform provenance: .* matches nothing"):
        run_transforms(workspace, cell_set(make_registry(tmp_path)), build_context(),
                       flavour="fakeeng")


def test_diff_offsets_are_reported(workspace: Workspace, tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    write_patch(patches, "log-take", unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED))
    # Upstream moved the code down by three lines since the diff was made.
    (workspace.root / "fakeeng/pool.py").write_text("import os\nimport sys\n\n" + POOL_PY)
    workspace.commit_all("upstream drift")
    diff = Registry(codemods=[], patches_root=patches).diffs(ENGINE, "1.0")
    outcome, = run_transforms(workspace, diff, build_context(), flavour="fakeeng")
    assert outcome.result == APPLIED
    assert outcome.offsets == ("fakeeng/pool.py hunk 1 at 13 (+3)",)
    assert outcome.rows[0].offsets == ("hunk 1 at 13 (+3)",)


def test_diff_needing_fuzz_is_refused(workspace: Workspace, tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    write_patch(patches, "log-take", unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED))
    # A context line of the hunk changed upstream: GNU patch would apply with fuzz.
    drifted = POOL_PY.replace("    def take(self, count):", "    def take(self, count):  # n")
    (workspace.root / "fakeeng/pool.py").write_text(drifted)
    workspace.commit_all("upstream drift")
    head = workspace.head_commit
    diff = Registry(codemods=[], patches_root=patches).diffs(ENGINE, "1.0")
    with pytest.raises(TransformError) as caught:
        run_transforms(workspace, diff, build_context(), flavour="fakeeng")
    assert str(caught.value).startswith(
        "cell fakeeng-1.0: seam take-logging: transform log-take: fakeeng/pool.py:")
    assert "does not apply with zero fuzz" in str(caught.value)
    assert workspace.head_commit == head
    assert (workspace.root / "fakeeng/pool.py").read_text() == drifted


def test_diff_yielding_broken_code_is_refused(workspace: Workspace, tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    broken = POOL_PY.replace("        return allocate(count)\n", "        return allocate(count\n")
    write_patch(patches, "break-it", unified_diff("fakeeng/pool.py", POOL_PY, broken))
    diff = Registry(codemods=[], patches_root=patches).diffs(ENGINE, "1.0")
    with pytest.raises(TransformError, match=r"transform break-it: fakeeng/pool.py:\d+: "
                                             r"rewritten code does not compile"):
        run_transforms(workspace, diff, build_context(), flavour="fakeeng")


def test_diff_order_and_version_range_come_from_series_and_header(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    body = unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED)
    write_patch(patches, "zz-first", body)
    write_patch(patches, "aa-second", body)
    write_patch(patches, "only-old", body, header=patch_header(**{"Applies-To": "<1.0"}))
    registry = Registry(codemods=[], patches_root=patches)
    assert [t.id for t in registry.transforms_for(ENGINE, "1.0", "1.0.0")] == \
        ["zz-first", "aa-second"]
    first = registry.diffs(ENGINE, "1.0")[0]
    assert first.kind is Kind.DIFF and first.anchor == "fakeeng/pool.py @@ class Pool"
    assert first.targets == ("fakeeng/pool.py",) and str(first.expected_hits) == "1"


def test_patch_header_fields_are_required(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    write_patch(patches, "no-why", unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED),
                header=patch_header(Why="", **{"Retire-When": ""}))
    problems = Registry(codemods=[], patches_root=patches).lint()
    assert len(problems) == 1
    assert problems[0].endswith("no-why.patch: header lacks Why, Retire-When")


def test_patch_header_must_name_its_seam(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    write_patch(patches, "no-seam", unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED),
                header=patch_header(Seam=""))
    problems = Registry(codemods=[], patches_root=patches).lint()
    assert len(problems) == 1
    assert problems[0].endswith("no-seam.patch: header lacks Seam")


def test_a_diff_implements_the_seam_its_header_names(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    write_patch(patches, "log-take", unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED))
    (diff,) = Registry(codemods=[], patches_root=patches).diffs(ENGINE, "1.0")
    assert diff.seams == ("take-logging",)
    assert diff.description == "Log every pool take"


def test_patch_hunk_count_must_match_expected_hits(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    write_patch(patches, "two-claimed", unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED),
                header=patch_header(**{"Expected-Hits": "2"}))
    with pytest.raises(TransformError, match="has 1 hunks, header Expected-Hits says 2"):
        Registry(codemods=[], patches_root=patches).diffs(ENGINE, "1.0")


def test_lint_flags_incomplete_codemod_registration(tmp_path: Path) -> None:
    incomplete = route_allocate()
    from dataclasses import replace

    registry = Registry(codemods=[replace(incomplete, why=" "), replace(incomplete)],
                        patches_root=tmp_path)
    assert registry.lint() == ["transform route-allocate: field 'why' is empty",
                               "transform route-allocate: id registered twice"]


def test_repository_registry_is_complete() -> None:
    from forge.registry import default_registry

    assert default_registry().lint() == []


def test_fingerprint_covers_ids_sources_and_toolkit(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    path = write_patch(patches, "log-take", unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED))
    transforms = cell_set(make_registry(patches))
    base = patch_set_fingerprint(transforms, "0.1.0")
    assert base == patch_set_fingerprint(transforms, "0.1.0")
    assert base != patch_set_fingerprint(transforms, "0.1.1")
    assert base != patch_set_fingerprint(list(reversed(transforms)), "0.1.0")
    path.write_text(path.read_text().replace("Last-Update: 2026-11-30", "Last-Update: 2026-12-01"))
    assert base != patch_set_fingerprint(cell_set(make_registry(patches)), "0.1.0")


def test_fingerprint_covers_the_helper_modules_a_codemod_imports() -> None:
    """A change in a shared helper changes the output, so it must change the fingerprint."""
    from forge.fingerprint import CODEMODS_ROOT, transform_source
    from forge.registry import default_registry

    registry = default_registry()
    block_pool = next(t for t in registry.codemods if t.id == "vllm-block-pool")
    source = transform_source(block_pool)
    assert (CODEMODS_ROOT / "vllm" / "_common.py").read_bytes() in source
    assert (CODEMODS_ROOT / "base.py").read_bytes() in source
    assert (CODEMODS_ROOT / "vllm" / "block_pool.py").read_bytes() in source
