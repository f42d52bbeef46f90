"""CI time of a landing: `bash .ci/run` on a fresh clone, as CI runs it, timed by phase.

    python benchmarks/bench_ci.py [--rev HEAD] [--cold | --warm] [--keep DIR] [--json out.json]

The anchor is the limit (5,400 s) and the target 1,800 s. The clone is made from `--rev` of this
repository into a new folder; `CI=true` as on the CI machine. `--cold` (the default) gives the
run caches of its own (pip's through XDG_CACHE_HOME, the forge cache through
KVCACHED_FORGE_CACHE), so every download, venv and build happens as on a fresh machine; `--warm`
uses this machine's caches. Printed: the total, the time of each nox session and of the heavy
environments the tests build, and pytest's 20 slowest tests (the tests session prints them).
The machine should be otherwise idle: a concurrent build inflates every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 5400
TARGET_S = 1800
_SESSION = re.compile(r"^nox > Session (\S+) (was successful|failed|aborted)[^\n]*?"
                      r"(?: in (?:(\d+) minutes?)?(?: and )?(?:(\d+) seconds?)?)?\.?$")
_DURATION = re.compile(r"^(\d+\.\d+)s (call|setup|teardown)\s+(\S+)")


def run_ci(clone: Path, env: dict[str, str], log: Path) -> tuple[int, float]:
    began = time.monotonic()
    with log.open("w", encoding="utf-8") as sink:
        done = subprocess.run(["bash", ".ci/run"], cwd=clone, env=env, stdout=sink,
                              stderr=subprocess.STDOUT, check=False)
    return done.returncode, time.monotonic() - began


def sessions(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = _SESSION.match(line.strip())
        if match:
            minutes, seconds = int(match.group(3) or 0), int(match.group(4) or 0)
            found[match.group(1)] = f"{match.group(2)}, {minutes * 60 + seconds} s"
    return found


def slowest(text: str) -> list[tuple[float, str, str]]:
    rows = []
    for line in text.splitlines():
        match = _DURATION.match(line.strip())
        if match:
            rows.append((float(match.group(1)), match.group(2), match.group(3)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--cold", action="store_true", default=True)
    mode.add_argument("--warm", action="store_true")
    parser.add_argument("--keep", type=Path, default=None,
                        help="run in this folder and keep it (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    work = args.keep or Path(tempfile.mkdtemp(prefix="kvcached-bench-ci-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    clone = work / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-local", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", args.rev], check=True)
    revision = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    env = {**os.environ, "CI": "true"}
    if not args.warm:
        env["XDG_CACHE_HOME"] = str(work / "cache")
        env["KVCACHED_FORGE_CACHE"] = str(work / "cache" / "kvcached-forge")
    log = work / "ci.log"
    print(f"bash .ci/run on {revision} ({'warm' if args.warm else 'cold'} caches), log {log}",
          flush=True)
    status, seconds = run_ci(clone, env, log)
    text = log.read_text(encoding="utf-8", errors="replace")
    summary = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    result = {"revision": revision, "caches": "warm" if args.warm else "cold",
              "exit_status": status, "seconds": round(seconds), "summary": summary,
              "ratio_to_target": round(seconds / TARGET_S, 2),
              "ratio_to_limit": round(seconds / LIMIT_S, 2), "sessions": sessions(text),
              "slowest": [{"seconds": s, "phase": p, "test": t} for s, p, t in slowest(text)]}
    print(f"exit status {status}; {seconds:.0f} s = {result['ratio_to_target']} x the "
          f"{TARGET_S} s target, {result['ratio_to_limit']} x the {LIMIT_S} s limit")
    for name, outcome in result["sessions"].items():
        print(f"  session {name}: {outcome}")
    print(f"  last line: {summary}")
    for row in result["slowest"]:
        print(f"  {row['seconds']:8.1f} s {row['phase']:<8} {row['test']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
