"""Build time per cell and for the whole matrix, cold and warm, and what sharing the codemods'
results between a cell's wheels saves, in one run.

    python benchmarks/bench_build_matrix.py [--cells vllm-0.9,vllm-0.32] [--share-cell vllm-0.32]
                                            [--share-repeat 3] [--json out.json]

* cold: a cache holding only the downloaded wheels (hard links to the forge cache's artifacts),
  no workspace: each wheel's sources are imported, then transformed, re-packed, meta wheels
  written. The download itself is network time and is left out (the sizes are printed).
* warm: the same builds again, the workspaces now cached.
* sharing: `--share-cell` built warm, alternately with the codemods' results shared between its
  wheels (what `build` does) and with every codemod run on every wheel (the anchor, as before
  `CodemodMemo`), `--share-repeat` times each; the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from forge.build import BuildResult, build_cell  # noqa: E402
from forge.fetch import default_cache_dir, fetch_artifact, resolve_index_url  # noqa: E402
from forge.matrix import load_matrix  # noqa: E402
from forge.transforms import CodemodMemo  # noqa: E402

MATRIX = ROOT / "matrix.toml"


class _NoSharing(CodemodMemo):
    """The anchor: a memo that never answers, so every wheel runs every codemod."""

    def get(self, key: tuple[object, ...]) -> None:
        return None


def _build(cell: str, cache: Path, dist: Path) -> tuple[float, BuildResult]:
    start = time.perf_counter()
    result = build_cell(cell, matrix_path=MATRIX, dist_dir=dist, cache_dir=cache,
                        progress=lambda line: None)
    return time.perf_counter() - start, result


def _step_sum(result: BuildResult, prefix: str) -> float:
    return sum(seconds for name, seconds in result.report.steps if name.startswith(prefix))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="", help="comma-separated cells (default: all)")
    parser.add_argument("--share-cell", default="vllm-0.32")
    parser.add_argument("--share-repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every figure here as JSON")
    args = parser.parse_args()

    matrix = load_matrix(MATRIX)
    names = [c for c in args.cells.split(",") if c] or [c.name for c in matrix.cells]
    real_cache = default_cache_dir()
    index = resolve_index_url(matrix)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="bench-build-matrix-", dir=real_cache.parent) as tmp:
        scratch = Path(tmp)
        cache = scratch / "cache"
        (cache / "artifacts").mkdir(parents=True)
        total_bytes = 0
        for name in names:
            for artifact in matrix.get_cell(name).wheel_artifacts:
                wheel = fetch_artifact(artifact, index_url=index, cache_dir=real_cache)
                total_bytes += wheel.stat().st_size
                for path in (wheel, wheel.with_name(wheel.name + ".verified")):
                    if path.exists():
                        os.link(path, cache / "artifacts" / path.name)
        print(f"{len(names)} cells, {total_bytes / 1e9:.2f} GB of upstream wheels "
              "(downloaded beforehand; not timed)", flush=True)
        for phase in ("cold", "warm"):
            for name in names:
                seconds, result = _build(name, cache, scratch / f"dist-{phase}")
                row = next((r for r in rows if r["cell"] == name), None)
                if row is None:
                    row = {"cell": name}
                    rows.append(row)
                row[phase] = round(seconds, 2)
                row[f"{phase}_workspace"] = round(_step_sum(result, "workspace"), 2)
                row[f"{phase}_transforms"] = round(_step_sum(result, "transforms"), 2)
                print(f"{phase:4} {name:14} {seconds:7.2f} s  (workspaces "
                      f"{row[f'{phase}_workspace']:.2f} s, transforms "
                      f"{row[f'{phase}_transforms']:.2f} s)", flush=True)
                shutil.rmtree(scratch / f"dist-{phase}")

        shared: list[float] = []
        unshared: list[float] = []
        for _ in range(args.share_repeat):
            seconds, _result = _build(args.share_cell, cache, scratch / "dist-share")
            shared.append(seconds)
            with mock.patch("forge.build.CodemodMemo", _NoSharing):
                seconds, _result = _build(args.share_cell, cache, scratch / "dist-share")
            unshared.append(seconds)
        shutil.rmtree(scratch / "dist-share", ignore_errors=True)

    cold = sum(float(r["cold"]) for r in rows)  # type: ignore[arg-type]
    warm = sum(float(r["warm"]) for r in rows)  # type: ignore[arg-type]
    print(f"whole matrix ({len(rows)} cells): cold {cold:.1f} s, warm {warm:.1f} s")
    ratio = statistics.median(shared) / statistics.median(unshared)
    print(f"{args.share_cell} warm, codemod results shared between its wheels: median "
          f"{statistics.median(shared):.2f} s ({', '.join(f'{t:.2f}' for t in shared)}); "
          f"every codemod on every wheel: {statistics.median(unshared):.2f} s "
          f"({', '.join(f'{t:.2f}' for t in unshared)}); ratio {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps({
            "cells": rows, "cold_total_s": round(cold, 1), "warm_total_s": round(warm, 1),
            "upstream_wheel_bytes": total_bytes, "share_cell": args.share_cell,
            "shared_s": shared, "unshared_s": unshared, "share_ratio": round(ratio, 3),
        }, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
