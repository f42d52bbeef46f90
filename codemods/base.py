"""What every codemod shares: the build it runs for, and a count of the places it rewrote.

libcst reports a codemod that matched nothing as a success with unchanged code, so each codemod
counts its own hits (``record_hit``) and recognises its own output (``record_already_applied``);
the runner compares the counts with what the declaration (catalog.py) expects.
"""

from __future__ import annotations

from dataclasses import dataclass

from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand


@dataclass(frozen=True)
class BuildContext:
    """Facts about the build a codemod may write into the engine (provenance, labels)."""

    cell: str
    engine: str
    package: str
    upstream_version: str
    built_version: str
    base_artifact: str
    base_sha256: str
    transform_ids: tuple[str, ...]
    fingerprint: str
    toolkit_version: str


class HitCountingCodemod(VisitorBasedCodemodCommand):
    """A codemod that counts the places it rewrote and the places already rewritten."""

    #: What the transform does, one line (libcst's convention; `forge transforms` lists it).
    DESCRIPTION: str = ""
    #: A codemod that creates its target file is given an empty module when the file is absent.
    creates_file: bool = False

    def __init__(self, context: CodemodContext, build: BuildContext) -> None:
        super().__init__(context)
        self.build = build
        self.hits = 0
        self.already_applied = 0

    def record_hit(self) -> None:
        self.hits += 1

    def record_already_applied(self) -> None:
        self.already_applied += 1
