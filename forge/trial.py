"""A trial: the matrix and registry an upgrade check's proposed cell is built and proven with.

``upgrade-check`` proposes a cell for a release whose transforms' registry ranges do not hold it
yet (only a review widens them). Its trial build writes, into the report folder:

- ``trial-matrix.toml``: the matrix plus the proposed entry;
- ``trial-registry.json``: the chosen transform ids, the range they are narrowed to (this
  release only) and the folder of the trial's reviewed diffs (``trial-patches/``).

The cell proofs (tests/cells, tests/contract, tests/sglang) read both when
``KVCACHED_PROOF_TRIAL`` names that folder, so they prove the proposed cell exactly as it was
built. This module is the one definition of those files: the build writes them, the tests read
them through :func:`trial_registry` and :func:`trial_matrix_path`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from forge.errors import ForgeError
from forge.registry import Kind, Registry, Transform, default_registry

PROOF_TRIAL_ENV = "KVCACHED_PROOF_TRIAL"
TRIAL_MATRIX = "trial-matrix.toml"
TRIAL_REGISTRY = "trial-registry.json"
TRIAL_PATCHES = "trial-patches"
_SCHEMA = 1


class TrialError(ForgeError):
    """A named trial folder that does not hold a complete trial (one line)."""


def write_trial(trial_dir: Path, *, matrix_text: str, entry: str, cell: str, version: str,
                transforms: Sequence[Transform]) -> None:
    """Write the trial matrix (``matrix_text`` plus ``entry``) and the trial registry
    description (``transforms`` narrowed to ``==version``) into ``trial_dir``."""
    diffs = [t.id for t in transforms if t.kind is Kind.DIFF]
    if diffs:
        raise TrialError(f"a trial takes codemods only; {', '.join(diffs)} are diffs, which "
                         "apply only in their own series")
    trial_dir.mkdir(parents=True, exist_ok=True)
    (trial_dir / TRIAL_MATRIX).write_text(f"{matrix_text.rstrip()}\n\n{entry}",
                                          encoding="utf-8")
    description = {
        "schema": _SCHEMA,
        "cell": cell,
        "versions": f"=={version}",
        "transforms": [t.id for t in transforms],
        "patches_root": TRIAL_PATCHES,   # relative to the trial folder, so it may move
    }
    (trial_dir / TRIAL_REGISTRY).write_text(json.dumps(description, indent=2) + "\n",
                                            encoding="utf-8")


def trial_matrix_path(trial_dir: Path) -> Path:
    """The trial's matrix file; TrialError when the folder lacks it."""
    path = trial_dir / TRIAL_MATRIX
    if not path.is_file():
        raise TrialError(f"proof trial {trial_dir}: no {TRIAL_MATRIX} (an upgrade-check trial "
                         "build writes it)")
    return path


def trial_registry(trial_dir: Path, base: Registry | None = None) -> Registry:
    """The registry a trial was built with: ``base``'s transforms (the default registry's when
    not given) that the description names, in its order, each range narrowed to the trial's
    release, with the trial's reviewed diffs as patches root. TrialError (one line) for a
    missing or malformed description or a transform ``base`` does not register."""
    path = trial_dir / TRIAL_REGISTRY
    if not path.is_file():
        raise TrialError(f"proof trial {trial_dir}: no {TRIAL_REGISTRY} (an upgrade-check "
                         "trial build writes it)")
    try:
        description = json.loads(path.read_text(encoding="utf-8"))
        if description.get("schema") != _SCHEMA:
            raise ValueError(f"schema {description.get('schema')!r}, expected {_SCHEMA}")
        versions = SpecifierSet(str(description["versions"]))
        ids = [str(i) for i in description["transforms"]]
        patches = Path(str(description["patches_root"]))
    except (ValueError, KeyError, TypeError, AttributeError, InvalidSpecifier) as exc:
        raise TrialError(f"{path}: not a trial registry description: {exc}") from None
    base = base or default_registry()
    known = {t.id: t for t in base.codemods}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise TrialError(f"{path}: transforms not registered: {', '.join(unknown)}")
    return Registry(codemods=[replace(known[i], versions=versions) for i in ids],
                    patches_root=trial_dir / patches, required_seams=base.required_seams)
