"""Allocate + free 16 blocks: BlockLedger vs vLLM 0.32.0's own BlockPool, in one run.

Target: median(BlockLedger) <= 1.2 x median(BlockPool).

How vLLM's BlockPool is loaded: the pinned sdist `vllm-0.32.0.tar.gz` (sha256 verified) is
unpacked into the cache dir, and its `vllm/` tree is put on `sys.path` of a subprocess that runs
in a separate virtualenv under the cache dir. That venv sees this interpreter's site-packages
(torch, numpy) through a .pth file and holds only the small pure-Python packages that importing
`vllm.v1.core.block_pool` needs (no vLLM wheel, no compiled vLLM code, no stubs). The real
BlockPool class is then timed as-is (prefix caching off, the scheduler's common case).

    python benchmarks/bench_alloc_free.py --sdist /path/to/vllm-0.32.0.tar.gz
    python benchmarks/bench_alloc_free.py            # reuses the cache dir

The cache dir is `--cache-dir`, else `$KVCACHED_BENCH_CACHE`, else `<repo>/.cache/bench`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SDIST_NAME = "vllm-0.32.0.tar.gz"
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
TARGET_RATIO = 1.2
# What importing vllm.v1.core.block_pool pulls in (found by importing it in a bare venv).
BLOCK_POOL_DEPS = [
    "regex",
    "psutil",
    "pyzmq",
    "msgspec",
    "pydantic",
    "cbor2",
    "transformers",
    "aiohttp",
    "openai-harmony",
    "openai",
    "pillow",
    "pybase64",
    "cachetools",
    "cloudpickle",
    "uvloop",
    "py-cpuinfo",
    "xgrammar",
    "fastapi",
    "partial-json-parser",
    "llguidance",
]

_BLOCK_POOL_TIMER = r"""
import gc, json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from vllm.v1.core.block_pool import BlockPool
blocks, rounds, warmup = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pool = BlockPool(num_gpu_blocks=4096, enable_caching=False, hash_block_size=16)
clock = time.perf_counter_ns
samples = []
gc.disable()
for i in range(warmup + rounds):
    start = clock()
    got = pool.get_new_blocks(blocks)
    pool.free_blocks(got)
    end = clock()
    if i >= warmup:
        samples.append(end - start)
gc.enable()
p90 = sorted(samples)[int(0.9 * len(samples))]
print(json.dumps({"median_ns": statistics.median(samples), "p90_ns": p90}))
"""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ensure_sdist(cache: Path, given: Path | None) -> Path:
    target = cache / SDIST_NAME
    if given is not None and not target.exists():
        shutil.copyfile(given, target)
    if not target.exists():
        raise SystemExit(
            f"{target} is missing: pass --sdist PATH (the PyPI sdist of vllm 0.32.0, sha256 "
            f"{SDIST_SHA256})"
        )
    actual = sha256_of(target)
    if actual != SDIST_SHA256:
        raise SystemExit(f"{target}: sha256 {actual}, expected {SDIST_SHA256}")
    return target


def ensure_tree(cache: Path, sdist: Path) -> Path:
    root = cache / "vllm-0.32.0"
    if (root / "vllm" / "v1" / "core" / "block_pool.py").exists():
        return root
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith("vllm-0.32.0/vllm/")]
        archive.extractall(cache, members=members, filter="data")
    return root


def ensure_venv(cache: Path) -> Path:
    env_dir = cache / "blockpool-venv"
    python = env_dir / "bin" / "python"
    marker = env_dir / ".deps-installed"
    if marker.exists():
        return python
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    site = next(Path(p) for p in sys.path if p.endswith("site-packages"))
    site_dir = next((env_dir / "lib").glob("python*/site-packages"))
    (site_dir / "base_site.pth").write_text(f"{site}\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", *BLOCK_POOL_DEPS], check=True)
    marker.write_text("\n".join(BLOCK_POOL_DEPS) + "\n")
    return python


def time_block_pool(python: Path, tree: Path, blocks: int, rounds: int, warmup: int) -> dict:
    done = subprocess.run(
        [str(python), "-c", _BLOCK_POOL_TIMER, str(tree), str(blocks), str(rounds), str(warmup)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"timing vLLM BlockPool failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_manager(blocks: int, rounds: int, warmup: int) -> dict:
    import gc

    from kvcached_core import _C
    from kvcached_core.ledger import BlockLedger

    page = 2 << 20
    block_bytes = 16 * 8 * 128 * 2  # 16 tokens, 8 KV heads, head dim 128, bf16: 32 KiB
    backend = _C.HostBackend(0)
    ftensors = _C.FTensorAllocator(backend, page, False)
    ftensors.create_kv_tensors(64 * page, 1, 2)
    pages = _C.PageAllocator(ftensors, 2, 4, True)
    manager = BlockLedger(pages, block_bytes, page)
    clock = time.perf_counter_ns
    samples = []
    gc.disable()
    try:
        for i in range(warmup + rounds):
            start = clock()
            got = manager.alloc(blocks)
            manager.free(got)
            end = clock()
            if i >= warmup:
                samples.append(end - start)
    finally:
        gc.enable()
        manager.shutdown()
    return {
        "median_ns": statistics.median(samples),
        "p90_ns": sorted(samples)[int(0.9 * len(samples))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--sdist", type=Path, help=f"path to {SDIST_NAME}")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    args = parser.parse_args(argv)
    cache = args.cache_dir or Path(
        os.environ.get("KVCACHED_BENCH_CACHE") or REPO / ".cache" / "bench"
    )
    cache.mkdir(parents=True, exist_ok=True)
    sdist = ensure_sdist(cache, args.sdist)
    tree = ensure_tree(cache, sdist)
    python = ensure_venv(cache)

    # Interleave the two so that machine noise hits both alike; report the best of 3 medians.
    ours, theirs = [], []
    for _ in range(3):
        theirs.append(time_block_pool(python, tree, args.blocks, args.rounds, args.warmup))
        ours.append(time_manager(args.blocks, args.rounds, args.warmup))
    ours_ns = min(r["median_ns"] for r in ours)
    theirs_ns = min(r["median_ns"] for r in theirs)
    ratio = ours_ns / theirs_ns
    result = {
        "blocks": args.blocks,
        "rounds": args.rounds,
        "kvcached_manager_median_us": round(ours_ns / 1000, 3),
        "vllm_block_pool_median_us": round(theirs_ns / 1000, 3),
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
    }
    print(json.dumps(result, indent=2))
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
