"""Sleep levels behind `kvrouter` on one GPU: what each gives back and what waking costs.

Two random-weight 8b Llamas (dummy weights, eager) on patched vLLM engines behind one router:
`kv-8b` sleeps at level kv (KV pages unmapped, weights kept), `weights-8b` at level weights
(also vLLM's own sleep mode, level 1: weights to host memory; `--enable-sleep-mode`). Each
round, for each model: a burst of `--burst` requests through the router (the first round's
answers are the reference), the engine put to sleep by the operator route, then the same burst
again, which wakes it. Measured per level: device memory (NVML) the sleep gave back, the
router's wake time, the burst's time after a wake against the burst on the awake engine, and
whether every answer equals the reference.

    PYTHONPATH=<vllm site>:<repo> python3 benchmarks/gpu_router_levels.py \\
        --tokenizer-model <tiny model dir> --site <vllm site> --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from gpu_router import _post, device_total, device_used  # noqa: E402
from make_random_llama import make, parameters  # noqa: E402
from router_process import running_router  # noqa: E402

GIB = 1 << 30
LEVELS = {"kv-8b": "kv", "weights-8b": "weights"}


def _wake_sum(base: str, model: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvrouter_wake_seconds_sum{")
               and 'kind="wake"' in line and f'model="{model}"' in line)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    out = args.out
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    total = device_total()
    env = {"PYTHONPATH": f"{args.site}{os.pathsep}{REPO}", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "VLLM_LOGGING_LEVEL": "WARNING", "KVCACHED_ENABLE": "1"}
    models = []
    for name, level in LEVELS.items():
        config = make(args.tokenizer_model, work / name, "8b")
        weights = 2 * parameters(config)
        entry = {"name": name, "engine": "vllm", "python": sys.executable,
                 "model": str(work / name), "device": "gpu0", "memory": weights + 3 * GIB,
                 "sleep": level, "env": env,
                 "args": ["--load-format", "dummy", "--enforce-eager", "--max-model-len",
                          "4096", "--seed", "0", "--gpu-memory-utilization", "0.9"]}
        if level == "weights":
            entry["args"].append("--enable-sleep-mode")
            entry["memory_asleep"] = 2 * GIB
        models.append(entry)
    config_path = work / "router.yaml"
    config_path.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{args.port}", "log_dir": str(work / "logs"),
        "shm_dir": str(work / "shm"), "idle_sleep_s": 0, "request_wait_s": 600,
        "devices": [{"name": "gpu0", "memory": int(0.9 * total), "cuda_visible_devices": "0"}],
        "models": models}))
    base = f"http://127.0.0.1:{args.port}"
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(args.prompt)] for _ in range(args.burst)]
    result: dict[str, Any] = {"device_total": total, "levels": {}}

    def burst(name: str) -> tuple[float, list[str]]:
        began = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: _post(f"{base}/v1/completions", {
                "model": name, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True})["choices"][0]["text"], prompts))
        return time.monotonic() - began, answers

    try:
        serve = [sys.executable, "-m", "kvcached_core.router.cli", "serve", str(config_path)]
        with running_router(serve, dict(os.environ), out / "router.log", base):
            for name in LEVELS:
                _post(f"{base}/router/models/{name}/wake")
            for name, level in LEVELS.items():
                rows: list[dict[str, Any]] = []
                awake_s, reference = burst(name)
                for _ in range(args.rounds):
                    awake_s, answers = burst(name)
                    used_awake = device_used()
                    _post(f"{base}/router/models/{name}/sleep")
                    time.sleep(1)
                    used_asleep = device_used()
                    before = _wake_sum(base, name)
                    woken_s, woken = burst(name)
                    rows.append({"awake_burst_s": awake_s, "woken_burst_s": woken_s,
                                 "freed_gib": (used_awake - used_asleep) / GIB,
                                 "router_wake_s": _wake_sum(base, name) - before,
                                 "same_tokens": woken == reference and answers == reference})
                    print(f"{name}: freed {rows[-1]['freed_gib']:.2f} GiB, wake "
                          f"{rows[-1]['router_wake_s'] * 1000:.1f} ms, burst {woken_s:.2f} s "
                          f"after the wake vs {awake_s:.2f} s awake, same tokens "
                          f"{rows[-1]['same_tokens']}", flush=True)
                result["levels"][level] = {
                    "rounds": rows,
                    "freed_gib_median": statistics.median(r["freed_gib"] for r in rows),
                    "router_wake_s_median": statistics.median(r["router_wake_s"] for r in rows),
                    "woken_over_awake_median": statistics.median(
                        r["woken_burst_s"] / r["awake_burst_s"] for r in rows),
                    "same_tokens": all(r["same_tokens"] for r in rows)}
    finally:
        (out / "levels.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-model", type=Path, required=True)
    parser.add_argument("--site", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    result = run(parser.parse_args(argv))
    print(json.dumps({level: {k: v for k, v in data.items() if k != "rounds"}
                      for level, data in result["levels"].items()}))
    return 0 if all(d["same_tokens"] for d in result["levels"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
