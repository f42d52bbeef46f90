"""Turn `nox -l --json` into a CI job matrix.

    python ci/matrix.py [--tag build] [--tag supported] > matrix.json

prints {"include": [{"session": ..., "tags": [...]}, ...]} with every session that carries
all the given tags, so a CI system runs one job per matrix cell without knowing matrix.toml.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def nox_sessions() -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "--json"], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def select(sessions: list[dict], tags: list[str]) -> list[dict]:
    return [
        {"session": s["session"], "tags": s.get("tags", [])}
        for s in sessions
        if all(t in s.get("tags", []) for t in tags)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", action="append", default=[], help="keep sessions with this tag")
    args = parser.parse_args(argv)
    json.dump({"include": select(nox_sessions(), args.tag)}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
