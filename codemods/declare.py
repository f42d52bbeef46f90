"""How a codemod and an engine's required seams are declared (plain data; see catalog.py).

A seam is one place where an engine must be changed for elastic KV memory to hold (its block
pool, its KV buffers, its shutdown, ...). Every codemod names the seam it implements; every
engine names the seams a build of it must cover, and from which versions on. The toolkit
resolves a cell's transform set against these and refuses a cell with a required seam
covered by no transform, or a seam covered by two.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from codemods.base import HitCountingCodemod

#: The engine of a codemod or a seam that every engine has (the provenance module).
ANY_ENGINE = "*"


@dataclass(frozen=True)
class CodemodDeclaration:
    """One codemod with everything a reviewer needs to judge it and the build to check it."""

    id: str
    engine: str                       # an engine name, or ANY_ENGINE
    versions: str                     # PEP 440 range of engine versions; "" is every version
    seam: str                         # the seam it implements
    anchor: str                       # the fully qualified place it rewrites
    targets: tuple[str, ...]          # paths in the wheel; "{package}" is the engine package
    expected_hits: str | int          # N, or MIN..MAX
    why: str
    retire_when: str
    codemod: type[HitCountingCodemod]
    #: Further seams the same rewrite satisfies (one shared allocation for two runners).
    also_covers: tuple[str, ...] = ()
    #: The rewrite writes facts of the build (version, base wheel, sha256) into the engine, so
    #: its output differs between a cell's wheels even where their sources are the same; every
    #: other codemod's output is a function of its target file alone, and a build runs it once
    #: per distinct file (forge/transforms.py, `CodemodMemo`).
    writes_build_facts: bool = False
    forwarded: str = ""
    last_update: str = ""

    @property
    def seams(self) -> tuple[str, ...]:
        return (self.seam, *self.also_covers)

    def applies_to(self, engine: str, version: str) -> bool:
        return (self.engine in (ANY_ENGINE, engine)
                and Version(version) in SpecifierSet(self.versions))


@dataclass(frozen=True)
class RequiredSeam:
    """A seam every build of ``engine`` within ``versions`` must cover with one transform."""

    engine: str                       # an engine name, or ANY_ENGINE
    seam: str
    versions: str = ""                # PEP 440 range where it is required; "" is every version
    note: str = ""                    # why the range is what it is

    def required_for(self, engine: str, version: str) -> bool:
        return (self.engine in (ANY_ENGINE, engine)
                and Version(version) in SpecifierSet(self.versions))
