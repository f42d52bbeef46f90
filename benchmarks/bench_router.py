"""What a wake costs a request behind `kvrouter`, per sleep level, on patched vLLM CPU engines.

Two models of the same tiny Llama behind one router: `kv` sleeps at level kv (KV pages
unmapped, weights kept), `stop` at level stop (the process ends). Each round waits until both
engines idle into their sleep, then times one request to each (the wake is in it), then the
same request again on the engine now awake: the anchor. Printed per level: median and spread
of the request with its wake, of the anchor, their ratio, and the router's own wake time
(`kvrouter_wake_seconds`, the part of the request spent making the engine ready).

    python benchmarks/bench_router.py --engine-python /path/to/engine-venv/bin/python \\
        --rounds 10 --out router.json

`--engine-python` is a venv with `kvcached-vllm-cpu==0.32.0` installed by the README's line
(what the e2e fixture `engine_venv` builds); its `kvrouter` runs the router.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from router_process import get_json, running_router  # noqa: E402

from tests.e2e.router_setup import VLLM_ARGS, VLLM_ENV  # noqa: E402
from tests.e2e.vllm_cpu_env import (  # noqa: E402
    build_tiny_model,
    engine_env,
    write_hidden_packages_dir,
)

IDLE_SLEEP_S = 1.0
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def _complete(base: str, model: str) -> float:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    assert answer["usage"]["completion_tokens"] == 8, answer
    return time.perf_counter() - started


def _state(base: str, model: str) -> str:
    rows = get_json(f"{base}/router/status")["models"]
    return str(next(r["state"] for r in rows if r["model"] == model))


def _wake_seconds(base: str) -> dict[str, float]:
    """kvrouter_wake_seconds_sum per model, from /metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvrouter_wake_seconds_sum{"):
            model = line.split('model="', 1)[1].split('"', 1)[0]
            sums[model] = sums.get(model, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    hidden = write_hidden_packages_dir(work / "hidden")
    shm = work / "shm"
    shm.mkdir()
    model = build_tiny_model(args.engine_python, work / "model", engine_env(hidden, shm))
    env = {**VLLM_ENV, "PYTHONPATH": str(hidden)}
    entry = {"engine": "vllm", "python": str(args.engine_python), "model": str(model),
             "device": "cpu", "memory": "1GiB", "args": VLLM_ARGS, "env": env}
    port = 18000 + os.getpid() % 1000
    config = work / "router.yaml"
    config.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{port}", "shm_dir": str(shm), "idle_sleep_s": IDLE_SLEEP_S,
        "devices": [{"name": "cpu", "memory": "4GiB"}],
        "models": [{"name": "kv", "sleep": "kv", **entry},
                   {"name": "stop", "sleep": "stop", **entry}]}))
    kvrouter = Path(args.engine_python).parent / "kvrouter"
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("KVCACHED_", "VLLM_", "PYTHON"))}
    base = f"http://127.0.0.1:{port}"
    woken: dict[str, list[float]] = {"kv": [], "stop": []}
    awake: dict[str, list[float]] = {"kv": [], "stop": []}
    wake_part: dict[str, list[float]] = {"kv": [], "stop": []}
    with running_router([str(kvrouter), "serve", str(config)], clean, work / "router.log",
                        base):
        for name in ("kv", "stop"):  # the first start of each, not measured
            _complete(base, name)
        for round_index in range(args.rounds):
            for name, asleep in (("kv", "asleep"), ("stop", "stopped")):
                while _state(base, name) != asleep:
                    time.sleep(0.1)
                before = _wake_seconds(base).get(name, 0.0)
                woken[name].append(_complete(base, name))
                wake_part[name].append(_wake_seconds(base)[name] - before)
                awake[name].append(_complete(base, name))
            print(f"round {round_index + 1}/{args.rounds}: "
                  f"kv {woken['kv'][-1]:.3f} s (awake {awake['kv'][-1]:.3f} s), "
                  f"stop {woken['stop'][-1]:.1f} s (awake {awake['stop'][-1]:.3f} s)",
                  flush=True)
    levels = {}
    for name in ("kv", "stop"):
        levels[name] = {
            "request_with_wake_s": _summary(woken[name]),
            "request_awake_s": _summary(awake[name]),
            "ratio_median": statistics.median(woken[name]) / statistics.median(awake[name]),
            "router_wake_s": _summary(wake_part[name]),
        }
    return {"rounds": args.rounds, "machine": platform.node(), "cpus": os.cpu_count(),
            "levels": levels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-python", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = run(args)
    for name, level in result["levels"].items():
        w, a, r = level["request_with_wake_s"], level["request_awake_s"], level["router_wake_s"]
        print(f"level {name}: request with wake {w['median']:.3f} s "
              f"[{w['min']:.3f}-{w['max']:.3f}], awake {a['median']:.3f} s "
              f"[{a['min']:.3f}-{a['max']:.3f}], ratio {level['ratio_median']:.2f}x, "
              f"router wake {r['median'] * 1000:.2f} ms median")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
