"""`kvctl`: list and limit the KV pools on this host.

    kvctl list [--json] [--gc]
    kvctl limit POOL SIZE [--revision R]
    kvctl limit-percent POOL PCT [--revision R]
    kvctl watch [-n SECONDS] [--count N]
    kvctl delete POOL [--force]
    kvctl budget set NAME SIZE
    kvctl budget show NAME [--json]
    kvctl budget list [--json]
    kvctl budget delete NAME [--force]

`list` shows every pool and then every shared budget (its capacity, what its live members
charge, and their pids). Records and budgets live in `--shm-dir`, else `KVCACHED_SHM_DIR`,
else `/dev/shm`. Errors print one line to stderr and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from kvcached_core.budget import (
    BudgetState,
    delete_budget,
    list_budgets,
    read_budget,
    set_budget,
)
from kvcached_core.errors import KVCachedError
from kvcached_core.limits import (
    CorruptRecord,
    LimitRecord,
    collect_stale,
    delete_record,
    read_record,
    scan_records,
    set_limit,
    shm_dir,
)
from kvcached_core.settings import format_size, parse_size

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"kvctl: {message}")


class _UsageError(Exception):
    pass


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvctl", description="Inspect and limit kvcached KV pools.")
    parser.add_argument(
        "--shm-dir", help="record directory (default: $KVCACHED_SHM_DIR or /dev/shm)"
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    show = commands.add_parser("list", help="show every pool")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.add_argument("--gc", action="store_true", help="remove stale records first")

    limit = commands.add_parser("limit", help="set a pool's memory limit")
    limit.add_argument("pool")
    limit.add_argument("size", help="bytes, e.g. 512M, 2G, 1.5GiB, 1_000_000 (binary units)")
    limit.add_argument("--revision", type=int, help="refuse if the record moved on")

    percent = commands.add_parser("limit-percent", help="limit to a percentage of capacity")
    percent.add_argument("pool")
    percent.add_argument("percent", help="0-100")
    percent.add_argument("--revision", type=int, help="refuse if the record moved on")

    watch = commands.add_parser("watch", help="print the table repeatedly")
    watch.add_argument("-n", "--interval", type=float, default=1.0, help="seconds between updates")
    watch.add_argument("--count", type=int, default=0, help="stop after N updates (0: forever)")

    delete = commands.add_parser("delete", help="remove a pool's record")
    delete.add_argument("pool")
    delete.add_argument("--force", action="store_true", help="even if its owner is alive")

    budget = commands.add_parser("budget", help="memory budgets shared by pools on this host")
    budget_commands = budget.add_subparsers(dest="budget_command", required=True,
                                            parser_class=_Parser)
    budget_set = budget_commands.add_parser("set", help="create a budget or change its size")
    budget_set.add_argument("name")
    budget_set.add_argument("size", help="bytes, e.g. 512M, 2G (binary units)")
    budget_show = budget_commands.add_parser("show", help="one budget and its members")
    budget_show.add_argument("name")
    budget_show.add_argument("--json", action="store_true", help="machine-readable output")
    budget_list = budget_commands.add_parser("list", help="every budget")
    budget_list.add_argument("--json", action="store_true", help="machine-readable output")
    budget_delete = budget_commands.add_parser("delete", help="remove a budget")
    budget_delete.add_argument("name")
    budget_delete.add_argument("--force", action="store_true", help="even with live members")
    return parser


def _percent(used: int, limit: int) -> str:
    return f"{100.0 * used / limit:.1f}%" if limit else "-"


def _render_table(records: Sequence[LimitRecord], corrupt: Sequence[CorruptRecord] = ()) -> str:
    header = ("POOL", "LIMIT", "USED", "RESERVED", "USED%", "CAPACITY", "REV", "PID", "STATE")
    rows = [header]
    for record in records:
        rows.append(
            (
                record.pool,
                format_size(record.limit_bytes),
                format_size(record.used_bytes),
                format_size(record.reserved_bytes),
                _percent(record.used_bytes, record.limit_bytes),
                format_size(record.capacity_bytes),
                str(record.revision),
                str(record.owner_pid),
                "stale" if record.stale else "live",
            )
        )
    for entry in corrupt:
        # A corrupt record has no figures; its owner (if alive) rewrites it within a poll.
        pid = str(entry.owner_pid) if entry.owner_pid is not None else "unknown"
        rows.append((entry.pool, "-", "-", "-", "-", "-", "-", pid, "corrupt"))
    rows[1:] = sorted(rows[1:], key=lambda row: row[0])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _render_budgets(budgets: Sequence[BudgetState]) -> str:
    header = ("BUDGET", "CAPACITY", "CHARGED", "FREE", "CHARGED%", "MEMBERS")
    rows = [header]
    for budget in budgets:
        members = ",".join(str(member.pid) for member in budget.members) or "-"
        rows.append(
            (
                budget.name,
                format_size(budget.capacity_bytes),
                format_size(budget.charged_bytes),
                format_size(budget.free_bytes),
                _percent(budget.charged_bytes, budget.capacity_bytes),
                members,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _budget_dict(budget: BudgetState) -> dict[str, object]:
    return {
        "name": budget.name,
        "capacity_bytes": budget.capacity_bytes,
        "charged_bytes": budget.charged_bytes,
        "free_bytes": budget.free_bytes,
        "revision": budget.revision,
        "members": [asdict(member) for member in budget.members],
    }


def _record_dict(record: LimitRecord) -> dict[str, object]:
    data: dict[str, object] = asdict(record)
    data["stale"] = record.stale
    return data


def _corrupt_dict(entry: CorruptRecord) -> dict[str, object]:
    return {"pool": entry.pool, "corrupt": True, "reason": entry.reason,
            "owner_pid": entry.owner_pid, "stale": entry.stale}


def _cmd_list(args: argparse.Namespace, directory: Path, out: TextIO) -> int:
    if args.gc:
        for removed in collect_stale(directory):
            kind = "corrupt" if removed.reason.startswith("corrupt") else "stale"
            pid = removed.owner_pid if removed.owner_pid is not None else "unknown"
            print(f"removed {kind} pool {removed.pool} (pid {pid}): {removed.reason}",
                  file=sys.stderr)
    records, corrupt = scan_records(directory)
    if args.json:  # pools only, as always; budgets: `kvctl budget list --json`
        entries = [_record_dict(r) for r in records] + [_corrupt_dict(c) for c in corrupt]
        json.dump(sorted(entries, key=lambda entry: str(entry["pool"])), out, indent=2)
        out.write("\n")
        return EXIT_OK
    if records or corrupt:
        out.write(_render_table(records, corrupt) + "\n")
    else:
        out.write(f"no pools in {directory}\n")
    budgets = list_budgets(directory)
    if budgets:
        out.write("\n" + _render_budgets(budgets) + "\n")
    return EXIT_OK


def _cmd_budget(args: argparse.Namespace, directory: Path, out: TextIO) -> int:
    command = args.budget_command
    if command == "set":
        try:
            size = parse_size(args.size)
        except ValueError as exc:
            raise _CommandError(str(exc)) from None
        budget = set_budget(args.name, size, directory=directory)
        out.write(f"budget {budget.name}: capacity {format_size(budget.capacity_bytes)}, "
                  f"{format_size(budget.charged_bytes)} charged by "
                  f"{len(budget.members)} member(s)\n")
        if budget.charged_bytes > budget.capacity_bytes:
            out.write(f"budget {budget.name}: over capacity; new pages are refused until "
                      "members free memory\n")
        return EXIT_OK
    if command == "delete":
        budget = delete_budget(args.name, force=args.force, directory=directory)
        out.write(f"deleted budget {budget.name} ({len(budget.members)} live member(s))\n")
        return EXIT_OK
    budgets = [read_budget(args.name, directory)] if command == "show" else list_budgets(
        directory)
    if args.json:
        data: object = (_budget_dict(budgets[0]) if command == "show"
                        else [_budget_dict(b) for b in budgets])
        json.dump(data, out, indent=2)
        out.write("\n")
    elif budgets:
        out.write(_render_budgets(budgets) + "\n")
    else:
        out.write(f"no budgets in {directory}\n")
    return EXIT_OK


def _cmd_limit(args: argparse.Namespace, directory: Path, out: TextIO) -> int:
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        raise _CommandError(str(exc)) from None
    return _apply_limit(args.pool, size, args.revision, directory, out)


def _cmd_limit_percent(args: argparse.Namespace, directory: Path, out: TextIO) -> int:
    try:
        percent = float(args.percent.rstrip("%"))
    except ValueError:
        raise _CommandError(f"invalid percent {args.percent!r} (a number from 0 to 100)") from None
    if not 0 <= percent <= 100:
        raise _CommandError(f"invalid percent {args.percent!r} (a number from 0 to 100)")
    capacity = read_record(args.pool, directory).capacity_bytes
    return _apply_limit(args.pool, int(capacity * percent / 100), args.revision, directory, out)


def _apply_limit(pool: str, size: int, revision: int | None, directory: Path, out: TextIO) -> int:
    record = set_limit(pool, size, expected_revision=revision, directory=directory)
    note = " (clamped to capacity)" if record.limit_bytes < size else ""
    out.write(
        f"{pool}: limit {format_size(record.limit_bytes)}{note}, revision {record.revision}\n"
    )
    if record.used_bytes > record.limit_bytes:
        out.write(
            f"{pool}: {format_size(record.used_bytes)} in use; the pool shrinks as blocks free\n"
        )
    return EXIT_OK


def _cmd_watch(args: argparse.Namespace, directory: Path, out: TextIO) -> int:
    if args.interval <= 0:
        raise _CommandError(f"invalid interval {args.interval} (seconds > 0)")
    shown = 0
    while True:
        records, corrupt = scan_records(directory)
        out.write(time.strftime("%H:%M:%S") + "\n")
        table = _render_table(records, corrupt) if records or corrupt else ""
        out.write((table or f"no pools in {directory}") + "\n\n")
        out.flush()
        shown += 1
        if args.count and shown >= args.count:
            return EXIT_OK
        time.sleep(args.interval)


def _cmd_delete(args: argparse.Namespace, directory: Path, out: TextIO) -> int:
    record = delete_record(args.pool, force=args.force, directory=directory)
    state = "stale" if record.stale else "live"
    out.write(f"deleted pool {record.pool} ({state}, pid {record.owner_pid})\n")
    return EXIT_OK


class _CommandError(Exception):
    pass


_COMMANDS = {
    "list": _cmd_list,
    "limit": _cmd_limit,
    "limit-percent": _cmd_limit_percent,
    "watch": _cmd_watch,
    "delete": _cmd_delete,
    "budget": _cmd_budget,
}


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run one kvctl command; returns the exit status."""
    stdout = out if out is not None else sys.stdout
    try:
        args = _build_parser().parse_args(argv)
    except _UsageError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    try:
        directory = shm_dir(args.shm_dir)
        return _COMMANDS[args.command](args, directory, stdout)
    except (_CommandError, KVCachedError, ValueError) as exc:
        print(f"kvctl {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
