"""Eight models behind one `kvrouter` endpoint on one GPU: elastic engines against a static split.

Eight random-weight Llamas of different sizes (`--sizes`; on a card over 100 GiB one 8b, two 3b,
five 1b, else two 3b and six 1b; `make_random_llama.py`, weights filled by vLLM's dummy loader)
are served by one router, in one of two modes:

- `elastic`: patched vLLM engines (kvcached on); each declares its weights plus an overhead,
  the rest of the device is one KV budget they share; idle engines sleep (`kv` level) after
  `--idle-sleep-s` and wake on the next request.
- `static`: what a user does without elastic KV: the same engines with kvcached off
  (`KVCACHED_ENABLE=0`, the stock code path), each started with `gpu_memory_utilization` equal
  to its share: its weights and overhead plus an equal slice of the KV memory left (that slice
  given as `kv_cache_memory_bytes`); they never sleep.

Both modes replay the same trace: bursts every `--burst-every-s` of `--burst` requests, each to a
model drawn by Zipf popularity (s = `--zipf`; the 8b is the most popular), with an idle gap in
the middle; prompts of random token ids, `--min-prompt`..`--max-prompt` long, `--max-tokens`
greedy tokens each. Every request goes through the router with the `openai` wire format.
Printed and written to `OUT/summary.json`: requests served and failed, latency p50 / p99
(wakes included) overall and for the most popular model, engine start times, wakes, and the
device memory timeline (`OUT/timeline.csv`: NVML used bytes and each model's mapped KV).

    PYTHONPATH=<vllm site>:<repo> python3 benchmarks/gpu_router.py --mode elastic \\
        --tokenizer-model <tiny model dir> --site <vllm site> --out OUT
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from make_random_llama import make, parameters  # noqa: E402
from router_process import get_json, running_router  # noqa: E402

GIB = 1 << 30
# Eight models, the largest the most popular; an 80 GB card gets a smaller largest model, so
# that the static split still leaves every engine a KV slice that holds one full-length request.
SIZES_BY_DEVICE = {"large": "8b,3b,3b,1b,1b,1b,1b,1b", "small": "3b,3b,1b,1b,1b,1b,1b,1b"}
LARGE_DEVICE_BYTES = 100 * (1 << 30)
MODELS: list[tuple[str, str]] = []
OVERHEAD_BYTES = 3 * GIB  # CUDA context, activations at the profiled peak, sampler workspace
USABLE = 0.9  # of the device, as vLLM's default utilization leaves the rest


def _post(url: str, body: dict[str, Any] | None = None, timeout: float = 900) -> Any:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def device_total() -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)


def device_used() -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)


def build_config(args: argparse.Namespace, work: Path, total: int) -> tuple[Path, dict[str, int]]:
    import yaml

    weights: dict[str, int] = {}
    paths: dict[str, Path] = {}
    for name, size in MODELS:
        paths[name] = work / "models" / name
        config = make(args.tokenizer_model, paths[name], size)
        config["max_position_embeddings"] = args.max_model_len
        (paths[name] / "config.json").write_text(json.dumps(config, indent=1))
        weights[name] = 2 * parameters(config)
    held = {name: weights[name] + OVERHEAD_BYTES for name, _ in MODELS}
    kv_slice = (USABLE * total - sum(held.values())) / len(MODELS)
    assert kv_slice > GIB, f"the static split leaves {kv_slice / GIB:.1f} GiB of KV per model"
    env = {"PYTHONPATH": f"{args.site}{os.pathsep}{REPO}", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "NCCL_NVLS_ENABLE": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    common = ["--load-format", "dummy", "--enforce-eager", "--max-model-len",
              str(args.max_model_len), "--seed", "0"]
    models = []
    for name, _size in MODELS:
        if args.mode == "elastic":
            memory, extra_env = held[name], {"KVCACHED_ENABLE": "1"}
            sizing = ["--gpu-memory-utilization", str(USABLE)]
        else:
            # Its share of the device, and exactly its slice of KV: vLLM then skips sizing the
            # KV from the free memory it measures, so the eight stock engines can start at once
            # (sized from measurements, each must start alone, 50 s apiece).
            memory, extra_env = int(held[name] + kv_slice), {"KVCACHED_ENABLE": "0"}
            sizing = ["--gpu-memory-utilization", str(round(memory / total, 4)),
                      "--kv-cache-memory-bytes", str(int(kv_slice))]
        models.append({"name": name, "engine": "vllm", "python": sys.executable,
                       "model": str(paths[name]), "device": "gpu0", "memory": memory,
                       "args": [*common, *sizing], "env": {**env, **extra_env}})
    config = work / "router.yaml"
    config.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{args.port}", "log_dir": str(work / "logs"),
        "shm_dir": str(work / "shm"),
        "idle_sleep_s": args.idle_sleep_s if args.mode == "elastic" else 0,
        "request_wait_s": 600, "start_timeout_s": 600,
        "devices": [{"name": "gpu0", "memory": int(USABLE * total),
                     "cuda_visible_devices": "0"}],
        "models": models}))
    return config, weights


def make_trace(args: argparse.Namespace) -> list[tuple[float, str, list[int]]]:
    """(send time, model, prompt token ids): bursts, a gap in the middle, Zipf popularity."""
    rng = random.Random(args.seed)
    names = [name for name, _ in MODELS]
    popularity = [1.0 / (rank + 1) ** args.zipf for rank in range(len(names))]
    trace = []
    burst_times = [t for t in range(0, args.busy_s, args.burst_every_s)]
    burst_times += [args.busy_s + args.gap_s + t for t in range(0, args.busy_s,
                                                               args.burst_every_s)]
    for start in burst_times:
        for _ in range(args.burst):
            name = rng.choices(names, popularity)[0]
            length = rng.randint(args.min_prompt, args.max_prompt)
            trace.append((start + rng.uniform(0, 0.5), name,
                          [rng.randrange(10, 1000) for _ in range(length)]))
    trace.sort(key=lambda item: item[0])
    return trace


class Sampler(threading.Thread):
    def __init__(self, base: str, out: Path) -> None:
        super().__init__(daemon=True)
        self.base, self.out = base, out
        self.stop = threading.Event()
        self.peak_used = 0

    def run(self) -> None:
        names = [name for name, _ in MODELS]
        started = time.monotonic()
        with self.out.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["t", "device_used", *names])
            while not self.stop.is_set():
                used = device_used()
                self.peak_used = max(self.peak_used, used)
                try:
                    rows = {r["model"]: r for r in get_json(f"{self.base}/router/status")["models"]}
                except OSError:
                    rows = {}
                writer.writerow([round(time.monotonic() - started, 2), used,
                                 *(rows.get(n, {}).get("kv_mapped_bytes", 0) for n in names)])
                handle.flush()
                self.stop.wait(0.5)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    total = device_total()
    config, weights = build_config(args, work, total)
    base = f"http://127.0.0.1:{args.port}"
    env = dict(os.environ, PYTHONPATH=f"{args.site}{os.pathsep}{REPO}")
    sampler = Sampler(base, out / "timeline.csv")
    summary: dict[str, Any] = {"mode": args.mode, "device_total": total,
                               "weights": weights, "models": MODELS, "argv": sys.argv[1:]}
    try:
        serve = [sys.executable, "-m", "kvcached_core.router.cli", "serve", str(config)]
        with running_router(serve, env, out / "router.log", base):
            sampler.start()
            # Every engine starts before the trace, all at once: elastic engines take their
            # start-up memory snapshots in turn (`startup_memory.py`), stock ones are told their
            # KV size.
            starts: dict[str, float] = {}
            began_all = time.monotonic()

            def start(name: str) -> None:
                began = time.monotonic()
                try:
                    _post(f"{base}/router/models/{name}/wake")
                except urllib.error.HTTPError as exc:  # the router's reason, log tail included
                    raise RuntimeError(f"{name}: {exc.read().decode()[-2000:]}") from exc
                starts[name] = round(time.monotonic() - began, 1)
                print(f"{args.mode}: {name} started in {starts[name]} s", flush=True)

            names = [name for name, _ in MODELS]
            with ThreadPoolExecutor(len(names)) as pool:
                list(pool.map(start, names))
            summary["start_s"] = starts
            summary["all_started_s"] = round(time.monotonic() - began_all, 1)
            summary["used_after_start"] = device_used()
            trace = make_trace(args)
            results: list[dict[str, Any]] = []
            lock = threading.Lock()
            t0 = time.monotonic() + 1.0

            def send(item: tuple[float, str, list[int]]) -> None:
                at, name, prompt = item
                time.sleep(max(0.0, t0 + at - time.monotonic()))
                began = time.monotonic()
                record: dict[str, Any] = {"model": name, "sent": at}
                try:
                    answer = _post(f"{base}/v1/completions", {
                        "model": name, "prompt": prompt, "max_tokens": args.max_tokens,
                        "temperature": 0, "ignore_eos": True}, timeout=900)
                    record["ok"] = answer["usage"]["completion_tokens"] == args.max_tokens
                except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                    record["ok"], record["error"] = False, str(exc)[:300]
                record["latency_s"] = time.monotonic() - began
                with lock:
                    results.append(record)

            with ThreadPoolExecutor(len(trace)) as pool:
                list(pool.map(send, trace))
            latencies = [r["latency_s"] for r in results if r["ok"]]
            popular = [r["latency_s"] for r in results if r["ok"] and r["model"] == MODELS[0][0]]
            summary.update({
                "requests": len(results), "served": len(latencies),
                "failed": len(results) - len(latencies),
                "errors": [r["error"] for r in results if "error" in r][:5],
                "p50_s": _percentile(latencies, 0.5), "p99_s": _percentile(latencies, 0.99),
                "mean_s": statistics.fmean(latencies) if latencies else None,
                "popular_p50_s": _percentile(popular, 0.5),
                "popular_p99_s": _percentile(popular, 0.99),
                "per_model_requests": {n: sum(r["model"] == n for r in results)
                                       for n, _ in MODELS},
                "trace_s": round(time.monotonic() - t0, 1),
                "status": get_json(f"{base}/router/status")["models"],
            })
            with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
                (out / "metrics.txt").write_bytes(response.read())
    finally:
        sampler.stop.set()
        summary["peak_used"] = sampler.peak_used
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def plot(runs: list[Path], png: Path) -> None:
    """Device memory in use over each run's timeline (one panel per mode), with the sum of
    the engines' mapped KV; rendered where matplotlib is (not on the GPU machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), sharex=True)
    for axis, run_dir in zip(axes if len(runs) > 1 else [axes], runs, strict=True):
        with (run_dir / "timeline.csv").open() as handle:
            rows = list(csv.DictReader(handle))
        t = [float(r["t"]) for r in rows]
        axis.plot(t, [int(r["device_used"]) / GIB for r in rows], label="device in use (NVML)")
        names = list(rows[0])[2:]  # the models' columns, most popular first
        axis.plot(t, [sum(int(r[n]) for n in names) / GIB for r in rows],
                  label="KV mapped, all engines")
        axis.plot(t, [int(r[names[0]]) / GIB for r in rows], label=f"KV mapped, {names[0]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        axis.set_title(f"{summary['mode']}: {summary.get('served')} served, p50 "
                       f"{summary.get('p50_s', 0):.1f} s, p99 {summary.get('p99_s', 0):.1f} s")
        axis.set_ylabel("GiB")
        axis.legend(loc="upper left", fontsize=8)
    (axes[-1] if len(runs) > 1 else axes).set_xlabel("seconds since the router started")
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "plot":
        # python benchmarks/gpu_router.py plot RUN_DIR... PNG
        plot([Path(p) for p in sys.argv[2:-1]], Path(sys.argv[-1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("elastic", "static"), required=True)
    parser.add_argument("--tokenizer-model", type=Path, required=True)
    parser.add_argument("--site", required=True, help="the staged vLLM site-packages")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--idle-sleep-s", type=float, default=10)
    parser.add_argument("--busy-s", type=int, default=40)
    parser.add_argument("--gap-s", type=int, default=20)
    parser.add_argument("--burst-every-s", type=int, default=5)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--min-prompt", type=int, default=5000)
    parser.add_argument("--max-prompt", type=int, default=7000)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="auto",
                        help="eight model sizes, most popular first (comma-separated), or auto: "
                             f"{SIZES_BY_DEVICE['large']} on a card over 100 GiB, else "
                             f"{SIZES_BY_DEVICE['small']}")
    args = parser.parse_args(argv)
    sizes = args.sizes
    if sizes == "auto":
        sizes = SIZES_BY_DEVICE["large" if device_total() > LARGE_DEVICE_BYTES else "small"]
    MODELS[:] = [(f"m{i}-{size}", size) for i, size in enumerate(sizes.split(","))]
    summary = run(args)
    keys = ("mode", "requests", "served", "failed", "p50_s", "p99_s", "popular_p50_s",
            "popular_p99_s", "trace_s", "peak_used", "used_after_start")
    print(json.dumps({k: summary.get(k) for k in keys}))
    return 0 if summary.get("failed") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
