"""Run one SGLang CPU engine on a fixed workload; write what it did as JSON.

Run inside an SGLang test venv:

    python run_engine.py MODEL_DIR OUT_JSON [--limit BYTES [--limit-one-rank]]
        [--barrier DIR --parties N] [--tp N [--nnodes N --node-rank K --dist-init-addr A --port P]]

The workload is a burst with shared prefixes (prefix-cache hits), then idle, then one more
request sharing the prefix. While it runs, the KV pages the elastic pool holds are sampled from
the pool's limit record (`KVCACHED_SHM_DIR`): none exist for a stock engine.

With `--limit` (elastic engines), the pool's limit is lowered to it before the burst, as
`kvctl limit` would, and raised back after it: the burst must then run under a limit smaller
than its working set. (The CPU engine admits the whole burst in its first prefill batch, so a
limit lowered once the burst has begun would find its pages already mapped.)

With `--barrier`, the engine starts its burst only once N engines have started (each leaves a
file in DIR), so that engines sharing a budget (`KVCACHED_BUDGET`) burst together; the
budget's charge is then sampled too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

PARAMS = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


class KVSampler:
    """Polls the in-use KV bytes every elastic pool of the engine publishes."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self.budget_samples: list[tuple[float, int]] = []
        self.rank_samples: list[dict[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def set_limits(limit_bytes: int, *, one_rank: bool = False) -> int:
        """Limit every pool of the engine, as `kvctl limit` does; with `one_rank`, only the
        pools of one of its ranks (the scheduler process with the highest pid)."""
        from kvcached_core.limits import list_records, set_limit

        records = [r for r in list_records() if r.pool.startswith("sglang-")]
        if one_rank and records:
            last = max(r.owner_pid for r in records)
            records = [r for r in records if r.owner_pid == last]
        for record in records:
            set_limit(record.pool, limit_bytes)
        return len(records)

    @staticmethod
    def per_rank() -> dict[int, int]:
        """In-use KV bytes of each rank (scheduler process) of the engine."""
        from kvcached_core.limits import list_records

        ranks: dict[int, int] = {}
        for record in list_records():
            if record.pool.startswith("sglang-"):
                ranks[record.owner_pid] = ranks.get(record.owner_pid, 0) + record.used_bytes
        return ranks

    @staticmethod
    def budget_charged() -> int | None:
        """What every member of the engine's budget holds (None: no budget)."""
        name = os.environ.get("KVCACHED_BUDGET")
        if not name:
            return None
        from kvcached_core.budget import read_budget

        return read_budget(name).charged_bytes

    def now(self) -> int | None:
        if not os.environ.get("KVCACHED_SHM_DIR"):
            return None
        from kvcached_core.limits import list_records

        records = [r for r in list_records() if r.pool.startswith("sglang-")]
        return sum(r.used_bytes for r in records) if records else None

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            value = self.now()
            if value is not None:
                self.samples.append((time.monotonic(), value))
                self.rank_samples.append(self.per_rank())
            charged = self.budget_charged()
            if charged is not None:
                self.budget_samples.append((time.monotonic(), charged))

    def __enter__(self) -> KVSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def engine_kwargs(model: str, tp: int = 1, nodes: Nodes | None = None) -> dict[str, Any]:
    """The CPU engine every SGLang L2 proof and the soak run: torch-native attention, no CUDA
    graphs, a fixed seed, 4,096 KV tokens (elastic: virtual, mapped as used); with `tp`, that
    many tensor-parallel ranks, spread over `nodes` when given."""
    kwargs: dict[str, Any] = {
        "model_path": model, "device": "cpu", "attention_backend": "torch_native",
        "disable_cuda_graph": True, "max_total_tokens": 4096, "log_level": "error",
        "skip_server_warmup": True, "random_seed": 0}
    if tp > 1:
        kwargs["tp_size"] = tp
    if nodes is not None:
        kwargs.update(nnodes=nodes.count, node_rank=nodes.rank,
                      dist_init_addr=nodes.dist_init_addr,
                      # Each node's own ports (a node above 0 serves a health check on it).
                      port=nodes.port)
    return kwargs


class Nodes:
    """This process's place in an engine launched on several nodes (`--nnodes`)."""

    def __init__(self, count: int, rank: int, dist_init_addr: str, port: int) -> None:
        self.count, self.rank = count, rank
        self.dist_init_addr, self.port = dist_init_addr, port


def serve_as_follower_node(model: str, out: str, tp: int, nodes: Nodes) -> None:
    """A node above rank 0: its schedulers run until node 0's engine shuts them down (SGLang's
    `Engine` returns only then)."""
    import sglang

    sglang.Engine(**engine_kwargs(model, tp, nodes))
    Path(out).write_text(json.dumps({"node_rank": nodes.rank}))


def completion_ids(outputs: list[dict[str, Any]]) -> list[list[int]]:
    """The generated token ids of each output: up to 0.5.1 `output_ids` also holds the last
    prompt tokens the incremental detokenizer starts from, so they are cut to the completion's
    length."""
    return [o["output_ids"][len(o["output_ids"]) - o["meta_info"]["completion_tokens"]:]
            for o in outputs]


def wait_for_parties(barrier: Path, parties: int, timeout_s: float = 600.0) -> None:
    """Leave this engine's file in `barrier`, then wait until `parties` engines have."""
    barrier.mkdir(parents=True, exist_ok=True)
    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + timeout_s
    while len(list(barrier.iterdir())) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(barrier.iterdir()))} of {parties} engines "
                               f"started within {timeout_s:.0f} s")
        time.sleep(0.05)


