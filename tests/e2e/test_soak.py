"""The soak, short: `benchmarks/soak.py` for two minutes, every fault at least twice (the run
goes on until it has seen them, on a host where the engines start again slowly).

Two patched vLLM CPU engines (B with two tensor-parallel worker processes) and, where an SGLang
cell is selected (the newest one by default), a patched SGLang CPU engine, under one budget:
random bursts and idle gaps, `kvctl limit` changed under load, an engine or one of B's workers
killed with SIGKILL mid-burst and the engine started again, a limit record corrupted on disk
(`benchmarks/soak.py` says what each check is). The scheduled workflow runs the same program
for an hour; this run keeps the program itself working in every landing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.proof_cells import ROOT

# `nox -s soak -- SECONDS` (the scheduled workflow) sets these: the long run, its report kept.
DURATION_S = float(os.environ.get("KVCACHED_SOAK_SECONDS", "120"))
OUT_DIR = os.environ.get("KVCACHED_SOAK_OUT")
KILL_EVERY_S = 35 if DURATION_S < 600 else 300  # at least two kills in the short run
CORRUPT_EVERY_S = 40 if DURATION_S < 600 else 120


def test_soak(engine_venv: Path, sglang_python: Path | None, tmp_path: Path) -> None:
    out = Path(OUT_DIR) if OUT_DIR else tmp_path / "out"
    # The engines' own IPC sockets live under TMPDIR and a socket path holds 107 bytes: a
    # short directory of its own, not pytest's (deep under a nox session's venv).
    short_tmp = Path(tempfile.mkdtemp(prefix="kvsoak-", dir="/tmp"))
    try:
        _soak(engine_venv, sglang_python, out, dict(os.environ, TMPDIR=str(short_tmp)))
    finally:
        shutil.rmtree(short_tmp, ignore_errors=True)


def _soak(engine_venv: Path, sglang_python: Path | None, out: Path,
          env: dict[str, str]) -> None:
    with_sglang = ["--sglang-python", str(sglang_python)] if sglang_python else []
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--engine-python",
         str(engine_venv), *with_sglang, "--duration", str(DURATION_S), "--kill-every",
         str(KILL_EVERY_S), "--corrupt-every", str(CORRUPT_EVERY_S), "--min-kills", "2",
         "--min-corruptions", "2", "--seed", "1", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=3 * DURATION_S + 900)
    report = out / "soak.json"
    assert report.exists(), (f"soak.py wrote no report (exit {run.returncode}):\n"
                             f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    summary = json.loads(report.read_text())
    assert run.returncode == 0 and summary["failures"] == [], (
        summary["failures"], run.stdout[-3000:], run.stderr[-3000:])
    # Every fault happened and the engines served between them.
    assert summary["kills"] >= 2 and summary["corruptions"] >= 2
    assert summary["worker_kills"] >= 1  # every other kill is one of B's two TP workers
    assert summary["limit_changes"] >= 1
    assert summary["engine_starts"] == len(summary["requests_by_engine"]) + summary["kills"]
    assert summary["requests"] > 100
    assert all(count > 10 for count in summary["requests_by_engine"].values())
    assert set(summary["requests_by_engine"]) == ({"a", "b", "c"} if sglang_python else
                                                  {"a", "b"})
    assert 0 < summary["peak_charged_over_budget"] <= 1.0
    assert (out / "soak_timeline.csv").stat().st_size > 0
