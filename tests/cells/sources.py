"""L0 sources: a cell's transform set applied to its pinned package sources, without a build.

vLLM cells take the sources from their pinned sdist (a few MB); a cell without an sdist (SGLang,
a vLLM release PyPI has no sdist of) takes them from its pinned wheel through the same cached
workspace the build uses. Each transform is applied and committed on its own, so what each one
changed is known; the stock and patched text of every changed file is kept for the checks.
"""

from __future__ import annotations

import ast
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from codemods.base import BuildContext
from forge import TOOLKIT_VERSION
from forge.build import reviewed_diff_path
from forge.fetch import default_cache_dir, fetch_artifact, resolve_index_url
from forge.matrix import Artifact, Cell, load_matrix
from forge.registry import Kind, Registry, Transform
from forge.transforms import patch_set_fingerprint, run_transforms, select_transforms
from forge.workspace import (
    SOURCE_SUFFIXES,
    VENDOR_BRANCH,
    Workspace,
    directory_workspace,
    wheel_workspace,
)
from tests.proof_cells import proof_matrix_path, proof_registry

CORE_PACKAGE = "kvcached_core"
PROVENANCE_MODULE = "_kvcached_build.py"
EVERY_MEMBER = "*"


@dataclass(frozen=True)
class PatchedSources:
    """What the cell's transforms did to its package sources."""

    cell: Cell
    origin: str                              # the pinned artifact the sources came from
    transforms: tuple[Transform, ...]
    changed_by: dict[str, tuple[str, ...]]   # transform id -> files its own commit changed
    stock: dict[str, str]                    # changed file -> text before ("" if new)
    patched: dict[str, str]                  # changed file -> text after
    diff: str                                # vendor..kvcached, as the build writes it
    registry: Registry

    @property
    def package(self) -> str:
        return self.cell.engine


class SourcesInAdvance:
    """L0 sources of every selected cell, prepared by a pool of processes while the checks of
    the cells already done run: each cell is seconds to a minute of codemods on one core, and
    a CI machine has more than one. `get` waits for its cell only. The workers are fresh
    interpreters (spawn): forking a pytest process that may hold threads is not safe."""

    def __init__(self, cells: list[Cell], where: Path, workers: int) -> None:
        import concurrent.futures
        import multiprocessing

        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        self._futures = {cell.name: self._pool.submit(_patch_sources_remote, cell,
                                                      where / f"sources-{cell.name}")
                         for cell in cells}

    def get(self, cell: Cell) -> PatchedSources:
        found = self._futures[cell.name].result()
        return PatchedSources(**found, registry=proof_registry())

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def _patch_sources_remote(cell: Cell, where: Path) -> dict[str, object]:
    """patch_sources in a worker process: everything but the registry, which the caller has."""
    where.mkdir(parents=True, exist_ok=True)
    done = patch_sources(cell, where)
    return {name: getattr(done, name) for name in
            ("cell", "origin", "transforms", "changed_by", "stock", "patched", "diff")}


def patch_sources(cell: Cell, where: Path) -> PatchedSources:
    """Apply the cell's transform set to its pinned sources, unpacked under `where`."""
    registry = proof_registry()
    transforms = select_transforms(registry, cell)
    matrix = load_matrix(proof_matrix_path())
    index_url = resolve_index_url(matrix)
    sdist = cell.artifact("sdist")
    artifact = sdist if sdist is not None else cell.wheel_artifacts[0]
    assert artifact.filename and artifact.sha256
    archive = fetch_artifact(artifact, index_url=index_url, cache_dir=default_cache_dir())
    build = BuildContext(
        cell=cell.name, engine=cell.engine, package=cell.engine, upstream_version=cell.version,
        built_version=f"{cell.version}+kvcached.{cell.build}", base_artifact=artifact.filename,
        base_sha256=artifact.sha256, transform_ids=tuple(t.id for t in transforms),
        fingerprint=patch_set_fingerprint(transforms, TOOLKIT_VERSION),
        toolkit_version=TOOLKIT_VERSION,
    )
    targets = {path for t in transforms for path in t.target_paths(cell.engine)}
    if sdist is not None:
        tree = where / "tree"
        _unpack_package(archive, cell.engine, targets, tree)
        return _apply(cell, f"sdist {artifact.filename}", directory_workspace(tree, str(
            artifact.filename)), transforms, build, registry)
    with wheel_workspace(archive, artifact.sha256, default_cache_dir(),
                         extra_members=targets) as workspace:
        return _apply(cell, f"wheel {artifact.filename}", workspace, transforms, build,
                      registry)


def _unpack_package(archive: Path, package: str, targets: set[str], tree: Path) -> None:
    """The sdist's `<package>/` source files (those a wheel workspace would hold) into `tree`."""
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = member.name.split("/")
            relative = "/".join(parts[1:])
            if (not member.isfile() or parts[1:2] != [package]
                    or not (relative.endswith(SOURCE_SUFFIXES) or relative in targets)):
                continue
            data = tar.extractfile(member)
            assert data is not None
            out = tree / relative
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data.read())