def main(model: str, out: str, lowered_limit: int | None = None,
         barrier: Path | None = None, parties: int = 1, tp: int = 1,
         limit_one_rank: bool = False, nodes: Nodes | None = None) -> None:
    import sglang

    shared = " ".join(f"w{j}" for j in range(40))
    # No prompt of the first six starts like the shared prefix: whether a shared-prefix request
    # is scheduled before or after one of them finishes must not change what it finds cached.
    burst = [" ".join(f"w{(100 + 7 * i + j) % 250}" for j in range(24)) for i in range(6)]
    burst += [f"{shared} w{100 + i} w{120 + i}" for i in range(4)]
    engine = sglang.Engine(**engine_kwargs(model, tp, nodes))
    try:
        asyncio.get_event_loop()
    except RuntimeError:
        # Up to 0.5.1 `Engine.generate` asks the policy for the thread's loop, which the uvloop
        # policy it installs no longer creates on demand: give the main thread one.
        asyncio.set_event_loop(asyncio.new_event_loop())
    try:
        with KVSampler() as sampler:
            before = sampler.now()
            if lowered_limit is not None:
                pools_limited = sampler.set_limits(lowered_limit, one_rank=limit_one_rank)
                time.sleep(0.5)  # the pool's limit watcher polls the record every 0.1 s
            if barrier is not None:
                wait_for_parties(barrier, parties)
            burst_began = len(sampler.samples)
            budget_began = len(sampler.budget_samples)
            first = engine.generate(burst, PARAMS)
            during_burst = [v for _, v in sampler.samples[burst_began:]]
            budget_during_burst = [v for _, v in sampler.budget_samples[budget_began:]]
            if lowered_limit is not None:
                sampler.set_limits(1 << 40)  # as high as the pool's capacity allows
            time.sleep(0.5)
            idle = sampler.now()
            ranks_idle = sampler.per_rank() if idle is not None else {}
            again = engine.generate([f"{shared} w200 w201"], PARAMS)
        peak = max((v for _, v in sampler.samples), default=None)
        ranks_peak: dict[int, int] = {}
        for sample in sampler.rank_samples:
            for pid, used in sample.items():
                ranks_peak[pid] = max(ranks_peak.get(pid, 0), used)
        result = {
            "outputs": completion_ids(first + again),
            "completion_tokens": [o["meta_info"]["completion_tokens"] for o in first + again],
            "cached_tokens": [o["meta_info"].get("cached_tokens", 0) for o in first + again],
            "kv_bytes": {"before": before, "peak": peak, "idle": idle},
            "ranks": {"peak": sorted(ranks_peak.values()), "idle": sorted(ranks_idle.values())},
        }
        if lowered_limit is not None:
            result["lowered"] = {"limit": lowered_limit, "pools_limited": pools_limited,
                                 "burst_peak": max(during_burst, default=None)}
        if sampler.budget_samples:
            result["budget"] = {"burst_peak_charged": max(budget_during_burst, default=None)}
    finally:
        engine.shutdown()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--barrier", type=Path, default=None)
    parser.add_argument("--parties", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--limit-one-rank", action="store_true")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-init-addr", default=None)
    parser.add_argument("--port", type=int, default=30000)
    args = parser.parse_args()
    nodes = (Nodes(args.nnodes, args.node_rank, args.dist_init_addr, args.port)
             if args.nnodes > 1 else None)
    if nodes is not None and nodes.rank > 0:
        serve_as_follower_node(args.model, args.out, args.tp, nodes)
    else:
        main(args.model, args.out, args.limit, args.barrier, args.parties, args.tp,
             args.limit_one_rank, nodes)
