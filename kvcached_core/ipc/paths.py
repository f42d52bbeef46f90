"""Where the worker sockets live, and the checks that keep other users out of them.

One socket per rank: `<root>/w<rank>.sock` for pipeline stage 0 and `<root>/pp<k>/w<rank>.sock`
for stage k > 0. Every directory on the way is private to its owner (mode 0700): a socket is
the authority to map and unmap the workers' memory, so nobody else may reach it.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvcached_core.errors import KVCachedConfigError

# sockaddr_un.sun_path holds 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
PRIVATE_MODE = 0o700


@dataclass(frozen=True)
class RankId:
    """One rank of one pipeline stage, however the coordinator reaches it."""

    rank: int
    pp_rank: int

    @property
    def label(self) -> str:
        return f"rank {self.rank} (pp {self.pp_rank})"

    @property
    def key(self) -> str:
        """How a broadcast over the engine's own RPC names this rank's request."""
        return f"{self.pp_rank}/{self.rank}"

    @property
    def route(self) -> str:
        return "the engine's worker RPC"


def job_ranks(tp_size: int, pp_size: int = 1) -> list[RankId]:
    """Every (stage, rank) of a job, stage-major."""
    if tp_size < 1 or pp_size < 1:
        raise KVCachedConfigError(f"tp_size and pp_size must be >= 1, got {tp_size}, {pp_size}")
    return [RankId(rank, pp_rank) for pp_rank in range(pp_size) for rank in range(tp_size)]


@dataclass(frozen=True)
class WorkerAddress(RankId):
    """The socket of one rank of one pipeline stage."""

    path: Path

    @property
    def route(self) -> str:
        return f"the socket {self.path}"


def default_socket_root(ipc_name: str, base: str | os.PathLike[str] | None = None) -> Path:
    """`<tmp>/kvcached-ipc-<name>-<hash>`; the hash covers the user id and the full name."""
    digest = hashlib.sha256(f"{os.geteuid()}:{ipc_name}".encode()).hexdigest()[:8]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", ipc_name)[:32] or "job"
    return Path(base if base is not None else tempfile.gettempdir()) / (
        f"kvcached-ipc-{safe}-{digest}"
    )


def socket_dir(root: Path, pp_rank: int) -> Path:
    if pp_rank < 0:
        raise KVCachedConfigError(f"pp_rank must be >= 0, got {pp_rank}")
    return root if pp_rank == 0 else root / f"pp{pp_rank}"


def worker_address(root: str | os.PathLike[str], rank: int, pp_rank: int = 0) -> WorkerAddress:
    if rank < 0:
        raise KVCachedConfigError(f"rank must be >= 0, got {rank}")
    path = socket_dir(Path(root), pp_rank) / f"w{rank}.sock"
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise KVCachedConfigError(
            f"socket path {str(path)!r} is {size} bytes; a Unix socket path holds at most "
            f"{MAX_SOCKET_PATH_BYTES}: choose a shorter socket root"
        )
    return WorkerAddress(rank, pp_rank, path)


def job_addresses(
    root: str | os.PathLike[str], tp_size: int, pp_size: int = 1
) -> list[WorkerAddress]:
    """Every (stage, rank) socket of a job, stage-major."""
    return [worker_address(root, r.rank, r.pp_rank) for r in job_ranks(tp_size, pp_size)]


def check_private_dir(path: Path) -> None:
    """Refuse a directory that is a symlink, not ours, or open to anyone else."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise KVCachedConfigError(f"socket directory {str(path)!r} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise KVCachedConfigError(f"socket directory {str(path)!r} is not a directory")
    if info.st_uid != os.geteuid():
        raise KVCachedConfigError(
            f"socket directory {str(path)!r} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.geteuid()}); refusing to use it"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode != PRIVATE_MODE:
        raise KVCachedConfigError(
            f"socket directory {str(path)!r} has mode {mode:04o}; it must be {PRIVATE_MODE:04o} "
            "(only its owner may open it). Remove it or fix its mode"
        )


def ensure_private_dir(path: Path) -> bool:
    """Create `path` with mode 0700, or check an existing one. True when it was created here."""
    try:
        os.mkdir(path, PRIVATE_MODE)
    except FileExistsError:
        check_private_dir(path)
        return False
    os.chmod(path, PRIVATE_MODE)  # mkdir's mode is filtered by the umask
    check_private_dir(path)
    return True
