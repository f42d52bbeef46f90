"""`kvtop`: a live terminal view of every elastic KV pool on this host.

    kvtop [--shm-dir DIR] [-n SECONDS]      # refreshing view; q (or Ctrl-C) quits
    kvtop --once [--json]                   # one screen, or one JSON document, for scripts

One row per pool: the engine that owns it, the model that engine serves, its owner pid, what it
maps (in use by blocks, and kept warm in its reserve), its limit and capacity, the budget its
process is charged to and the charge, the reserve's hit rate (new pages served already mapped)
and its state (live, stale: the owner died, corrupt: the record is being rewritten). Above the
rows, every budget with its charge. Everything is read from the shared-memory records the pools
publish (`kvcached_core/limits.py`, with their trailers) and the budget files
(`kvcached_core/budget.py`), in `--shm-dir`, else `KVCACHED_SHM_DIR`, else `/dev/shm`: kvtop
needs no engine's cooperation and changes nothing. The model is read from the command line of
the owner or of one of its parents (`vllm serve MODEL`, `--model`, `--model-path`); an engine
started in-process (`vllm.LLM(...)`) shows none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TextIO

from kvcached_core.budget import BudgetState, list_budgets
from kvcached_core.limits import read_about, scan_records, shm_dir
from kvcached_core.processes import ANCESTORS_SEARCHED, cmdline, descends_from, parent_of
from kvcached_core.settings import format_size

EXIT_OK = 0
EXIT_USAGE = 2
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen
_MODEL_OPTIONS = ("--model", "--model-path", "--model_path")


@dataclass(frozen=True)
class PoolView:
    """One pool as kvtop shows it (bytes; None where the record does not say)."""

    pool: str
    state: str  # live, stale or corrupt
    owner_pid: int | None
    engine: str
    model: str
    mapped_bytes: int | None
    in_use_bytes: int | None
    reserve_bytes: int | None
    limit_bytes: int | None
    capacity_bytes: int | None
    budget: str | None
    charged_bytes: int | None  # the owner's charge to its budget, or its workers' together
    reserve_hit_rate: float | None


@dataclass(frozen=True)
class Screen:
    directory: str
    taken_at: float
    pools: list[PoolView]
    budgets: list[BudgetState]


def model_in_command(argv: Sequence[str]) -> str:
    """The model a serving command line names, or ""."""
    for index, word in enumerate(argv):
        for option in _MODEL_OPTIONS:
            if word == option and index + 1 < len(argv):
                return argv[index + 1]
            if word.startswith(option + "="):
                return word.split("=", 1)[1]
        if word == "serve" and index + 1 < len(argv) and not argv[index + 1].startswith("-"):
            return argv[index + 1]
    return ""


def model_of(pid: int) -> str:
    """The model named on the command line of `pid` or of its nearest parent that names one."""
    for _ in range(ANCESTORS_SEARCHED):
        if pid <= 1:
            break
        found = model_in_command(cmdline(pid))
        if found:
            return found
        pid = parent_of(pid)
    return ""


def _charge_of(pid: int, charges: dict[int, tuple[str, int]]) -> tuple[str | None, int | None]:
    """The budget and charge of a pool's owner: its own slot, or the sum of its worker
    processes' slots (a tensor-parallel vLLM engine maps its pages in its workers)."""
    if pid in charges:
        return charges[pid]
    workers = [(name, charged) for member, (name, charged) in charges.items()
               if descends_from(member, pid)]
    if not workers:
        return None, None
    return workers[0][0], sum(charged for _, charged in workers)


