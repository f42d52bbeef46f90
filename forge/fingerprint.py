"""The patch-set fingerprint: what a cell's transforms are made of, as one sha256.

A codemod's source is its module together with every ``codemods`` module that module imports,
transitively (shared helpers shape the output too); a diff's source is its patch file. The
fingerprint covers the toolkit version and, in order, each transform's id, kind and source, so
editing any transform of a cell changes the provenance it writes and its reviewed diff.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
from collections.abc import Sequence
from pathlib import Path

import codemods
from forge.errors import TransformError
from forge.registry import Transform

CODEMODS_ROOT = Path(codemods.__file__).resolve().parent


def patch_set_fingerprint(transforms: Sequence[Transform], toolkit_version: str) -> str:
    """sha256 over the toolkit version and, in order, each transform's id, kind and source."""
    digest = hashlib.sha256(f"kvcached-forge {toolkit_version}\n".encode())
    for transform in transforms:
        source = hashlib.sha256(transform_source(transform)).hexdigest()
        digest.update(f"{transform.id}\n{transform.kind}\n{source}\n".encode())
    return digest.hexdigest()


def transform_source(transform: Transform) -> bytes:
    """The text a transform is made of: its patch file, or its codemod module and the
    ``codemods`` modules it imports, each preceded by its path."""
    if transform.patch is not None:
        return transform.patch.path.read_bytes()
    if transform.codemod is None:
        raise TransformError(f"transform {transform.id} has neither a codemod nor a patch")
    source_file = inspect.getsourcefile(transform.codemod)
    if source_file is None:
        raise TransformError(f"transform {transform.id}: source of {transform.codemod!r} "
                             "not found")
    files = codemod_sources(Path(source_file).resolve())
    return b"".join(f"{_label(path)}\n".encode() + path.read_bytes() for path in files)


def codemod_sources(module: Path) -> list[Path]:
    """`module` and the `codemods` modules it imports, transitively, in a stable order."""
    seen: set[Path] = set()
    pending = [module]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        package = (path.parent.relative_to(CODEMODS_ROOT.parent).parts
                   if path.is_relative_to(CODEMODS_ROOT) else ())
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (package or not node.level):
                base = package[:len(package) - node.level + 1] if node.level else ()
                module_name = ".".join((*base, *(node.module or "").split("."))).strip(".")
                names = [module_name] + [f"{module_name}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] != CODEMODS_ROOT.name:
                    continue
                candidate = CODEMODS_ROOT.parent.joinpath(*parts)
                for found in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                    if found.is_file():
                        pending.append(found)
    return sorted(seen)


def _label(path: Path) -> str:
    return (str(path.relative_to(CODEMODS_ROOT.parent))
            if path.is_relative_to(CODEMODS_ROOT.parent) else path.name)