def _apply(cell: Cell, origin: str, workspace: Workspace, transforms: list[Transform],
           build: BuildContext, registry: Registry) -> PatchedSources:
    changed_by: dict[str, tuple[str, ...]] = {}
    for transform in transforms:
        before = workspace.head_commit
        run_transforms(workspace, [transform], build, flavour=cell.engine)
        names = workspace.repo.git.diff("--name-only", "--no-renames", before, "HEAD")
        changed_by[transform.id] = tuple(sorted(n for n in names.splitlines() if n))
    changed = workspace.changed_files()
    stock = {path: _read_at(workspace, VENDOR_BRANCH, path) for path in changed}
    patched = {path: workspace.read_bytes(path).decode("utf-8") for path in changed}
    return PatchedSources(cell=cell, origin=origin, transforms=tuple(transforms),
                          changed_by=changed_by, stock=stock, patched=patched,
                          diff=workspace.diff(), registry=registry)


def _read_at(workspace: Workspace, revision: str, path: str) -> str:
    listed = workspace.repo.git.ls_tree("--name-only", revision, "--", path)
    return workspace.repo.git.show(f"{revision}:{path}") if listed.strip() else ""


def reviewed_diff(sources: PatchedSources) -> Path:
    """The reviewed diff of the cell's main wheel (the one its users install on a GPU)."""
    wheel: Artifact = sources.cell.wheel_artifacts[0]
    return reviewed_diff_path(sources.registry, sources.cell, wheel.distribution)


def diff_sections(diff: str) -> dict[str, str]:
    """file -> its part of a `git diff` (from its `diff --git` line to the next)."""
    sections: dict[str, str] = {}
    for chunk in re.split(r"(?m)^(?=diff --git )", diff):
        match = re.match(r"diff --git a/(\S+) b/", chunk)
        if match:
            sections[match.group(1)] = chunk.rstrip("\n")
    return sections


# --- where a transform says it calls into kvcached_core ---------------------------------------


def anchor_scope(transform: Transform, package: str, path: str) -> tuple[str, ...] | None:
    """The qualified name inside module `path` the transform's anchor names (`Class.method`,
    `function`), or None when the anchor names no place in that module."""
    match = re.match(r"[A-Za-z_][\w.]*", transform.anchor.replace("{package}", package))
    if not match:
        return None
    module = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    name = match.group(0)
    if not name.startswith(module + "."):
        return None
    return tuple(name[len(module) + 1:].split("."))


def core_calls(source: str, filename: str) -> list[tuple[str, ...]]:
    """Where `source` calls into kvcached_core: the qualified scope (`Class.method`) of each
    call, decorator or class base that goes through a name bound by an import of kvcached_core.

    A decorator counts for the function or class it decorates; a base class from kvcached_core
    counts for every member of the class it defines (`(Class, EVERY_MEMBER)`).
    """
    tree = ast.parse(source, filename=filename)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == CORE_PACKAGE:
                    bound.add(alias.asname or CORE_PACKAGE)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] == CORE_PACKAGE:
            bound.update(alias.asname or alias.name for alias in node.names)
    found: list[tuple[str, ...]] = []

    def uses_core(expression: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in bound for n in ast.walk(expression))

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = (*scope, node.name)
            found.extend(inner for edge in node.decorator_list if uses_core(edge))
            if isinstance(node, ast.ClassDef):
                # A base class from the runtime (a mixin) takes over the class's methods.
                found.extend((*inner, EVERY_MEMBER) for base in node.bases if uses_core(base))
            for statement in node.body:
                visit(statement, inner)
            return
        if isinstance(node, ast.Call) and uses_core(node.func):
            found.append(scope)
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, ())
    # A module-level rebinding (`Allocator = ElasticAllocator`, under a switch or not) makes
    # the anchor's name the class that calls into kvcached_core.
    for statement in ast.walk(tree):
        if (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Name)
                and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name)
                and _at_module_level(tree, statement)):
            rebound, original = statement.targets[0].id, statement.value.id
            found.extend((rebound, *call[1:]) for call in list(found)
                         if call[:1] == (original,))
    return found


def _at_module_level(tree: ast.Module, target: ast.stmt) -> bool:
    """Whether `target` runs at import time: in the module body or an `if`/`try` there."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if node is target:
            return True
        if isinstance(node, (ast.If, ast.Try)):
            pending += [*node.body, *node.orelse]
            if isinstance(node, ast.Try):
                pending += [*node.finalbody, *(s for h in node.handlers for s in h.body)]
    return False


def calls_in_scope(calls: list[tuple[str, ...]], scope: tuple[str, ...]) -> int:
    """How many of `calls` are inside `scope` (or take over every member of a class it is in)."""
    return sum(call[:len(scope)] == scope
               or (call[-1:] == (EVERY_MEMBER,) and scope[:len(call) - 1] == call[:-1])
               for call in calls)


def is_provenance(transform: Transform) -> bool:
    return transform.kind is Kind.CODEMOD and "provenance" in transform.seams
