"""How steady the GPU machine's host is: the same work timed again and again, nothing else running.

An eager-mode engine step is host work: Python in the scheduler and model runner, and one kernel
launch per operation. When the host's speed changes from second to second, so do eager bursts of
identical work, and a throughput ratio between two engines needs many more alternated pairs to
resolve a small difference. This times, in turns, for `--seconds`:

- `cpu`: a pure-Python loop (3 M additions) on one thread;
- `launch`: 20,000 element-wise kernels on a 64x64 tensor, launch-bound (what eager steps are);
- `gemm`: 200 bf16 8192x8192 matrix products, GPU-bound (what the host does not change).

and prints, per kind, the spread (max/min, standard deviation over median) and the series.

    python benchmarks/gpu_host_noise.py --seconds 100 [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def timed(work: Callable[[], object], synchronize: Callable[[], None]) -> float:
    synchronize()
    started = time.perf_counter()
    work()
    synchronize()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=100.0)
    parser.add_argument("--out", type=Path, default=None, help="write host_noise.json here")
    args = parser.parse_args(argv)

    import torch

    small = torch.randn(64, 64, device="cuda")
    left = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    right = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def cpu() -> int:
        total = 0
        for i in range(3_000_000):
            total += i * i
        return total

    def launches() -> object:
        value = small
        for _ in range(20_000):
            value = value * 1.0001
        return value

    def gemms() -> None:
        for _ in range(200):
            left @ right

    kinds: dict[str, Callable[[], object]] = {"cpu": cpu, "launch": launches, "gemm": gemms}
    for work in kinds.values():  # warm-up: kernels loaded, clocks up
        timed(work, torch.cuda.synchronize)
    series: dict[str, list[float]] = {kind: [] for kind in kinds}
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        for kind, work in kinds.items():
            series[kind].append(timed(work, torch.cuda.synchronize))
    report = {}
    for kind, values in series.items():
        median = statistics.median(values)
        report[kind] = {"runs": len(values), "min_s": min(values), "median_s": median,
                        "max_s": max(values), "max_over_min": max(values) / min(values),
                        "sd_over_median": statistics.pstdev(values) / median}
        print(f"{kind:6} {len(values)} runs: min {min(values):.3f} s, median {median:.3f} s, "
              f"max {max(values):.3f} s, max/min {max(values) / min(values):.2f}, "
              f"sd/median {statistics.pstdev(values) / median:.3f}")
        print("       " + " ".join(f"{value:.3f}" for value in values))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_noise.json").write_text(json.dumps(
            {"summary": report, "series": series}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