def collect(directory: str | os.PathLike[str] | None = None) -> Screen:
    """Every pool record and budget in the directory, now."""
    base = shm_dir(directory)
    records, corrupt = scan_records(base)
    budgets = list_budgets(base)
    charges = {member.pid: (budget.name, member.charged_bytes)
               for budget in budgets for member in budget.members}
    models: dict[int, str] = {}
    pools: list[PoolView] = []
    for record in records:
        about = read_about(record.pool, base)
        pid = record.owner_pid
        if pid not in models:
            models[pid] = "" if record.stale else model_of(pid)
        budget, charged = (None, None) if record.stale else _charge_of(pid, charges)
        pools.append(PoolView(
            pool=record.pool, state="stale" if record.stale else "live", owner_pid=pid,
            engine=about.engine if about else "", model=models[pid],
            mapped_bytes=record.used_bytes + record.reserved_bytes,
            in_use_bytes=record.used_bytes, reserve_bytes=record.reserved_bytes,
            limit_bytes=record.limit_bytes, capacity_bytes=record.capacity_bytes,
            budget=budget, charged_bytes=charged,
            reserve_hit_rate=about.hit_rate if about else None))
    for entry in corrupt:  # its owner (if alive) rewrites it within a poll of its watcher
        pools.append(PoolView(entry.pool, "corrupt", entry.owner_pid, "", "", None, None, None,
                              None, None, None, None, None))
    pools.sort(key=lambda view: view.pool)
    return Screen(str(base), time.time(), pools, budgets)


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def render(screen: Screen, width: int = 160) -> str:
    """The screen as text: a title line, the budgets, then one row per pool."""
    clock = time.strftime("%H:%M:%S", time.localtime(screen.taken_at))
    lines = [f"kvtop  {clock}  {screen.directory}  {len(screen.pools)} pool(s)"
             f"  {len(screen.budgets)} budget(s)"]
    for budget in screen.budgets:
        charged = sum(member.charged_bytes for member in budget.members)
        share = f"{100.0 * charged / budget.capacity_bytes:.0f}%" if budget.capacity_bytes \
            else "-"
        lines.append(f"budget {budget.name}: {format_size(charged)} of "
                     f"{format_size(budget.capacity_bytes)} charged ({share}), "
                     f"{len(budget.members)} member(s)")
    lines.append("")
    header = ("POOL", "ENGINE", "MODEL", "PID", "MAPPED", "IN USE", "RESERVE", "LIMIT",
              "CAPACITY", "BUDGET", "CHARGED", "HIT%", "STATE")
    rows = [header]
    for view in screen.pools:
        rows.append((
            _shorten(view.pool, 32), view.engine or "-", _shorten(view.model, 28) or "-",
            str(view.owner_pid) if view.owner_pid is not None else "-",
            _size(view.mapped_bytes), _size(view.in_use_bytes), _size(view.reserve_bytes),
            _size(view.limit_bytes), _size(view.capacity_bytes), view.budget or "-",
            _size(view.charged_bytes),
            "-" if view.reserve_hit_rate is None else f"{100 * view.reserve_hit_rate:.1f}",
            view.state))
    if not screen.pools:
        lines.append(f"no pools in {screen.directory}")
    else:
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                  .rstrip()[:width] for row in rows]
    return "\n".join(lines)


def as_json(screen: Screen) -> str:
    return json.dumps({
        "directory": screen.directory, "time": screen.taken_at,
        "pools": [asdict(view) for view in screen.pools],
        "budgets": [{"name": b.name, "capacity_bytes": b.capacity_bytes,
                     "charged_bytes": sum(m.charged_bytes for m in b.members),
                     "members": [asdict(m) for m in b.members]} for b in screen.budgets],
    }, indent=1)


@contextlib.contextmanager
def _keys(stream: TextIO) -> Iterator[bool]:
    """Single keys from a terminal, without echo, while the view runs (False: not a terminal)."""
    if not stream.isatty():
        yield False
        return
    import termios
    import tty

    saved = termios.tcgetattr(stream.fileno())
    try:
        tty.setcbreak(stream.fileno())
        yield True
    finally:
        termios.tcsetattr(stream.fileno(), termios.TCSADRAIN, saved)


def _quit_pressed(stream: TextIO, timeout_s: float) -> bool:
    """Waits up to `timeout_s` for a key; True when it is q (or the input closed)."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    if not ready:
        return False
    key = os.read(stream.fileno(), 1)
    return key in (b"q", b"Q", b"")


def run_view(directory: str | None, interval_s: float, out: TextIO, keys: TextIO) -> int:
    with _keys(keys) as interactive:
        while True:
            width = os.get_terminal_size(out.fileno()).columns if out.isatty() else 160
            out.write(_CLEAR + render(collect(directory), width) + "\n\n"
                      + ("q quits" if interactive else "Ctrl-C quits") + "\n")
            out.flush()
            if interactive:
                if _quit_pressed(keys, interval_s):
                    return EXIT_OK
            else:
                time.sleep(interval_s)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"kvtop: {message}")


class _UsageError(Exception):
    pass


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    parser = _Parser(prog="kvtop", description="A live view of the KV pools on this host.")
    parser.add_argument("--shm-dir", help="record directory (default: $KVCACHED_SHM_DIR or "
                        "/dev/shm)")
    parser.add_argument("-n", "--interval", type=float, default=1.0,
                        help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one screen and exit")
    parser.add_argument("--json", action="store_true", help="with --once: one JSON document")
    try:
        args = parser.parse_args(argv)
        if args.json and not args.once:
            raise _UsageError("kvtop: --json needs --once (one document for a script)")
        if args.interval <= 0:
            raise _UsageError(f"kvtop: invalid interval {args.interval} (seconds > 0)")
    except _UsageError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    if args.once:
        screen = collect(args.shm_dir)
        out.write((as_json(screen) if args.json else render(screen)) + "\n")
        return EXIT_OK
    try:
        return run_view(args.shm_dir, args.interval, out, sys.stdin)
    except KeyboardInterrupt:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
