"""Run one SGLang CPU engine on a hybrid sliding-window model; write what it did as JSON.

Run inside an SGLang test venv, with KVCACHED_TEST_SWA_READ_FIX=1 (tests/sglang/shims):

    python run_window_engine.py MODEL_DIR OUT_JSON [--limit FULL_BYTES,WINDOW_BYTES]

The model is `tiny_model.py --model laguna` (3 window layers of 32 tokens, 1 full-attention
layer): SGLang keeps a full-attention pool and a window pool. The workload is a burst of 8
prompts generating 96 tokens each (every sequence outgrows the window), idle, then one request
generating 400 tokens alone. While it runs, each elastic pool's in-use bytes are sampled from
its limit record (named `sglang-mha-full-*` and `sglang-mha-swa-*`); a stock engine has none.

With `--limit`, the full-attention and the window pool's limits are lowered to those bytes
before the burst (as `kvctl limit` would) and raised again after it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from run_engine import KVSampler, completion_ids, engine_kwargs

BURST = {"temperature": 0.0, "max_new_tokens": 96, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}
POOLS = ("full", "swa")


def pool_kind(name: str) -> str | None:
    for kind in POOLS:
        if name.startswith(f"sglang-mha-{kind}-"):
            return kind
    return None


class PoolSampler(KVSampler):
    """Polls the in-use KV bytes of the engine's full and window pools apart (run_engine's
    sampler, whose thread it reuses, sums every pool)."""

    @staticmethod
    def set_limits(limits: dict[str, int]) -> None:  # type: ignore[override]
        """Limit each pool of the engine (kind -> bytes), as `kvctl limit` does."""
        from kvcached_core.limits import list_records, set_limit

        for record in list_records():
            kind = pool_kind(record.pool)
            if kind:
                set_limit(record.pool, limits[kind])

    @staticmethod
    def now() -> dict[str, int] | None:  # type: ignore[override]
        if not os.environ.get("KVCACHED_SHM_DIR"):
            return None
        from kvcached_core.limits import list_records

        used: dict[str, int] = {}
        for record in list_records():
            kind = pool_kind(record.pool)
            if kind:
                used[kind] = used.get(kind, 0) + record.used_bytes
        return used or None

    def since(self, index: int) -> dict[str, int | None]:
        """Each pool's peak over the samples from `index` on."""
        return {kind: max((s[kind] for _, s in self.samples[index:] if kind in s), default=None)
                for kind in POOLS}


def main(model: str, out: str, lowered_limit: dict[str, int] | None = None) -> None:
    import sglang

    burst = [" ".join(f"w{(11 * i + 3 * j) % 250}" for j in range(20 + 3 * i)) for i in range(8)]
    # float32: the random weights' bf16 logits are nearly tied, and a burst that waits under a
    # limit runs in other batches than stock's, whose bf16 rounding then picks other tokens.
    engine = sglang.Engine(**engine_kwargs(model), page_size=1, dtype="float32")
    try:
        with PoolSampler() as sampler:
            before = sampler.now()
            if lowered_limit is not None:
                sampler.set_limits(lowered_limit)
                time.sleep(0.5)  # the pool's limit watcher polls the record every 0.1 s
            burst_began = len(sampler.samples)
            first = engine.generate(burst, BURST)
            burst_peak = sampler.since(burst_began)
            if lowered_limit is not None:
                sampler.set_limits(dict.fromkeys(POOLS, 1 << 40))
            time.sleep(0.5)
            idle = sampler.now()
            long_began = len(sampler.samples)
            long = engine.generate(["w7 w8 w9 w10 w11 w12 w13 w14"], LONG)
            long_peak = sampler.since(long_began)
            long_end = sampler.now()
        outputs = first + long
        result: dict[str, Any] = {
            "outputs": completion_ids(outputs),
            "completion_tokens": [o["meta_info"]["completion_tokens"] for o in outputs],
            "kv_bytes": {"before": before, "burst_peak": burst_peak, "idle": idle,
                         "long_peak": long_peak, "long_end": long_end},
        }
    finally:
        engine.shutdown()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--limit", default=None, metavar="FULL_BYTES,WINDOW_BYTES")
    args = parser.parse_args()
    main(args.model, args.out,
         dict(zip(POOLS, map(int, args.limit.split(",")), strict=True)) if args.limit else None)
