"""Grow by one logical page through PageAllocator.alloc_pages(1) against the raw driver floor.

Both are measured in the same run on the same GPU: the raw floor is cuMemCreate + cuMemMap +
cuMemSetAccess for the same bytes (per-layer: layers x 2 buffers x 2 MiB handles; contiguous:
one compound handle), timed in C++ by the benchmark-only extension `native/raw_map.cpp` (built
on first use). The reserve pool is disabled, so every alloc_pages(1) maps.
A second floor adds the cuMemUnmap of a zero-page mapping, which any range that keeps unbacked
pages readable must pay. Target: ours <= 1.15 x the raw floor.

    python benchmarks/bench_map_page.py [--layers 32] [--steps 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from kvcached_core import native

try:
    from benchmarks.native.raw_map import load as load_raw_map
except ImportError:  # run as a script: benchmarks/ is on sys.path, not the repository root
    from native.raw_map import load as load_raw_map

MiB = 1 << 20
PAGE = 2 * MiB
BUFFERS = 2
TARGET_RATIO = 1.15


def _median_us(samples_ns: list[float]) -> float:
    return statistics.median(samples_ns) / 1000.0


def time_alloc_pages(
    layers: int, contiguous: bool, steps: int, breakdown: dict[str, list[float]] | None = None
) -> list[float]:
    """ns per alloc_pages(1) that maps a fresh logical page; the free (unmap) is not timed.

    `breakdown` collects, per step, the driver time of each operation inside that alloc.
    """
    backend = native.cuda_backend(0)
    allocator = native.FTensorAllocator(backend, PAGE, contiguous)
    allocator.create_kv_tensors(PAGE * 4, layers, BUFFERS)
    pool = native.PageAllocator(allocator, 0, 0, False)
    samples: list[float] = []
    for _ in range(steps):
        before = backend.op_stats()
        start = time.perf_counter_ns()
        pages = pool.alloc_pages(1)
        samples.append(float(time.perf_counter_ns() - start))
        after = backend.op_stats()
        if breakdown is not None:
            for name, (_, ns) in after.items():
                breakdown.setdefault(name, []).append(float(ns - before[name][1]))
        pool.free_pages(pages)
    assert pool.reserve_hits == 0 and pool.reserve_misses == steps
    pool.stop()
    return samples


def time_raw(layers: int, contiguous: bool, steps: int, zero_swap: bool) -> dict[str, list[float]]:
    raw_map = load_raw_map()
    if contiguous:
        return raw_map.bench_raw_map(0, PAGE * layers * BUFFERS, 1, steps, zero_swap)
    return raw_map.bench_raw_map(0, PAGE, layers * BUFFERS, steps, zero_swap)


def measure(layers: int, contiguous: bool, steps: int, rounds: int) -> dict[str, Any]:
    ours: list[float] = []
    ours_ops: dict[str, list[float]] = {}
    raw: dict[str, list[float]] = {}
    raw_zero: list[float] = []
    time_alloc_pages(layers, contiguous, 3)  # warm-up: context, zero page, driver caches
    time_raw(layers, contiguous, 3, False)
    for _ in range(rounds):  # interleaved so that drift hits both sides alike
        for key, values in time_raw(layers, contiguous, steps, False).items():
            raw.setdefault(key, []).extend(values)
        ours.extend(time_alloc_pages(layers, contiguous, steps, ours_ops))
        raw_zero.extend(time_raw(layers, contiguous, steps, True)["total_ns"])
    raw_us = _median_us(raw["total_ns"])
    raw_zero_us = _median_us(raw_zero)
    ours_us = _median_us(ours)
    return {
        "layout": "contiguous" if contiguous else "per-layer",
        "layers": layers,
        "logical_page_bytes": PAGE * layers * BUFFERS,
        "handles_per_page": 1 if contiguous else layers * BUFFERS,
        "samples": len(ours),
        "ours_median_us": ours_us,
        "raw_median_us": raw_us,
        "raw_create_median_us": _median_us(raw["create_ns"]),
        "raw_map_median_us": _median_us(raw["map_ns"]),
        "raw_access_median_us": _median_us(raw["access_ns"]),
        "raw_with_zero_swap_median_us": raw_zero_us,
        "ours_driver_median_us": {
            name: _median_us(values) for name, values in sorted(ours_ops.items()) if any(values)
        },
        "ratio_vs_raw": ours_us / raw_us,
        "ratio_vs_raw_with_zero_swap": ours_us / raw_zero_us,
    }


def _format(result: dict[str, Any]) -> str:
    r = result
    return (
        f"{r['layout']:>10} L={r['layers']:<3} page={r['logical_page_bytes'] // MiB} MiB"
        f" ({r['handles_per_page']} handle(s)): ours {r['ours_median_us']:.1f} us,"
        f" raw {r['raw_median_us']:.1f} us (create {r['raw_create_median_us']:.1f}"
        f" + map {r['raw_map_median_us']:.1f} + access {r['raw_access_median_us']:.1f}),"
        f" ratio {r['ratio_vs_raw']:.3f} (target <= {TARGET_RATIO});"
        f" raw+zero-unmap {r['raw_with_zero_swap_median_us']:.1f} us,"
        f" ratio {r['ratio_vs_raw_with_zero_swap']:.3f}\n"
        f"{'':>12}ours, driver time inside alloc_pages: "
        + ", ".join(f"{name} {us:.1f}" for name, us in r["ours_driver_median_us"].items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[32])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    available, reason = native.cuda_driver_status()
    if not available:
        raise SystemExit(f"bench_map_page needs a GPU: {reason}")

    results = []
    for layers in args.layers:
        for contiguous in (False, True):
            result = measure(layers, contiguous, args.steps, args.rounds)
            results.append(result)
            print(_format(result))
    for result in results:
        if result["layers"] == 32:
            mib = result["logical_page_bytes"] // MiB
            millis = result["ours_median_us"] / 1000
            print(
                f"one logical page of a 32-layer model, {result['layout']}:"
                f" {mib} MiB, {millis:.2f} ms"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
