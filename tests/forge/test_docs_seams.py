"""docs/seams.md is where a reader finds, for any cell, what implements each seam: it must say
exactly what the registry says (every transform with its seams and range, every file it names
present), so the page cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from codemods.declare import ANY_ENGINE
from forge.registry import Registry, default_registry

ROOT = Path(__file__).resolve().parents[2]
SEAMS_DOC = ROOT / "docs" / "seams.md"
ADAPTERS = {"vllm": ROOT / "kvcached_core/integration/vllm",
            "sglang": ROOT / "kvcached_core/integration/sglang"}


def _doc_rows(engine: str) -> list[list[str]]:
    text = SEAMS_DOC.read_text(encoding="utf-8")
    match = re.search(rf"<!-- seams:{engine} -->\n(.*?)<!-- /seams:{engine} -->", text, re.S)
    assert match, f"docs/seams.md has no table for {engine}"
    lines = [line for line in match.group(1).splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def _registered(registry: Registry, engine: str) -> dict[str, tuple[frozenset[str], str]]:
    """transform id -> (its seams, its version range as written in the docs)."""
    return {
        t.id: (frozenset(t.seams), str(t.versions) or "all")
        for t in registry.codemods
        if t.engine in (engine, ANY_ENGINE)
    }


@pytest.mark.parametrize("engine", sorted(ADAPTERS))
def test_seams_page_lists_every_registered_transform_with_its_seams_and_range(
        engine: str) -> None:
    documented: dict[str, tuple[frozenset[str], str]] = {}
    for seams, transform, versions, _codemod, _adapter in _doc_rows(engine):
        transform_id = transform.strip("`")
        documented[transform_id] = (
            frozenset(s.strip() for s in seams.split(",")),
            ",".join(sorted(v.strip() for v in versions.split(","))) if versions != "all"
            else "all",
        )
    registered = {
        tid: (seams, ",".join(sorted(versions.split(","))) if versions != "all" else "all")
        for tid, (seams, versions) in _registered(default_registry(), engine).items()
    }
    assert documented == registered


@pytest.mark.parametrize("engine", sorted(ADAPTERS))
def test_seams_page_names_files_that_exist(engine: str) -> None:
    for _seams, _transform, _versions, codemod, adapter in _doc_rows(engine):
        assert (ROOT / codemod.strip("`")).is_file(), codemod
        named = re.match(r"`([a-z_]+\.py)`", adapter)
        if named:
            assert (ADAPTERS[engine] / named.group(1)).is_file(), adapter


@pytest.mark.parametrize("engine", sorted(ADAPTERS))
def test_every_required_seam_is_on_the_seams_page(engine: str) -> None:
    documented = {s.strip() for row in _doc_rows(engine) for s in row[0].split(",")}
    required = {seam.seam for seam in default_registry().required_seams
                if seam.engine in (engine, ANY_ENGINE)}
    assert required <= documented
