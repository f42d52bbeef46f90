"""Patched against stock vLLM throughput on one GPU, alternated often enough to see 3%.

For each configuration (runner V2 or V1, eager or CUDA graphs) a stock engine and one patched
engine per KV layout run side by side on the GPU, and bursts alternate between them in an
ABBA order (stock, patched, patched, stock, ...) `--bursts` times each, so slow drift of the
machine falls on both alike. A model of 1-3 B parameters with random weights
(`load_format="dummy"`: only config.json and the tokenizer are read) makes GPU work dominate
each step. In eager mode Python launches every kernel, so the step needs more GPU work behind
each launch: `make_random_llama.py --size 17b-wide` with `--max-num-seqs 512`. Reported per
configuration and layout:

- throughput ratio patched / stock: the median of the per-pair ratios (burst i of patched
  over burst i of stock) with a bootstrap 95% confidence interval;
- TTFT p50 ratio (medians of the bursts' p50s);
- reserve-pool hit rate over the measured bursts, with the physical limit holding the working
  set plus the largest reserve; mean map time per logical page;
- with `--idle-follow-s`, each patched engine's mapped KV (its limit record) and the device's
  memory in use (NVML) every `--idle-period-s` after its last burst, and how long its mapped
  KV took to fall to the reserve bound (`--max-reserved-pages` logical pages) or below.

Targets: throughput >= 0.97 x stock, TTFT p50 <= 1.05 x, hit rate >= 0.99.

    python benchmarks/gpu_throughput.py --model DIR --stock-site DIR --patched-site DIR \\
        --out DIR [--configs v2-eager,v2-graphs,v1-eager,v1-graphs] [--bursts 20]

`--side-by-side` runs every engine's bursts at the same time instead, each engine back to
back, and pairs burst i with burst i: a change of the host's speed then falls on both engines'
bursts, at the cost of both sharing the device (`side_by_side`).

`--deadline-s` stops starting configurations that would not finish in time;
`--burst-deadline-s` ends a configuration's alternation after that many seconds of bursts
(the pairs measured so far are kept and summarized).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine_server import EngineProcess, EngineSpec, engine_environment  # noqa: E402

MIB = 1 << 20

# name -> (extra environment, enforce_eager)
CONFIGS: dict[str, tuple[dict[str, str], bool]] = {
    "v2-eager": ({}, True),
    "v2-graphs": ({}, False),
    "v1-eager": ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, True),
    "v1-graphs": ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, False),
}


def abba_order(names: list[str], rounds: int) -> list[str]:
    """Each name `rounds` times; every round visits the names forwards, then backwards, so
    that no engine always runs right after the same neighbour."""
    order: list[str] = []
    for index in range(rounds):
        order += names if index % 2 == 0 else list(reversed(names))
    return order


def bootstrap_median_ci(values: list[float], *, resamples: int = 4000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): a percentile bootstrap interval of the median."""
    if not values:
        nan = float("nan")
        return nan, nan, nan
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    tail = (1 - level) / 2
    low = medians[int(tail * resamples)]
    high = medians[min(resamples - 1, int((1 - tail) * resamples))]
    return statistics.median(values), low, high


def paired_ratios(patched: list[float], stock: list[float]) -> list[float]:
    return [p / s for p, s in zip(patched, stock, strict=False) if s > 0]


