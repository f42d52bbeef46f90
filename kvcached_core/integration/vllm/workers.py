"""vLLM workers in other processes: announce the job, serve each rank's tensors, attach to them.

With the mp or Ray executor the scheduler (EngineCore) and the KV tensors live in different
processes. The coordinator-worker protocol (`kvcached_core.ipc`) joins them, carried one of two
ways (the job's `route`):

- `socket` (the mp executor: every worker on the scheduler's host), steps 1-4 below;
- `engine-rpc` (the Ray executor: workers on any node of the Ray cluster). Nothing is written
  to disk and nothing listens: `announce_rpc_job` tells every worker its job through the
  executor's own `collective_rpc` (before they allocate KV), a worker serves its rank in its
  own process (`ipc.worker.serve_in_process`), and the scheduler's `ipc.RpcCarrier` sends
  each exchange as one `collective_rpc` of `answer_job_broadcast`. Ray carries it between
  nodes, authenticated and addressed as the engine's own calls are.

The socket route:

1. The scheduler announces the job (`announce_job`, from `kv_cache_budget`, before the workers
   allocate KV): it creates the job's private socket root, `ipc.default_socket_root(<pool
   name>)`, and writes `job.json` there (pool name, tensor and pipeline sizes, its own pid).
2. A worker allocating its KV buffers finds the announcement of its engine (`find_job`), builds
   its tensors with no ledger and no limit record of its own, and serves them on its rank's
   socket (`served_pool`, an `ipc.WorkerListener`), next to a `w<rank>.json` that says how its
   pages hold vLLM blocks. The listener is stopped, draining, when the worker exits.
3. The scheduler's block pool gets a pool whose PageAllocator maps through
   `ipc.BroadcastMapper` on every (stage, rank) (`scheduler_pool`); it keeps the limit record,
   metrics, `kvctl limit` and release epochs of a local pool.
4. On shutdown the scheduler closes its pool and the coordinator and withdraws the job
   (`withdraw_job`): the announcement, sockets left by killed workers and the directories go.
   A worker that still serves then (vLLM's executor kills the survivors after a worker died,
   without waiting) is given a bounded time to go, and its files are removed.

Which engine a worker belongs to: the job whose announcing process is an ancestor of the worker.
vLLM's executor starts its workers from the EngineCore process (its parent; a forkserver puts
one process in between), so a worker looks at its ancestors: the pool name is
`KVCACHED_POOL_NAME` when set (engine and workers share the environment), else `vllm-<pid>` of
the ancestor, exactly the name `config.pool_name()` gives in the EngineCore process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import multiprocessing.util
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcached_core.errors import KVCachedConfigError, KVCachedError
from kvcached_core.integration.vllm import pools
from kvcached_core.integration.vllm.config import engine_settings, vllm_zero_page_writable
from kvcached_core.ipc import BroadcastMapper, WorkerListener, default_socket_root, worker_address
from kvcached_core.ipc.coordinator import RpcCarrier, WorkerCallError, ipc_timeout_s
from kvcached_core.ipc.paths import WorkerAddress, ensure_private_dir, job_addresses, job_ranks
from kvcached_core.ipc.worker import (
    RankServer,
    answer_broadcast,
    serve_in_process,
    withdraw_in_process,
)
from kvcached_core.layout import BlockTiling
from kvcached_core.limits import pid_alive
from kvcached_core.pool import BackendKind, KVPool, PoolPolicy, PoolSpec
from kvcached_core.settings import current_settings

logger = logging.getLogger(__name__)

JOB_FILE = "job.json"
JOB_FORMAT = 1
# How far up the process tree a worker looks for its engine (parent, forkserver, ...).
MAX_ANCESTORS = 4
# Seconds a worker waits, at exit, for a call in progress before leaving its socket behind.
STOP_TIMEOUT_S = 5.0


SOCKET_ROUTE, RPC_ROUTE = "socket", "engine-rpc"


@dataclass(frozen=True)
class JobDescription:
    """What the scheduler announces: enough for a worker to find its rank's socket."""

    pool: str
    tp_size: int  # ranks per pipeline stage
    pp_size: int
    coordinator_pid: int
    format: int = JOB_FORMAT
    route: str = SOCKET_ROUTE  # how the coordinator reaches the workers

    @property
    def root(self) -> Path:
        return job_root(self.pool)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> JobDescription:
        try:
            job = cls(str(data["pool"]), int(data["tp_size"]), int(data["pp_size"]),
                      int(data["coordinator_pid"]), int(data["format"]),
                      str(data.get("route", SOCKET_ROUTE)))
        except (KeyError, TypeError, ValueError) as exc:
            raise KVCachedConfigError(f"malformed job description: {exc}") from None
        if (job.format != JOB_FORMAT or job.tp_size < 1 or job.pp_size < 1
                or job.route not in (SOCKET_ROUTE, RPC_ROUTE)):
            raise KVCachedConfigError(f"unsupported job description {data!r}")
        return job


