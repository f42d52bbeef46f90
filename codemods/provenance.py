"""Write ``<engine package>/_kvcached_build.py``: which patched build this engine is.

The module holds the cell, engine, upstream and built versions, the base artifact and its
sha256, the ordered transform ids and the patch-set fingerprint, plus ``describe() -> dict``,
so a running engine can report exactly which build it runs. It creates one new file; on a tree
that already has it (recognised by its marker) it does nothing.
"""

from __future__ import annotations

import json

import libcst as cst
import libcst.matchers as m

from codemods.base import BuildContext, HitCountingCodemod

MODULE_NAME = "_kvcached_build"
MARKER = "KVCACHED_BUILD_PROVENANCE = 1"


def provenance_source(build: BuildContext) -> str:
    """The exact text of the provenance module for ``build``."""

    def literal(value: str) -> str:
        return json.dumps(value)

    ids = "".join(f"\n    {literal(i)}," for i in build.transform_ids)
    return f'''"""Which kvcached-patched {build.engine} build this is (written at build time)."""

from __future__ import annotations

{MARKER}

CELL = {literal(build.cell)}
ENGINE = {literal(build.engine)}
UPSTREAM_VERSION = {literal(build.upstream_version)}
BUILT_VERSION = {literal(build.built_version)}
BASE_ARTIFACT = {literal(build.base_artifact)}
BASE_SHA256 = {literal(build.base_sha256)}
TRANSFORMS: tuple[str, ...] = ({ids}
)
PATCH_SET_FINGERPRINT = {literal(build.fingerprint)}
TOOLKIT_VERSION = {literal(build.toolkit_version)}


def describe() -> dict[str, object]:
    """Which patched build this is, as plain JSON-able data."""
    return {{
        "cell": CELL,
        "engine": ENGINE,
        "upstream_version": UPSTREAM_VERSION,
        "built_version": BUILT_VERSION,
        "base_artifact": BASE_ARTIFACT,
        "base_sha256": BASE_SHA256,
        "transforms": list(TRANSFORMS),
        "patch_set_fingerprint": PATCH_SET_FINGERPRINT,
        "toolkit_version": TOOLKIT_VERSION,
    }}
'''


_MARKER_STATEMENT = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Name("KVCACHED_BUILD_PROVENANCE"))])]
)


class WriteProvenanceModule(HitCountingCodemod):
    DESCRIPTION = "Write <engine>/_kvcached_build.py with the build's provenance and describe()."
    creates_file = True

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if any(m.matches(statement, _MARKER_STATEMENT) for statement in updated_node.body):
            self.record_already_applied()
            return updated_node
        if updated_node.body:
            # Upstream has a file of that name: not ours to overwrite; zero hits fails the build.
            return updated_node
        self.record_hit()
        return cst.parse_module(provenance_source(self.build))
