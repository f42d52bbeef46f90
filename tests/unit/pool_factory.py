"""Test shorthand: a `KVPool` from one flat set of keywords, split into spec, policy, options."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec

_SPEC_FIELDS = {f.name for f in dataclasses.fields(PoolSpec)}
_POLICY_FIELDS = {f.name for f in dataclasses.fields(PoolPolicy)}


def create_pool(name: str, **keywords: Any) -> KVPool:
    """`KVPool.create` with `PoolSpec` and `PoolPolicy` fields given by name; every other
    keyword (backend, device, shm_dir, share_limits, metrics) is passed on as it is."""
    spec = PoolSpec(**{k: keywords.pop(k) for k in list(keywords) if k in _SPEC_FIELDS})
    policy = PoolPolicy(**{k: keywords.pop(k) for k in list(keywords) if k in _POLICY_FIELDS})
    return KVPool.create(name, spec, policy, **keywords)