@dataclass(frozen=True)
class RankGeometry:
    """How one rank's pages hold vLLM blocks; every rank of a job must agree."""

    page_bytes: int  # bytes of one page per layer and buffer (the ledger unit)
    unit_bytes: int  # bytes of one vLLM block per region
    num_blocks: int

    @property
    def tiling(self) -> BlockTiling:
        return BlockTiling(self.unit_bytes, self.page_bytes)


def job_root(pool: str) -> Path:
    return default_socket_root(pool)


def read_job(root: Path) -> JobDescription | None:
    """The job announced in `root`, or None when there is none."""
    try:
        data = json.loads((root / JOB_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise KVCachedConfigError(f"cannot read {root / JOB_FILE}: {exc}") from None
    if not isinstance(data, dict):
        raise KVCachedConfigError(f"{root / JOB_FILE} is not a job description")
    return JobDescription.from_mapping(data)


def _write_private_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write atomically, readable by this user only: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(data, out)
    os.replace(partial, path)


# ---------------------------------------------------------------------------- scheduler side


def announce_job(pool: str, *, tp_size: int, pp_size: int) -> JobDescription:
    """Announce this engine's job before its workers allocate KV (idempotent per process).

    A root left by an engine that died is cleared; one whose engine still runs is refused.
    """
    job = JobDescription(pool, int(tp_size), int(pp_size), os.getpid())
    if job.tp_size < 1 or job.pp_size < 1:
        raise KVCachedConfigError(f"tp_size and pp_size must be >= 1, got {tp_size}, {pp_size}")
    _rpc_jobs.pop(pool, None)  # an earlier engine of this name in this process used Ray
    root = job.root
    ensure_private_dir(root)
    existing = read_job(root)
    if existing is not None and existing.coordinator_pid != job.coordinator_pid:
        if pid_alive(existing.coordinator_pid):
            raise KVCachedConfigError(
                f"kvcached pool name {pool!r} is in use by the engine in process "
                f"{existing.coordinator_pid} ({root}); set KVCACHED_POOL_NAME to tell engines "
                "apart"
            )
        _remove_job_files(existing)
        ensure_private_dir(root)
    _write_private_json(root / JOB_FILE, asdict(job))
    atexit.register(withdraw_job, pool)
    return job


def withdraw_job(pool: str) -> None:
    """Remove this process's announcement of `pool`, sockets nobody serves and the directories.

    Live workers remove their own sockets when they exit; the last one out of a directory
    removes it, so the order of engine and worker shutdown does not matter. A job announced
    through the engine's RPC has nothing on disk: it is forgotten here.
    """
    _rpc_jobs.pop(pool, None)
    root = job_root(pool)
    try:
        job = read_job(root)
    except KVCachedConfigError:
        return
    if job is None or job.coordinator_pid != os.getpid():
        return
    _remove_job_files(job)
    # A worker that still serves removes its own socket when it exits, unless it is killed:
    # after one worker died, vLLM's executor SIGKILLs the survivors and does not wait for them
    # (the scheduler's process can reach its exit first). Wait a bounded time for such a
    # socket to go quiet, then remove what is left.
    deadline = time.monotonic() + SURVIVOR_EXIT_WAIT_S
    while job.root.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
        _remove_job_files(job)


#: How long `withdraw_job` waits for a surviving worker's socket to go quiet.
SURVIVOR_EXIT_WAIT_S = 10.0


def _remove_job_files(job: JobDescription) -> None:
    with contextlib.suppress(FileNotFoundError):
        (job.root / JOB_FILE).unlink()
    for address in job_addresses(job.root, job.tp_size, job.pp_size):
        if not _served(address.path):
            for path in (address.path, _geometry_path(address.path)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
    for pp_rank in range(job.pp_size - 1, 0, -1):
        with contextlib.suppress(OSError):
            (job.root / f"pp{pp_rank}").rmdir()
    with contextlib.suppress(OSError):  # not empty: a worker still serves; it removes it
        job.root.rmdir()


def _served(path: Path) -> bool:
    """Whether a live listener accepts on `path` (a killed worker's socket refuses)."""
    if not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def scheduler_pool(pool: str) -> pools.EnginePool | None:
    """The pool a scheduler's block pool uses: the one registered in this process, else, for a
    job this process announced, one that maps through every worker (registered here)."""
    found = pools.lookup(pool)
    if found is not None:
        return found
    rpc_job = _rpc_jobs.get(pool)
    if rpc_job is not None:
        engine_pool = attach_rpc_job(rpc_job)
        pools.register(engine_pool)
        return engine_pool
    job = read_job(job_root(pool))
    if job is None or job.coordinator_pid != os.getpid():
        return None
    engine_pool = attach_job(job)
    pools.register(engine_pool)
    return engine_pool


def attach_job(job: JobDescription) -> pools.EnginePool:
    """A scheduler-side pool over the workers of `job` (they must be serving)."""
    try:
        mapper = BroadcastMapper.for_job(job.root, job.tp_size, job.pp_size)
    except (KVCachedError, WorkerCallError, OSError) as exc:
        raise KVCachedConfigError(
            f"kvcached cannot reach the {job.tp_size * job.pp_size} worker(s) of pool "
            f"{job.pool!r} in {job.root}: {exc}"
        ) from exc
    try:
        geometry = _agreed_geometry(
            (address.label, _read_geometry(address)) for address in
            job_addresses(job.root, job.tp_size, job.pp_size))
    except BaseException:
        mapper.close()
        raise

    def detach() -> None:
        mapper.close()
        withdraw_job(job.pool)

    return _pool_over_workers(job.pool, mapper, geometry, detach)


def _pool_over_workers(name: str, mapper: BroadcastMapper, geometry: RankGeometry,
                       detach: Callable[[], None], *,
                       engine_thread_only: bool = False) -> pools.EnginePool:
    """The scheduler's pool over `mapper`: the limit record, metrics and policy of a local one.

    `engine_thread_only`: the mapper may be used from the engine's thread only (it sends
    through the engine's executor, which vLLM drives from that thread alone), so the reserve
    is never filled ahead by the allocator's background thread: pages are mapped when an
    allocation needs them, and freed pages still wait in the reserve.
    """
    settings = engine_settings()
    overrides: dict[str, Any] = {"defer_physical_release": True}
    if engine_thread_only:
        overrides.update(prealloc=False, min_reserve_pages=0)
        if settings.min_reserved_pages or settings.prealloc:
            logger.info(
                "kvcached: pool %s maps through the engine's executor, which only the engine's "
                "thread may use: the reserve is not filled ahead (KVCACHED_MIN_RESERVED_PAGES "
                "and KVCACHED_PREALLOC do not apply)", name)
    try:
        pool = KVPool.over_mapper(
            name,
            mapper,
            page_bytes=geometry.page_bytes,
            policy=PoolPolicy.from_settings(settings, **overrides),
        )
    except BaseException:
        mapper.close()
        raise
    if int(pool.num_blocks) < geometry.tiling.pages_for(geometry.num_blocks):
        pool.close()
        mapper.close()
        raise KVCachedConfigError(
            f"the workers of pool {name!r} map {pool.num_blocks} pages, too few for "
            f"{geometry.num_blocks} blocks"
        )
    return pools.EnginePool(name, pool, geometry.tiling, geometry.num_blocks,
                            mapper=mapper, detach=detach)


def _read_geometry(address: WorkerAddress) -> RankGeometry:
    path = _geometry_path(address.path)
    try:
        return RankGeometry(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as exc:
        raise KVCachedConfigError(f"{address.label}: cannot read {path}: {exc}") from None


def _agreed_geometry(reported: Iterable[tuple[str, RankGeometry]]) -> RankGeometry:
    seen: dict[RankGeometry, str] = {}
    for label, geometry in reported:
        seen.setdefault(geometry, label)
    if len(seen) != 1:
        detail = "; ".join(f"{label}: {g}" for g, label in seen.items())
        raise KVCachedConfigError(f"the workers disagree on how pages hold blocks ({detail})")
    return next(iter(seen))


# ---------------------------------------------------------------------------- the engine-rpc route


@dataclass(frozen=True)
class _RpcJob:
    job: JobDescription
    executor: Any  # the engine's executor: its collective_rpc reaches every worker


#: Scheduler side: the jobs this process announced through its executor, by pool name.
_rpc_jobs: dict[str, _RpcJob] = {}
#: Worker side: the job the engine's RPC told this worker process about (one per worker).
_joined_rpc_job: JobDescription | None = None
#: Worker side: how this process's rank holds blocks, by pool name (asked for by the scheduler).
_served_geometry: dict[str, RankGeometry] = {}


def announce_rpc_job(pool: str, *, tp_size: int, pp_size: int, executor: Any) -> JobDescription:
    """Tell every worker of `executor` which job it serves, through the executor's own RPC,
    before they allocate KV (the workers may run on other nodes: nothing is written here)."""
    job = JobDescription(pool, int(tp_size), int(pp_size), os.getpid(), route=RPC_ROUTE)
    if job.tp_size < 1 or job.pp_size < 1:
        raise KVCachedConfigError(f"tp_size and pp_size must be >= 1, got {tp_size}, {pp_size}")
    withdraw_job(pool)  # what an earlier engine of this name in this process announced
    joined = executor.collective_rpc(join_rpc_job, timeout=ipc_timeout_s(), args=(asdict(job),))
    if len(joined) != job.tp_size * job.pp_size:
        raise KVCachedConfigError(
            f"the executor runs {len(joined)} workers; pool {pool!r} expects "
            f"{job.tp_size} x {job.pp_size}"
        )
    _rpc_jobs[pool] = _RpcJob(job, executor)
    return job


def join_rpc_job(_worker: object, job: dict[str, Any]) -> int:
    """Run in each worker process by `announce_rpc_job`: remember the job it serves."""
    global _joined_rpc_job
    _joined_rpc_job = JobDescription.from_mapping(job)
    return os.getpid()


def answer_job_broadcast(_worker: object, pool: str, frames: dict[str, bytes]
                         ) -> dict[str, Any] | None:
    """Run in each worker process for every exchange of the scheduler's `RpcCarrier`."""
    return answer_broadcast(pool, frames)


def rank_geometry(_worker: object, pool: str) -> dict[str, Any] | None:
    """Run in each worker process when the scheduler attaches: how its rank holds blocks."""
    found = _served_geometry.get(pool)
    return None if found is None else asdict(found)


def attach_rpc_job(rpc_job: _RpcJob) -> pools.EnginePool:
    """A scheduler-side pool over the workers of `rpc_job`, through the executor's RPC."""
    job, executor = rpc_job.job, rpc_job.executor

    def broadcast(frames: dict[str, bytes], timeout: float) -> Sequence[Any]:
        return list(executor.collective_rpc(answer_job_broadcast, timeout=timeout,
                                            args=(job.pool, frames)))

    ranks = job_ranks(job.tp_size, job.pp_size)
    try:
        mapper = BroadcastMapper(RpcCarrier(ranks, broadcast))
    except (KVCachedError, WorkerCallError, OSError) as exc:
        raise KVCachedConfigError(
            f"kvcached cannot reach the {len(ranks)} worker(s) of pool {job.pool!r} through "
            f"the engine's executor: {exc}"
        ) from exc
    try:
        reported = executor.collective_rpc(rank_geometry, timeout=ipc_timeout_s(),
                                           args=(job.pool,))
        if any(found is None for found in reported):
            raise KVCachedConfigError(f"a worker of pool {job.pool!r} serves no KV tensors")
        geometry = _agreed_geometry(
            (f"worker {index}", RankGeometry(**found)) for index, found in enumerate(reported))
    except BaseException:
        mapper.close()
        raise

    def detach() -> None:
        mapper.close()
        _rpc_jobs.pop(job.pool, None)

    return _pool_over_workers(job.pool, mapper, geometry, detach, engine_thread_only=True)


# ---------------------------------------------------------------------------- worker side


def _parent_pid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses; fields resume after ')'.
    return int(stat[stat.rindex(")") + 2:].split()[1])


def ancestors(pid: int | None = None) -> list[int]:
    """The parent, grandparent, ... of `pid` (this process), at most MAX_ANCESTORS of them."""
    found: list[int] = []
    current = os.getpid() if pid is None else pid
    while len(found) < MAX_ANCESTORS:
        current = os.getppid() if current == os.getpid() else _parent_pid(current)
        if current <= 1:
            break
        found.append(current)
    return found


def find_job(environ: Mapping[str, str] | None = None) -> JobDescription | None:
    """The job the engine's RPC told this process about, else the one announced by an
    ancestor of this process (the engine that started it), if any."""
    if _joined_rpc_job is not None:
        return _joined_rpc_job
    fixed_name = current_settings(environ).pool_name
    for pid in ancestors():
        job = read_job(job_root(fixed_name or f"vllm-{pid}"))
        if job is not None and job.coordinator_pid == pid:
            return job
    return None


def distributed_ranks(job: JobDescription) -> tuple[int, int]:
    """(rank within its pipeline stage, pipeline stage) of this worker.

    vLLM numbers the ranks of one engine with the tensor (and context) parallel ranks
    innermost, then the pipeline stages (then data parallel replicas, each its own engine):
    torch.distributed's rank gives both.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise KVCachedConfigError(
            f"a worker of pool {job.pool!r} has no torch.distributed group to tell its rank"
        )
    rank = int(dist.get_rank())
    return rank % job.tp_size, (rank // job.tp_size) % job.pp_size


def _geometry_path(socket_path: Path) -> Path:
    return socket_path.with_suffix(".json")


def served_pool(
    name: str,
    *,
    backend: BackendKind,
    device: int,
    num_tensors: int,
    regions: int,
    region_bytes: int,
    ledger_unit: int,
    unit_bytes: int,
    job: JobDescription | None = None,
    ranks: tuple[int, int] | None = None,
    contiguous: bool = False,
) -> pools.EnginePool | None:
    """For a worker of an announced job: its KV tensors, served to the scheduler (on its
    rank's socket, or in this process for the engine's RPC: the job's route).

    Returns None when this process belongs to no announced job (the scheduler is in this
    process: the caller builds the local pool). `job` and `ranks` default to `find_job()` and
    `distributed_ranks(job)`.
    """
    job = find_job() if job is None else job
    if job is None:
        return None
    rank, pp_rank = distributed_ranks(job) if ranks is None else ranks
    if not (0 <= rank < job.tp_size and 0 <= pp_rank < job.pp_size):
        raise KVCachedConfigError(
            f"worker rank {rank} (pp {pp_rank}) is outside pool {job.pool!r}'s "
            f"{job.tp_size} x {job.pp_size} ranks"
        )
    settings = engine_settings()
    # Tensors only: the scheduler's pool decides which pages are mapped, through the listener.
    pool = KVPool.create(
        name,
        PoolSpec(num_tensors, regions, ledger_unit, regions * region_bytes, settings.page_size,
                 contiguous),
        # The physical pages are created here, so they are charged to the budget here.
        PoolPolicy(min_reserve_pages=0, max_reserve_pages=0, prealloc=False,
                   set_aside_null_block=False, budget=settings.budget,
                   zero_page_writable=vllm_zero_page_writable(settings)),
        backend=backend,
        device=device,
        share_limits=False,
        export_metrics=False,
    )
    resident = pool.backend.committed_bytes if backend == "host" else None
    geometry = RankGeometry(ledger_unit, unit_bytes, region_bytes // unit_bytes)
    if job.route == RPC_ROUTE:
        stop_serving = _serve_over_rpc(job, pool, RankServer(
            pool.ftensor_allocator, rank, pp_rank, resident_bytes=resident), geometry)
    else:
        stop_serving = _serve_on_socket(pool, WorkerListener(
            pool.ftensor_allocator, worker_address(job.root, rank, pp_rank),
            resident_bytes=resident), geometry)
    engine_pool = pools.EnginePool(name, pool, geometry.tiling, geometry.num_blocks,
                                   stop_serving=stop_serving)
    pools.register(engine_pool)
    # vLLM ends a worker through multiprocessing, which runs its finalizers but (for a forked
    # worker) not atexit; pools.close_all covers the atexit path. close() is idempotent.
    multiprocessing.util.Finalize(None, pools.close, args=(name,), exitpriority=10)
    return engine_pool


def _serve_over_rpc(job: JobDescription, pool: KVPool, server: RankServer,
                    geometry: RankGeometry) -> Callable[[], None]:
    try:
        serve_in_process(job.pool, server)
    except BaseException:
        pool.close()
        raise
    _served_geometry[job.pool] = geometry

    def stop_serving() -> None:
        _served_geometry.pop(job.pool, None)
        withdraw_in_process(job.pool)

    return stop_serving


def _serve_on_socket(pool: KVPool, listener: WorkerListener,
                     geometry: RankGeometry) -> Callable[[], None]:
    address = listener.address
    try:
        listener.start()
        _write_private_json(_geometry_path(address.path), asdict(geometry))
    except BaseException:
        listener.stop()
        pool.close()
        raise

    def stop_serving() -> None:
        with contextlib.suppress(FileNotFoundError):
            _geometry_path(address.path).unlink()
        if not listener.stop(STOP_TIMEOUT_S):
            logger.warning("kvcached: %s still answers a call; its socket stays", address.label)

    return stop_serving
