"""Model families: how a KV cache config's groups are named, the one line a family a site does
not serve is refused with, and the README's families table, which must say exactly where each
family is elastic: in the vLLM cells of `matrix.toml` whose KV-buffer transforms (the registry)
all call a site that serves it (`families.SITE_FAMILIES`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.vllm import families
from tests.proof_cells import cell_span, vllm_family_cells
from tests.unit.vllm_kv_stand_ins import FullAttentionSpec, SlidingWindowSpec

ROOT = Path(__file__).resolve().parents[2]


class MLAAttentionSpec(FullAttentionSpec):
    """vLLM's MLA spec derives from FullAttentionSpec: the most derived known name wins."""


@dataclass
class MambaSpec:
    block_size: int = 512
    page_size_bytes: int = 147_456


@dataclass
class UniformTypeKVCacheSpecs:
    kv_cache_specs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Fp8Spec(FullAttentionSpec):
    dtype: str = "torch.float8_e4m3fn"


@dataclass
class _Group:
    kv_cache_spec: Any


@dataclass
class _Config:
    kv_cache_groups: list[_Group]


def _spec(cls: type = FullAttentionSpec) -> Any:
    return cls(32, 2, 64, 16384)


def test_a_config_s_groups_are_named_by_their_spec_classes() -> None:
    config = _Config([_Group(_spec(SlidingWindowSpec)), _Group(_spec()),
                      _Group(_spec(MLAAttentionSpec)), _Group(MambaSpec()),
                      _Group(UniformTypeKVCacheSpecs({"a": _spec(Fp8Spec)}))])
    assert families.families_of(config) == ["full-attention", "sliding-window", "mla",
                                            "mamba", "fp8-kv"]
    assert families.families_of(_Config([_Group(object())])) == ["unknown (object)"]


def test_a_family_a_site_does_not_serve_is_refused_in_one_line() -> None:
    families.require_served("shared_kv_buffer", ["sliding-window", "mla", "mamba", "fp8-kv"])
    with pytest.raises(KVCachedConfigError) as caught:
        families.require_served("per_layer_kv_buffer", ["full-attention", "mamba"])
    message = str(caught.value)
    assert message.startswith("elastic KV cache (kvcached) does not serve the mamba model "
                              "family in this build (mamba: Mamba / linear-attention state")
    assert message.endswith("set KVCACHED_ENABLE=0 for the stock KV cache")
    assert "\n" not in message
    with pytest.raises(KVCachedConfigError, match=r"unknown \(Spec\)"):
        families.require_served("per_layer_kv_buffer", ["unknown (Spec)"])


def test_the_readme_families_table_says_where_each_family_is_elastic() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- families:vllm -->\n(.*?)<!-- /families:vllm -->", text, re.S)
    assert match, "the README has no families:vllm table"
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in match.group(1).splitlines() if line.startswith("|")][2:]
    ordered, serving = vllm_family_cells()
    expected = {f.title: (cell_span(ordered, serving[f.name]),
                          cell_span(ordered, set(ordered) - serving[f.name]))
                for f in families.FAMILIES}
    assert {row[0]: (row[1], row[2]) for row in rows} == expected
    for row in rows:  # every test a proof names exists
        for named in re.findall(r"`(tests/[^`]+\.py)`", row[3]):
            assert (ROOT / named).is_file(), named