def summarize(bursts: dict[str, list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """Ratios of every patched engine against `stock`, from the bursts after `warmup`."""
    measured = {name: [b for b in runs[warmup:] if b.get("event") == "burst"]
                for name, runs in bursts.items()}
    stock = measured.get("stock", [])
    stock_tput = [b["tokens"] / b["seconds"] for b in stock]
    stock_ttft = [b["ttft_p50"] for b in stock if b.get("ttft_p50") is not None]
    summary: dict[str, Any] = {"stock": {
        "bursts": len(stock), "throughput_median_tok_s": round(statistics.median(stock_tput), 1)
        if stock_tput else None}}
    for name, runs in measured.items():
        if name == "stock":
            continue
        tput = [b["tokens"] / b["seconds"] for b in runs]
        median, low, high = bootstrap_median_ci(paired_ratios(tput, stock_tput))
        ttft = [b["ttft_p50"] for b in runs if b.get("ttft_p50") is not None]
        ttft_pairs = [b["ttft_p50"] / s["ttft_p50"] for b, s in zip(runs, stock, strict=False)
                      if b.get("ttft_p50") and s.get("ttft_p50")]
        ttft_median, ttft_low, ttft_high = bootstrap_median_ci(ttft_pairs)
        unmaps = sum(b.get("unmap_calls", 0) for b in runs)
        unmap_ns = sum(b.get("unmap_ns", 0) for b in runs)
        left_mapped = [b["mapped_pages_after"] for b in runs if "mapped_pages_after" in b]
        hits = sum(b.get("reserve_hits", 0) for b in runs)
        misses = sum(b.get("reserve_misses", 0) for b in runs)
        maps = sum(b.get("map_calls", 0) for b in runs)
        map_ns = sum(b.get("map_ns", 0) for b in runs)
        summary[name] = {
            "bursts": len(runs),
            "throughput_median_tok_s": round(statistics.median(tput), 1) if tput else None,
            "throughput_ratio": round(median, 4),
            "throughput_ratio_ci95": [round(low, 4), round(high, 4)],
            "ttft_p50_ratio": round(statistics.median(ttft) / statistics.median(stock_ttft), 4)
            if ttft and stock_ttft else None,
            "ttft_p50_pair_ratio": round(ttft_median, 4) if ttft_pairs else None,
            "ttft_p50_pair_ratio_ci95": [round(ttft_low, 4), round(ttft_high, 4)]
            if ttft_pairs else None,
            "reserve_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
            "reserve_hits": hits, "reserve_misses": misses, "page_maps": maps,
            "mean_map_us_per_page": round(map_ns / maps / 1000, 1) if maps else None,
            "page_unmaps": unmaps,
            "mean_unmap_us_per_page": round(unmap_ns / unmaps / 1000, 1) if unmaps else None,
            # Pages still mapped when generate() returned: the drained engine's last step
            # should have left only page 0 (the null block's) and nothing retired.
            "mapped_pages_after_burst_median": statistics.median(left_mapped)
            if left_mapped else None,
            "failed_requests": sum(b.get("failed", 0) for b in runs),
        }
    return summary


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return kv_heads * head_dim * 2 * dtype_bytes * int(config["num_hidden_layers"])


def physical_limit(args: argparse.Namespace) -> int:
    """Working set of one burst plus the largest reserve, in whole logical pages."""
    per_token = kv_bytes_per_token(Path(args.model))
    tokens = args.prompts * (args.max_prompt_len + args.max_tokens)
    config = json.loads((Path(args.model) / "config.json").read_text())
    page_all_layers = 2 * MIB * 2 * int(config["num_hidden_layers"])
    working_pages = -(-tokens * per_token // page_all_layers)
    return (working_pages + args.max_reserved_pages + 2) * page_all_layers


def logical_page_bytes(model_dir: Path, page_size: int = 2 * MIB) -> int:
    """One logical page over every layer and both K and V (what one map backs)."""
    config = json.loads((model_dir / "config.json").read_text())
    return page_size * 2 * int(config["num_hidden_layers"])


def device_used_bytes() -> float | None:
    """GPU 0's memory in use by NVML (pynvml, else nvidia-smi); None without a GPU.

    Read from outside the engines so the parent creates no CUDA context of its own.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return float(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        pass
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
             "0"], capture_output=True, text=True, timeout=10, check=True).stdout
        return float(text.split()[0]) * MIB
    except Exception:
        return None


def settle_time(samples: list[dict[str, float]], key: str, bound: float) -> float | None:
    """Seconds after the burst from which `key` stays at or below `bound` (None: never)."""
    settled: float | None = None
    for row in samples:
        if row.get(key, float("inf")) <= bound:
            if settled is None:
                settled = row["t"]
        else:
            settled = None
    return settled


def follow_idle(pools: dict[str, str], *, seconds: float, period_s: float, reserve_bytes: int,
                shm_dir: str | None = None) -> dict[str, Any]:
    """Mapped KV of each engine's pool (name -> pool) and device memory, from now on."""
    from kvcached_core.limits import list_records

    samples: list[dict[str, float]] = []
    start = time.monotonic()
    while True:
        now = time.monotonic() - start
        mapped = {r.pool: r.used_bytes + r.reserved_bytes for r in list_records(shm_dir)}
        row: dict[str, float] = {"t": round(now, 3)}
        used = device_used_bytes()
        if used is not None:
            row["device_used"] = used
        for name, pool in pools.items():
            if pool in mapped:
                row[f"kv_{name}"] = float(mapped[pool])
        samples.append(row)
        if now >= seconds:
            break
        time.sleep(period_s)
    report: dict[str, Any] = {"seconds": seconds, "reserve_bound_bytes": reserve_bytes,
                              "samples": samples}
    for name in pools:
        key = f"kv_{name}"
        series = [row[key] for row in samples if key in row]
        if not series:
            report[name] = {"error": "no limit record"}
            continue
        report[name] = {
            "kv_mapped_mib_first": round(series[0] / MIB, 1),
            "kv_mapped_mib_last": round(series[-1] / MIB, 1),
            "kv_mapped_mib_max": round(max(series) / MIB, 1),
            "seconds_to_reserve_bound": settle_time(samples, key, reserve_bytes),
            "seconds_to_final": settle_time(samples, key, series[-1]),
        }
    devices = [row["device_used"] for row in samples if "device_used" in row]
    if devices:
        report["device_used_gib_first"] = round(devices[0] / (1 << 30), 3)
        report["device_used_gib_last"] = round(devices[-1] / (1 << 30), 3)
    return report


def side_by_side(engines: dict[str, EngineProcess], count: int, *, timeout: float,
                 deadline_s: float, out: Path,
                 ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Every engine bursts back to back, all at the same time, until each has `count` bursts
    (or the deadline): burst i of one engine runs beside burst i of the others, so a change
    of the host's speed falls on all of them alike. An engine that has its `count` keeps
    bursting (those bursts are not kept) until the others have theirs, so that no measured
    burst runs alone on the device. Returns the kept bursts, cut to the shortest engine's."""
    bursts: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    lock = threading.Lock()
    done = threading.Event()
    stopped: dict[str, str] = {}
    started = time.monotonic()

    def loop(name: str) -> None:
        index = 0
        while not done.is_set():
            burst = engines[name].burst(f"s{index}", timeout)
            burst.pop("digests", None)
            index += 1
            with lock:
                if burst.get("event") != "burst":
                    stopped["error"] = f"{name} burst {index}: {burst}"
                    done.set()
                    return
                if len(bursts[name]) < count:
                    bursts[name].append(burst)
                    (out / "bursts.json").write_text(json.dumps(bursts))
                if all(len(kept) >= count for kept in bursts.values()):
                    done.set()
                elif deadline_s and time.monotonic() - started > deadline_s:
                    stopped["stopped_early"] = (
                        f"burst deadline after {min(map(len, bursts.values()))} bursts "
                        f"of {count} side by side")
                    done.set()

    threads = [threading.Thread(target=loop, args=(name,), daemon=True) for name in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kept = min(len(runs) for runs in bursts.values())
    return {name: runs[:kept] for name, runs in bursts.items()}, stopped


def run_config(args: argparse.Namespace, config: str, out: Path) -> dict[str, Any]:
    env_extra, eager = CONFIGS[config]
    out.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = dict(dtype="bfloat16", max_model_len=args.max_model_len,
                                  enable_prefix_caching=False, enforce_eager=eager,
                                  load_format=args.load_format,
                                  gpu_memory_utilization=args.gpu_mem_util)
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.device_kind == "cpu":
        kwargs.pop("gpu_memory_utilization")
        kwargs["kv_cache_memory_bytes"] = args.cpu_kv_bytes
    base = engine_environment({**env_extra, **dict(item.split("=", 1) for item in args.env)})
    shape = dict(prompts=args.prompts, min_prompt_len=args.min_prompt_len,
                 max_prompt_len=args.max_prompt_len, max_tokens=args.max_tokens)
    limit = str(physical_limit(args))
    specs = [EngineSpec("stock", args.stock_site, kwargs, env={"KVCACHED_ENABLE": "0"},
                        **shape)]
    patched: list[tuple[str, dict[str, str]]] = [
        (layout, {"KVCACHED_LAYOUT": layout}) for layout in args.layouts.split(",") if layout]
    for variant in args.variant:  # NAME:KEY=VALUE[,KEY=VALUE...]
        name, _, settings = variant.partition(":")
        patched.append((name, dict(item.split("=", 1) for item in settings.split(",") if item)))
    for name, extra in patched:
        specs.append(EngineSpec(
            name, args.patched_site, kwargs, **shape,
            env={"KVCACHED_LAYOUT": "auto", "KVCACHED_PHYSICAL_LIMIT": limit,
                 "KVCACHED_MAX_RESERVED_PAGES": str(args.max_reserved_pages),
                 "KVCACHED_POOL_NAME": f"tput-{config}-{name}", **extra}))
    # Stock first and alone (its profile run would take a neighbour's start for an error),
    # then each variant that turns kvcached off (the same stock check), alone, then the
    # elastic engines together (their start-up checks allow for each other).
    stock_like = [spec for spec in specs[1:] if spec.env.get("KVCACHED_ENABLE") == "0"]
    elastic = [spec for spec in specs[1:] if spec not in stock_like]
    groups = [specs[:1], *([spec] for spec in stock_like), elastic]
    engines: dict[str, EngineProcess] = {}
    report: dict[str, Any] = {"config": config, "physical_limit_bytes": int(limit)}
    try:
        for group in groups:
            for spec in group:
                engines[spec.name] = EngineProcess(spec, args.model, out, base)
            for spec in group:
                message = engines[spec.name].wait_for(("ready",), args.start_timeout)
                report[f"{spec.name}_start"] = message
                if message.get("event") != "ready":
                    report["error"] = f"{spec.name} did not start: {message}"
                    return report
        names = list(engines)
        if args.side_by_side:
            bursts, stopped = side_by_side(engines, args.bursts + args.warmup,
                                           timeout=args.burst_timeout,
                                           deadline_s=args.burst_deadline_s, out=out)
            report.update(stopped)
            order = []
        else:
            bursts = {name: [] for name in names}
            order = abba_order(names, args.bursts + args.warmup)
        alternation_started = time.monotonic()
        for index, name in enumerate(order):
            if (args.burst_deadline_s and index % len(names) == 0
                    and time.monotonic() - alternation_started > args.burst_deadline_s):
                report["stopped_early"] = (f"burst deadline after {index // len(names)} "
                                           f"rounds of {len(order) // len(names)}")
                break
            burst = engines[name].burst(f"b{index}", args.burst_timeout)
            burst.pop("digests", None)
            bursts[name].append(burst)
            if burst.get("event") != "burst":
                report["error"] = f"{name} burst {index}: {burst}"
                break
            # Written as it goes, so a run cut short by its time limit keeps its pairs.
            (out / "bursts.json").write_text(json.dumps(bursts))
        report["summary"] = summarize(bursts, args.warmup)
        if args.idle_follow_s > 0 and "error" not in report:
            # The last burst just ended: follow each patched engine while it idles.
            pools = {spec.name: spec.env["KVCACHED_POOL_NAME"] for spec in elastic}
            page = max((int(report[f"{name}_start"].get("page_bytes_all_layers") or 0)
                        for name in pools), default=0) or logical_page_bytes(Path(args.model))
            idle = follow_idle(pools, seconds=args.idle_follow_s, period_s=args.idle_period_s,
                               reserve_bytes=args.max_reserved_pages * page)
            (out / "idle.json").write_text(json.dumps(idle, indent=1))
            idle.pop("samples")
            report["idle"] = idle
        if args.profile and "error" not in report:
            # One more burst per engine, alone and under cProfile: where the host time of
            # each engine's steps goes, against stock's, function by function.
            paths = {name: out / f"profile-{name}.prof" for name in names}
            for name, path in paths.items():
                message = engines[name].profile(path, args.burst_timeout)
                if message.get("event") != "profile":
                    report["error"] = f"{name} profiled burst: {message}"
                    break
            else:
                text = profile_diff(paths)
                (out / "profile-diff.txt").write_text(text)
                print(text, flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return report


def profile_diff(paths: dict[str, Path], *, baseline: str = "stock", top: int = 30) -> str:
    """The functions whose own time (and, separately, time including callees) differs most
    between each engine's profiled burst and the baseline's, in milliseconds.

    Functions are matched by file (from the package directory down: the trees live in
    different places) and name, not line: a patched file's lines are shifted.
    """
    import pstats

    def normalized(path: Path) -> dict[str, list[float]]:
        table: dict[str, list[float]] = {}
        for (file, _line, func), row in pstats.Stats(str(path)).stats.items():  # type: ignore[attr-defined]
            parts = file.split("/")
            for package in ("vllm", "kvcached_core", "sglang", "torch"):
                if package in parts:
                    parts = parts[len(parts) - 1 - parts[::-1].index(package):]
                    break
            key = f"{'/'.join(parts[-4:])}({func})"
            calls, own, total = table.get(key, [0.0, 0.0, 0.0])
            table[key] = [calls + row[1], own + row[2], total + row[3]]
        return table

    stats = {name: normalized(path) for name, path in paths.items()}
    base = stats[baseline]
    lines: list[str] = []
    for name, table in stats.items():
        if name == baseline:
            continue
        keys = set(base) | set(table)
        for column, title in ((1, "own time"), (2, "time with callees")):
            def delta(key: str, column: int = column,
                      table: dict[str, list[float]] = table) -> float:
                return (table.get(key, [0.0, 0.0, 0.0])[column]
                        - base.get(key, [0.0, 0.0, 0.0])[column])

            lines.append(f"== {name} - {baseline}: {title} (ms; calls {name} / {baseline})")
            for key in sorted(keys, key=lambda k: abs(delta(k)), reverse=True)[:top]:
                mine, theirs = table.get(key, [0, 0, 0]), base.get(key, [0, 0, 0])
                lines.append(f"{delta(key) * 1e3:+10.1f} {mine[column] * 1e3:10.1f} "
                             f"{theirs[column] * 1e3:10.1f} {int(mine[0]):>8} "
                             f"{int(theirs[0]):>8}  {key}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--stock-site", required=True)
    parser.add_argument("--patched-site", required=True)
    parser.add_argument("--out", default="gpu-throughput-out")
    parser.add_argument("--configs", default="v2-eager,v2-graphs,v1-eager,v1-graphs")
    parser.add_argument("--layouts", default="per-layer,contiguous")
    parser.add_argument("--variant", action="append", default=[],
                        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                        help="one more patched engine (layout auto) with these settings")
    parser.add_argument("--bursts", type=int, default=20, help="measured bursts per engine")
    parser.add_argument("--warmup", type=int, default=1, help="bursts per engine left out")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-reserved-pages", type=int, default=10)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-mem-util", type=float, default=0.3)
    parser.add_argument("--max-num-seqs", type=int, default=0,
                        help="sequences per step (0: the engine's default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0,
                        help="tokens per step (0: the engine's default)")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device-kind", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cpu-kv-bytes", type=int, default=256 * MIB)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--burst-timeout", type=float, default=120.0)
    parser.add_argument("--burst-deadline-s", type=float, default=0.0,
                        help="end a configuration's bursts after this many seconds (0: none)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="every engine bursts at the same time, back to back, paired by "
                             "index, instead of one after another in ABBA order")
    parser.add_argument("--idle-follow-s", type=float, default=0.0,
                        help="follow the patched engines this long after the last burst")
    parser.add_argument("--idle-period-s", type=float, default=0.25)
    parser.add_argument("--profile", action="store_true",
                        help="after the measured bursts, one more burst per engine under "
                             "cProfile; profile-diff.txt ranks the functions whose time "
                             "differs most from stock's")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="do not start a configuration after this many seconds (0: none)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {}
    for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
        if config not in CONFIGS:
            parser.error(f"unknown configuration {config!r}; known: {sorted(CONFIGS)}")
        if args.deadline_s and time.monotonic() - started > args.deadline_s:
            results[config] = {"skipped": "deadline"}
            continue
        results[config] = run_config(args, config, out / config)
        (out / "summary.json").write_text(json.dumps(results, indent=1, default=str))
        print(json.dumps({config: results[config].get("summary", results[config])}, indent=1,
                         default=str), flush=True)
    failed = [c for c, r in results.items() if r.get("error")]
    print("ok" if not failed else f"configurations with errors: {failed}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
