"""Build a cell from its cached upstream wheel, against `wheel unpack` + `wheel pack` of the
same wheel, in one run (target: ratio <= 0.1, tags kept).

    python benchmarks/bench_build.py [--cell vllm-0.9] [--repeat 5]

The cell's artifacts are fetched (and cached) first, so both sides start from a cached wheel.
Prints the median build time, the anchor's time, the ratio, and whether the tags survived.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from packaging.utils import parse_wheel_filename  # noqa: E402

from forge.build import build_cell  # noqa: E402
from forge.fetch import default_cache_dir, fetch_artifact, resolve_index_url  # noqa: E402
from forge.matrix import load_matrix  # noqa: E402

MATRIX = ROOT / "matrix.toml"


def time_build(cell: str, repeat: int, scratch: Path) -> list[float]:
    times = []
    for i in range(repeat + 1):  # the first run warms the workspace cache and is not counted
        dist = scratch / f"dist-{i}"
        start = time.perf_counter()
        build_cell(cell, matrix_path=MATRIX, dist_dir=dist, cache_dir=default_cache_dir(),
                   progress=lambda line: None)
        elapsed = time.perf_counter() - start
        if i:
            times.append(elapsed)
        shutil.rmtree(dist)
    return times


def time_unpack_pack(wheel: Path, scratch: Path) -> tuple[float, str]:
    unpacked, packed = scratch / "unpacked", scratch / "packed"
    packed.mkdir()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "wheel", "unpack", "-d", str(unpacked), str(wheel)],
                   check=True, capture_output=True)
    (tree,) = unpacked.iterdir()
    subprocess.run([sys.executable, "-m", "wheel", "pack", "-d", str(packed), str(tree)],
                   check=True, capture_output=True)
    elapsed = time.perf_counter() - start
    (out,) = packed.iterdir()
    return elapsed, out.name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="vllm-0.9")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    matrix = load_matrix(MATRIX)
    cell = matrix.get_cell(args.cell)
    wheel_artifact = next(a for a in cell.wheel_artifacts if a.role == "wheel")
    wheel = fetch_artifact(wheel_artifact, index_url=resolve_index_url(matrix),
                           cache_dir=default_cache_dir())

    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
        scratch = Path(tmp)
        builds = time_build(args.cell, args.repeat, scratch)
        result = build_cell(args.cell, matrix_path=MATRIX, dist_dir=scratch / "final",
                            cache_dir=default_cache_dir(), progress=lambda line: None)
        ours = next(w for w in result.wheels
                    if parse_wheel_filename(w.name)[0] == parse_wheel_filename(wheel.name)[0])
        anchor, anchor_name = time_unpack_pack(wheel, scratch)

    median = statistics.median(builds)
    upstream_tags = parse_wheel_filename(wheel.name)[3]
    print(f"cell {args.cell}: base {wheel.name} ({wheel.stat().st_size / 1e6:.0f} MB)")
    print(f"build (whole cell, all flavours + meta wheels), median of {len(builds)}: "
          f"{median:.2f} s  (runs: {', '.join(f'{t:.2f}' for t in builds)})")
    print(f"anchor: wheel unpack + wheel pack of the same wheel: {anchor:.1f} s")
    print(f"ratio build / anchor: {median / anchor:.4f}  (target <= 0.1)")
    kept = parse_wheel_filename(ours.name)[3] == upstream_tags
    print(f"tags kept by build: {kept} ({ours.name})")
    print(f"tags kept by anchor: {parse_wheel_filename(anchor_name)[3] == upstream_tags} "
          f"({anchor_name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
