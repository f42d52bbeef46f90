"""End to end on a GPU: stock against patched vLLM on one tiny model, one workload, one run.

Every configuration runs in its own child process (a fresh engine and CUDA context, engine core
in-process so kvcached's counters are readable): the stock wheel with a tight block count, and
the patched wheel with the same count as kvcached's physical limit over a large virtual KV
space, in each KV layout. The workload has shared prefixes and more concurrent demand than the
tight limit holds, so both engines preempt.

Checks (exit status 1 if any fails):
- greedy outputs of every patched configuration are token-identical to stock in the first
  (cold-cache) burst; later bursts hit the prefix cache, whose batch shapes change bf16
  rounding even for stock, so they are reported, not judged;
- the patched engine's device memory (driver free-memory figure and kvcached's mapped bytes)
  grows during each burst and returns after it, while stock holds its whole reservation;
- every request completes at full length.

Measures: throughput and TTFT p50 of each patched configuration against stock in the same run
(median of the measured rounds), the reserve-pool hit rate while the bursts run, the mean time
the engine spent mapping one logical page (with the raw driver floor from
`bench_map_page.py` beside it when `--map-floor` is given), and the idle footprint.

    python benchmarks/gpu_vllm_e2e.py --model DIR --out DIR \\
        --engine stock=PATH --engine patched=PATH [--configs stock,per-layer,contiguous,v1]

`--engine NAME=PATH`: PATH is prepended to the child's PYTHONPATH (a directory where that
vLLM wheel and its dependencies are installed); `stock` runs the stock configuration, `patched`
every other one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20

_V1_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
# name -> (engine, extra environment, the stock configuration it is compared with)
CONFIGS: dict[str, tuple[str, dict[str, str], str]] = {
    "stock": ("stock", {}, "stock"),
    "per-layer": ("patched", {"KVCACHED_LAYOUT": "per-layer"}, "stock"),
    "contiguous": ("patched", {"KVCACHED_LAYOUT": "contiguous"}, "stock"),
    "stock-v1": ("stock", _V1_RUNNER, "stock-v1"),
    "v1": ("patched", {"KVCACHED_LAYOUT": "per-layer", **_V1_RUNNER}, "stock-v1"),
    "v1-contiguous": ("patched", {"KVCACHED_LAYOUT": "contiguous", **_V1_RUNNER}, "stock-v1"),
}


@dataclass(frozen=True)
class Workload:
    prefixes: int
    per_prefix: int
    prefix_tokens: int
    max_tokens: int
    block_size: int
    tight_blocks: int
    rounds: int
    idle_s: float

    def prompts(self, vocab: int) -> list[list[int]]:
        import random

        rng = random.Random(7)
        prompts = []
        for _ in range(self.prefixes):
            prefix = [rng.randrange(4, vocab) for _ in range(self.prefix_tokens)]
            for _ in range(self.per_prefix):
                tail = [rng.randrange(4, vocab) for _ in range(rng.randint(8, 48))]
                prompts.append(prefix + tail)
        return prompts


def kv_block_bytes_all_layers(model_dir: Path, block_size: int, dtype_bytes: int = 2) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    layers = int(config["num_hidden_layers"])
    return block_size * kv_heads * head_dim * 2 * dtype_bytes * layers


# ---------------------------------------------------------------------------------- child


class Sampler:
    """Samples device used bytes and kvcached's mapped bytes every `period_s` in a thread."""

    def __init__(self, read: Any, period_s: float = 0.05) -> None:
        self.read = read
        self.period_s = period_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.read())
            self._stop.wait(self.period_s)

    def peak(self, key: str) -> float:
        values = [s[key] for s in self.samples if s.get(key) is not None]
        return max(values) if values else -1.0


def _device_used_bytes() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return float(total - free)


def _pool() -> Any:
    try:
        from kvcached_core.integration.vllm import engine_pools
    except ImportError:
        return None
    pools = engine_pools()
    return pools[0].pool if pools else None


