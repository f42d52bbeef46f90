"""L0 sources, every selected cell on every run (seconds each): the cell's transform set applied
to its pinned package sources changes each required seam's target, every changed module
compiles and calls into kvcached_core where its transform's anchor says, and the whole change is
the cell's reviewed diff (but for the provenance module, which names the artifact it was built
from).
"""

from __future__ import annotations

import os
import py_compile
from collections.abc import Iterator
from pathlib import Path

import pytest

from forge.matrix import Cell
from tests.cells.conftest import selected_cells

from .sources import (
    PROVENANCE_MODULE,
    PatchedSources,
    SourcesInAdvance,
    anchor_scope,
    calls_in_scope,
    core_calls,
    diff_sections,
    is_provenance,
    patch_sources,
    reviewed_diff,
)

# Seconds per cell: runs for every selected cell whatever --heavy says.
CHEAP_PROOF = True


# Processes that prepare the cells' sources ahead of their checks; one cell is done inline.
ADVANCE_WORKERS = max(1, min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def sources_in_advance(request: pytest.FixtureRequest,
                       tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[SourcesInAdvance | None]:
    # The cells of this module's collected tests (a -k or a node id narrows them).
    wanted = {item.callspec.params["cell"].name for item in request.session.items
              if item.module is not None and item.module.__name__ == __name__
              and hasattr(item, "callspec") and "cell" in item.callspec.params}
    cells = [cell for cell in selected_cells(request.config) if cell.name in wanted]
    if len(cells) < 2 or ADVANCE_WORKERS < 2:
        yield None
        return
    advance = SourcesInAdvance(cells, tmp_path_factory.mktemp("sources"), ADVANCE_WORKERS)
    try:
        yield advance
    finally:
        advance.close()


@pytest.fixture(scope="session")
def sources(cell: Cell, tmp_path_factory: pytest.TempPathFactory,
            sources_in_advance: SourcesInAdvance | None) -> PatchedSources:
    if sources_in_advance is not None:
        return sources_in_advance.get(cell)
    return patch_sources(cell, tmp_path_factory.mktemp(f"sources-{cell.name}"))


def test_each_required_seam_is_covered_by_a_transform_that_changed_its_targets(
        sources: PatchedSources) -> None:
    package = sources.package
    required = sources.registry.required_for(sources.cell.engine, sources.cell.version)
    covered = {seam: t for t in sources.transforms for seam in t.seams}
    assert sorted(covered) == sorted(required), sources.origin
    for seam in required:
        transform = covered[seam]
        changed = sources.changed_by[transform.id]
        assert changed, f"{sources.cell.name}: {transform.id} ({seam}) changed nothing"
        strays = set(changed) - set(transform.target_paths(package))
        assert not strays, f"{transform.id} changed files it does not declare: {sorted(strays)}"


def test_every_changed_module_compiles(sources: PatchedSources, tmp_path: Path) -> None:
    modules = [path for path in sources.patched if path.endswith(".py")]
    assert modules
    for path in modules:
        source = tmp_path / path
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(sources.patched[path], encoding="utf-8")
        py_compile.compile(str(source), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_each_transform_calls_into_kvcached_core_at_its_anchor(
        sources: PatchedSources) -> None:
    package = sources.package
    for transform in sources.transforms:
        changed = sources.changed_by[transform.id]
        if is_provenance(transform):
            text = sources.patched[f"{package}/{PROVENANCE_MODULE}"]
            assert "def describe(" in text and sources.cell.name in text
            continue
        places = {path: anchor_scope(transform, package, path) for path in changed}
        # The anchor names a place in one of the files it changed (or, for a diff without a
        # qualified anchor, the whole file).
        scoped = {path: scope for path, scope in places.items() if scope is not None}
        if not scoped and transform.kind == "diff":
            scoped = {path: () for path in changed}
        assert scoped, f"{transform.id}: its anchor {transform.anchor!r} names no place in " \
                       f"the files it changed: {list(changed)}"
        for path, scope in scoped.items():
            before = calls_in_scope(core_calls(sources.stock[path], path), scope)
            after = calls_in_scope(core_calls(sources.patched[path], path), scope)
            where = ".".join(scope) or path
            assert after > before, (f"{sources.cell.name}: {transform.id}: {path}: {where} "
                                    f"calls into kvcached_core {after} time(s), "
                                    f"{before} before the transforms")


def test_the_change_is_the_reviewed_diff_but_for_the_provenance_module(
        sources: PatchedSources) -> None:
    reviewed = reviewed_diff(sources)
    assert reviewed.is_file(), f"no reviewed diff {reviewed}: run forge approve-diff"
    provenance = f"{sources.package}/{PROVENANCE_MODULE}"
    ours = diff_sections(sources.diff)
    approved = diff_sections(reviewed.read_text(encoding="utf-8"))
    assert provenance in ours and provenance in approved
    del ours[provenance], approved[provenance]
    assert sorted(ours) == sorted(approved), sources.origin
    for path in sorted(ours):
        assert ours[path] == approved[path], (
            f"{sources.cell.name}: {path} changes differently from {reviewed} "
            f"(sources: {sources.origin})")
