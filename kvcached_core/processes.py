"""The host's process tree, read from /proc: who owns a pool, and which engine it belongs to.

A pool's record names its owner process. That owner is rarely the process a person started:
vLLM's engine core and workers, SGLang's scheduler, are children of the server. `kvtop` and the
router walk up from the owner to find the server (and its command line) a pool belongs to.
"""

from __future__ import annotations

from pathlib import Path

# The owner, its engine process, the server, a launcher: deeper trees are not engines' own.
ANCESTORS_SEARCHED = 4
# /proc states of a process that has exited: a zombie (not yet reaped) or dead.
_EXITED = ("Z", "X")


def _stat_after_name(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state, ppid, pgrp, ...); [] where the
    process is gone. The name (in parentheses) may hold spaces: the fields after it are plain."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat.rsplit(")", 1)[1].split()


def state_of(pid: int) -> str:
    """The process's state letter (R, S, D, Z ...), or "" where it is gone."""
    fields = _stat_after_name(pid)
    return fields[0] if fields else ""


def has_exited(pid: int) -> bool:
    """The process is gone or a zombie. A zombie holds no memory and runs no code, but its pid
    answers signals until its parent reaps it; an orphan's parent (the container's first
    process, often a shell) may never reap it, so a zombie counts as exited."""
    state = state_of(pid)
    return not state or state in _EXITED


def group_members(group: int) -> list[int]:
    """The processes of process group `group` that have not exited (zombies left out)."""
    members = []
    for entry in Path("/proc").iterdir():
        fields = _stat_after_name(int(entry.name)) if entry.name.isdigit() else []
        if fields and int(fields[2]) == group and fields[0] not in _EXITED:
            members.append(int(entry.name))
    return members


def cmdline(pid: int) -> list[str]:
    """The process's command line, or [] where it is gone or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def parent_of(pid: int) -> int:
    """The parent's pid (0 where the process is gone)."""
    fields = _stat_after_name(pid)
    return int(fields[1]) if fields else 0


def descends_from(pid: int, ancestor: int) -> bool:
    """`pid` is a child (or a grandchild, up to ANCESTORS_SEARCHED levels) of `ancestor`."""
    for _ in range(ANCESTORS_SEARCHED):
        pid = parent_of(pid)
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def in_tree_of(pid: int, root: int) -> bool:
    """`pid` is `root` or descends from it."""
    return pid == root or descends_from(pid, root)