def run_child(args: argparse.Namespace) -> int:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    work = Workload(args.prefixes, args.per_prefix, args.prefix_tokens, args.max_tokens,
                    args.block_size, args.tight_blocks, args.rounds, args.idle_s)
    engine = CONFIGS[args.child][0]
    result: dict[str, Any] = {"config": args.child, "vllm": vllm.__version__,
                              "vllm_file": os.path.dirname(vllm.__file__)}

    def emit() -> None:
        print("RESULT_JSON " + json.dumps(result), flush=True)

    result["device_used_before"] = _device_used_bytes()
    kwargs: dict[str, Any] = dict(
        model=args.model, dtype="bfloat16", max_model_len=args.max_model_len,
        block_size=work.block_size, enable_prefix_caching=True, seed=0,
        disable_log_stats=False, enforce_eager=args.eager,
    )
    if args.device_kind == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_mem_util
    else:
        kwargs["kv_cache_memory_bytes"] = args.cpu_kv_bytes
    if engine == "stock":
        kwargs["num_gpu_blocks_override"] = work.tight_blocks
    kwargs.update(json.loads(args.llm_kwargs))
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result["engine_start_s"] = round(time.perf_counter() - started, 2)
    cache_config = llm.llm_engine.vllm_config.cache_config
    result["num_gpu_blocks"] = cache_config.num_gpu_blocks
    pool = _pool()
    result["elastic"] = pool is not None
    if engine == "patched" and pool is None:
        result["error"] = "the patched engine built no kvcached pool"
        emit()
        return 3

    def read() -> dict[str, float]:
        sample: dict[str, float] = {"t": time.monotonic()}
        used = _device_used_bytes()
        if used is not None:
            sample["device_used"] = used
        if pool is not None:
            sample["kv_mapped"] = float(pool.mapped_bytes())
        return sample

    vocab = int(llm.llm_engine.vllm_config.model_config.get_vocab_size())
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in work.prompts(vocab)]
    params = SamplingParams(temperature=0.0, max_tokens=work.max_tokens, ignore_eos=True)
    # Warm-up on a small batch (kernels, allocator), then idle: the engine's resting footprint.
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    time.sleep(work.idle_s)
    result["idle_before"] = read()
    emit()
    rounds: list[dict[str, Any]] = []
    outputs: list[list[int]] = []
    for index in range(work.rounds):
        snapshot_before = pool.snapshot() if pool is not None else None
        with Sampler(read) as sampler:
            t0 = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        snapshot_after = pool.snapshot() if pool is not None else None
        time.sleep(work.idle_s)
        idle = read()
        round_outputs = [list(r.outputs[0].token_ids) for r in results]
        if index == 0:
            outputs = round_outputs
        ttfts = sorted(r.metrics.first_token_latency for r in results
                       if r.metrics is not None
                       and getattr(r.metrics, "first_token_latency", None) is not None)
        entry: dict[str, Any] = {
            "seconds": seconds,
            "tokens": sum(len(o) for o in round_outputs),
            "ttft_p50": ttfts[len(ttfts) // 2] if ttfts else None,
            "full_length": all(len(o) == work.max_tokens for o in round_outputs),
            "same_as_first_round": round_outputs == outputs,
            "peak_device_used": sampler.peak("device_used"),
            "peak_kv_mapped": sampler.peak("kv_mapped"),
            "idle_after": idle,
            "samples": len(sampler.samples),
        }
        if snapshot_before is not None and snapshot_after is not None:
            hits = snapshot_after.reserve_hits - snapshot_before.reserve_hits
            misses = snapshot_after.reserve_misses - snapshot_before.reserve_misses
            maps = snapshot_after.map_calls - snapshot_before.map_calls
            map_ns = snapshot_after.map_ns_total - snapshot_before.map_ns_total
            entry.update(reserve_hits=hits, reserve_misses=misses, map_calls=maps,
                         map_ns=map_ns)
        rounds.append(entry)
        result["rounds"] = rounds
        emit()
    metrics: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            metrics[metric.name] = metrics.get(metric.name, 0.0) + float(value)
    result["preemptions"] = metrics.get("vllm:num_preemptions", -1.0)
    result["prefix_cache_hits"] = metrics.get("vllm:prefix_cache_hits", -1.0)
    if pool is not None:
        result["pool"] = {"page_bytes_all_layers": pool.geometry.page_bytes_all_layers,
                          "contiguous": pool.geometry.contiguous,
                          "layers": pool.geometry.num_layers}
    result["outputs"] = outputs
    result["ok"] = True
    emit()
    # Shut the engine core down (the patched one releases its pages and removes its pool
    # record), then leave without waiting for vLLM's background threads.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # reported; the measurements are already out
        print(f"engine shutdown failed: {exc!r}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------- parent


def _child_command(args: argparse.Namespace, config: str) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--child", config,
               "--model", args.model, "--device-kind", args.device_kind]
    for name in ("prefixes", "per_prefix", "prefix_tokens", "max_tokens", "block_size",
                 "tight_blocks", "rounds", "idle_s", "max_model_len", "gpu_mem_util",
                 "cpu_kv_bytes"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.eager:
        command.append("--eager")
    command += ["--llm-kwargs", args.llm_kwargs]
    return command


def run_config(args: argparse.Namespace, config: str, engines: dict[str, str],
               extra_env: dict[str, str]) -> dict[str, Any]:
    engine, config_env, _ = CONFIGS[config]
    env = dict(os.environ)
    env.update(extra_env)
    env.update(config_env)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if engine == "stock":
        env["KVCACHED_ENABLE"] = "0"
    else:
        limit = args.tight_blocks * kv_block_bytes_all_layers(Path(args.model), args.block_size)
        env["KVCACHED_PHYSICAL_LIMIT"] = str(limit)
        env.setdefault("KVCACHED_POOL_NAME", f"e2e-{config}-{os.getpid()}")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (engines[engine], env.get("PYTHONPATH", "")) if p)
    log_path = Path(args.out) / f"{config}.log"
    print(f"== {config}: starting ({engine} engine)", flush=True)
    started = time.perf_counter()
    result: dict[str, Any] = {"config": config, "ok": False}
    with log_path.open("w") as log:
        child = subprocess.Popen(_child_command(args, config), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env,
                                 start_new_session=True)
        timer = threading.Timer(args.timeout, lambda: os.killpg(child.pid, signal.SIGKILL))
        timer.start()
        try:
            assert child.stdout is not None
            for line in child.stdout:
                log.write(line)
                if line.startswith("RESULT_JSON "):
                    result = json.loads(line[len("RESULT_JSON "):])
                    print(f"   {config}: {_progress(result)}", flush=True)
        finally:
            rc = child.wait()
            timer.cancel()
    result["rc"] = rc
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if rc != 0 or not result.get("ok"):
        tail = log_path.read_text().splitlines()[-30:]
        result["log_tail"] = tail
        print(f"   {config}: FAILED rc={rc}\n      " + "\n      ".join(tail), flush=True)
    return result


def _progress(result: dict[str, Any]) -> str:
    rounds = result.get("rounds") or []
    if not rounds:
        return f"engine up in {result.get('engine_start_s')} s"
    last = rounds[-1]
    return (f"round {len(rounds)}: {last['tokens'] / last['seconds']:.0f} tok/s, "
            f"peak kv {last['peak_kv_mapped'] / MIB:.0f} MiB")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _measured(result: dict[str, Any]) -> list[dict[str, Any]]:
    rounds = result.get("rounds") or []
    return rounds[1:] if len(rounds) > 1 else rounds  # the first round warms caches


def summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> tuple[
        dict[str, Any], list[str]]:
    failures: list[str] = []
    summary: dict[str, Any] = {}
    for name, result in results.items():
        if not result.get("ok"):
            failures.append(f"{name}: did not finish (rc {result.get('rc')})")
            continue
        rounds = result["rounds"]
        measured = _measured(result)
        throughput = _median([r["tokens"] / r["seconds"] for r in measured])
        ttft = _median([r["ttft_p50"] for r in measured if r["ttft_p50"] is not None])
        entry: dict[str, Any] = {
            "throughput_tok_s": round(throughput, 1),
            "ttft_p50_ms": round(ttft * 1000, 2),
            "preemptions": result.get("preemptions"),
            "prefix_cache_hits": result.get("prefix_cache_hits"),
            "device_used_idle_before_mib": _mib(result["idle_before"].get("device_used")),
            "device_used_peak_mib": _mib(max(r["peak_device_used"] for r in rounds)),
            "device_used_idle_after_mib": _mib(rounds[-1]["idle_after"].get("device_used")),
        }
        if not all(r["full_length"] for r in rounds):
            failures.append(f"{name}: a request ended short")
        # Later rounds hit the prefix cache, which changes batch shapes and so bf16 rounding:
        # even stock need not repeat itself there. Reported, not judged.
        entry["rounds_repeating_round_1"] = sum(r["same_as_first_round"] for r in rounds)
        if result.get("elastic"):
            hits = sum(r.get("reserve_hits", 0) for r in rounds)
            misses = sum(r.get("reserve_misses", 0) for r in rounds)
            maps = sum(r.get("map_calls", 0) for r in rounds)
            map_ns = sum(r.get("map_ns", 0) for r in rounds)
            idle_before = result["idle_before"].get("kv_mapped", 0.0)
            peak = max(r["peak_kv_mapped"] for r in rounds)
            idle_after = [r["idle_after"].get("kv_mapped", 0.0) for r in rounds]
            entry.update(
                kv_mapped_idle_before_mib=_mib(idle_before),
                kv_mapped_peak_mib=_mib(peak),
                kv_mapped_idle_after_mib=_mib(idle_after[-1]),
                reserve_hit_rate=round(hits / (hits + misses), 3) if hits + misses else None,
                page_maps=maps,
                mean_map_us_per_page=round(map_ns / maps / 1000, 1) if maps else None,
                layout="contiguous" if result["pool"]["contiguous"] else "per-layer",
            )
            # Memory follows demand: grows in every burst, returns after every burst.
            grew = peak - idle_before
            if grew <= 0:
                failures.append(f"{name}: kvcached mapped bytes did not grow in the burst")
            for index, (r, after) in enumerate(zip(rounds, idle_after, strict=True)):
                returned = r["peak_kv_mapped"] - after
                if returned < 0.5 * (r["peak_kv_mapped"] - idle_before):
                    failures.append(
                        f"{name}: round {index + 1} kept {_mib(after)} of a "
                        f"{_mib(r['peak_kv_mapped'])} MiB peak after {args.idle_s} s idle")
            device_peak = max(r["peak_device_used"] for r in rounds)
            device_after = rounds[-1]["idle_after"].get("device_used")
            if device_after is not None and device_peak > 0:
                entry["device_returned_mib"] = _mib(device_peak - device_after)
                if device_peak - device_after < 0.5 * grew:
                    failures.append(f"{name}: the driver's free memory did not come back")
        elif CONFIGS[name][0] == "stock":
            device = [r["peak_device_used"] for r in rounds] + [
                r["idle_after"].get("device_used") or -1.0 for r in rounds]
            if device and min(device) > 0:
                entry["device_used_spread_mib"] = _mib(max(device) - min(device))
        baseline = CONFIGS[name][2]
        stock = results.get(baseline)
        if stock is not None and stock.get("ok") and name != baseline:
            same = sum(a == b for a, b in zip(result["outputs"], stock["outputs"], strict=True))
            entry["compared_with"] = baseline
            entry["identical_to_stock"] = f"{same}/{len(stock['outputs'])}"
            if same != len(stock["outputs"]):
                failures.append(f"{name}: {len(stock['outputs']) - same} outputs differ "
                                "from stock")
            stock_entry = summary[baseline]
            entry["throughput_ratio"] = round(throughput / stock_entry["throughput_tok_s"], 3)
            entry["ttft_ratio"] = round(ttft * 1000 / stock_entry["ttft_p50_ms"], 3)
        summary[name] = entry
    return summary, failures


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="gpu-e2e-out")
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--configs", default="stock,per-layer,contiguous,v1")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for every child")
    parser.add_argument("--device-kind", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tight-blocks", type=int, default=1024,
                        help="stock's block count and the patched engine's physical limit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-mem-util", type=float, default=0.3)
    parser.add_argument("--cpu-kv-bytes", type=int, default=64 * MIB)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--llm-kwargs", default="{}",
                        help="JSON object of extra LLM(...) arguments for every configuration")
    parser.add_argument("--timeout", type=float, default=240.0, help="per configuration")
    parser.add_argument("--map-floor", help="JSON written by bench_map_page.py --json")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args)

    engines: dict[str, str] = {}
    for item in args.engine:
        name, sep, path = item.partition("=")
        if not sep or name not in ("stock", "patched"):
            parser.error(f"--engine wants stock=PATH or patched=PATH, got {item!r}")
        engines[name] = path
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {sorted(CONFIGS)}")
    missing = sorted({CONFIGS[c][0] for c in configs} - set(engines))
    if missing:
        parser.error(f"no --engine for {missing}")
    extra_env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--env wants KEY=VALUE, got {item!r}")
        extra_env[key] = value
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for config in configs:
        results[config] = run_config(args, config, engines, extra_env)
        # Written after every configuration: a run cut short keeps what it measured.
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    summary, failures = summarize(results, args)
    if args.map_floor and Path(args.map_floor).exists():
        summary["map_floor"] = json.loads(Path(args.map_floor).read_text())
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    for line in failures:
        print(f"FAIL {line}")
    print("ok" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
