"""What one rank agreement costs an SGLang tensor-parallel engine, against what SGLang itself
already pays on the same group every scheduler step.

    python benchmarks/bench_sglang_rank_agreement.py [--ranks 2] [--calls 5000] [--rounds 5]

Each capacity read and each allocation of an elastic SGLang engine over several ranks is one
`RankAgreement.least` (an all-reduce MIN of one int64 on the TP CPU group, gloo). The anchor is
the broadcast SGLang's scheduler makes on that group at the top of every step when no request
arrived (`broadcast_pyobj` of an empty list: one int64 broadcast from rank 0). Both run in the
same processes over one gloo group on 127.0.0.1, alternated in rounds; printed: the median
microseconds of each and their ratio per round.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

from kvcached_core.router.engines import free_port


def _rank(rank: int, ranks: int, port: int, calls: int, rounds: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from kvcached_core.integration.sglang.ranks import RankAgreement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ranks)
    group = dist.new_group(backend="gloo")
    agreement = RankAgreement(group, ranks)
    size = torch.tensor([0], dtype=torch.long)

    def per_call_us(step: Any) -> float:
        dist.barrier(group=group)
        began = time.perf_counter()
        for _ in range(calls):
            step()
        return (time.perf_counter() - began) / calls * 1e6

    results = []
    for _ in range(rounds):
        anchor = per_call_us(lambda: dist.broadcast(size, src=0, group=group))
        agreed = per_call_us(lambda: agreement.least(1000 + rank))
        results.append((anchor, agreed))
    if rank == 0:
        out.put(results)
    dist.barrier(group=group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(rank, args.ranks, port, args.calls,
                                                     args.rounds, out))
                 for rank in range(args.ranks)]
    for process in processes:
        process.start()
    results = out.get(timeout=600)
    for process in processes:
        process.join()
    print("round  step broadcast (us)  agreement all-reduce (us)  ratio")
    for index, (anchor, agreed) in enumerate(results, 1):
        print(f"{index:5d}  {anchor:20.1f}  {agreed:25.1f}  {agreed / anchor:5.2f}")
    anchors = [a for a, _ in results]
    agreed = [b for _, b in results]
    ratios = [b / a for a, b in results]
    print(f"median {statistics.median(anchors):19.1f}  {statistics.median(agreed):25.1f}  "
          f"{statistics.median(ratios):5.2f}  (ratios {min(ratios):.2f} - {max(ratios):.2f})")


if __name__ == "__main__":
    main()
