"""The README's SGLang model families table says where each family is elastic, as the cells'
transforms decide it: a family is elastic in a cell whose transforms make its pool (and, for
window models, its allocator) the elastic class, refused in every other SGLang cell."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import Version

from forge.matrix import load_matrix
from forge.transforms import select_transforms
from tests.proof_cells import cell_span, proof_matrix_path, proof_registry

ROOT = Path(__file__).resolve().parents[2]
#: README row -> the transforms (any of them) that make the family elastic in a cell.
FAMILY_TRANSFORMS = {
    "full attention (MHA pool)": {"sglang-mha-pool", "sglang-mha-pool-separate-kv",
                                  "sglang-mha-pool-inline-buffers"},
    "MLA": {"sglang-mla-pool", "sglang-mla-pool-inline"},
    "hybrid sliding window": {"sglang-swa-allocator", "sglang-swa-allocator-before-budget",
                              "sglang-swa-allocator-model-runner"},
    "Mamba / linear attention": set(),
}


def test_the_readme_sglang_families_table_says_where_each_family_is_elastic() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"Model families \(SGLang\).*?\n\n(\|.*?)\n\n", text, re.S)
    assert match, "the README has no SGLang model families table"
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in match.group(1).splitlines() if line.startswith("|")][2:]
    registry = proof_registry()
    cells = sorted((c for c in load_matrix(proof_matrix_path()).cells if c.engine == "sglang"),
                   key=lambda c: Version(c.version))
    ordered = [c.name for c in cells]
    applied = {c.name: {t.id for t in select_transforms(registry, c)} for c in cells}
    assert [row[0] for row in rows] == list(FAMILY_TRANSFORMS)
    for family, elastic_in, refused_in, proof in rows:
        serving = {name for name, ids in applied.items() if ids & FAMILY_TRANSFORMS[family]}
        assert elastic_in == cell_span(ordered, serving), family
        refused = cell_span(ordered, set(ordered) - serving)
        assert refused_in == ("every cell" if not serving else refused) or \
            refused_in.startswith(refused + ";"), (family, refused_in, refused)
        for named in re.findall(r"`(tests/[^`]+\.py)`", proof):
            assert (ROOT / named).is_file(), named
