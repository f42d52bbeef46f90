"""vLLM's Ray route without Ray: the scheduler reaches worker processes only through an
executor's `collective_rpc`, as it reaches Ray workers on other nodes.

`PipeExecutor` stands in for vLLM's Ray executor with the part kvcached uses: worker processes
that run whatever `collective_rpc(method, timeout=, args=)` sends them (a function, pickled by
reference, called with the worker as its first argument) and send back what it returned. Each
worker joins a gloo group (its rank comes from torch.distributed, as in a vLLM worker) and
allocates its KV buffers through the adapter when told to. Nothing else connects them: no
socket, no file.

Run as a script, this file is one worker process:
    python test_vllm_engine_rpc.py worker '<json config>'
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from kvcached_core import limits
from kvcached_core.errors import KVCachedConfigError, StateConsistencyError
from kvcached_core.integration.vllm import engine, pools, workers

PAGE = 64 << 10
UNIT = PAGE // 4  # four blocks a page
LAYERS = 2
PLANES = 2
PAGES = 16
REGION = PAGES * PAGE
PAGE_ALL_PLANES = PAGE * LAYERS * PLANES
HERE = Path(__file__).resolve()
REPO_ROOT = HERE.parents[2]
_FRAME = struct.Struct(">I")


def _send(out: IO[bytes], value: Any) -> None:
    payload = pickle.dumps(value)
    out.write(_FRAME.pack(len(payload)) + payload)
    out.flush()


def _receive(source: IO[bytes]) -> Any:
    header = source.read(_FRAME.size)
    if len(header) < _FRAME.size:
        raise EOFError("the peer is gone")
    (size,) = _FRAME.unpack(header)
    return pickle.loads(source.read(size))


# ---------------------------------------------------------------------------- worker process


def allocate_kv_buffers(_worker: object) -> dict[str, Any]:
    """What vLLM's rewritten KV allocation does in a worker (sent by the test's RPC)."""
    from kvcached_core.integration.vllm import kv_buffers

    engine_pool = kv_buffers._create_pool("cpu", num_tensors=LAYERS, regions=PLANES,
                                          region_bytes=REGION, unit_bytes=UNIT)
    return {"num_blocks": engine_pool.num_blocks, "pid": os.getpid()}


def served_state(_worker: object) -> dict[str, Any]:
    """This worker's tensors, read directly (not through the protocol)."""
    (engine_pool,) = pools.engine_pools()
    pool = engine_pool.pool
    return {"mapped_bytes": int(pool.backend.committed_bytes()),
            "mapped": sorted(int(i) for i in pool.ftensor_allocator.mapped_page_ids())}


def worker_main(config: dict[str, Any]) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{config['store']}",
                            rank=config["rank"], world_size=config["world_size"])
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            method, args = _receive(requests)
        except EOFError:
            return 0
        try:
            _send(replies, (True, method(None, *args)))
        except Exception as exc:  # sent back as the executor would raise it
            _send(replies, (False, f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------------------- test side


class WorkerDied(RuntimeError):
    pass


class PipeExecutor:
    """vLLM's executor as kvcached sees it: `collective_rpc` over worker processes."""

    def __init__(self, count: int, tmp: Path, env: dict[str, str]) -> None:
        store = tmp / "gloo-store"
        self.processes = [
            subprocess.Popen([sys.executable, str(HERE), "worker",
                              json.dumps({"rank": rank, "world_size": count,
                                          "store": str(store)})],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            for rank in range(count)]
        self.calls: list[str] = []

    def collective_rpc(self, method: Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(method.__name__)
        for process in self.processes:
            assert process.stdin is not None
            try:
                _send(process.stdin, (method, args))
            except BrokenPipeError:
                raise WorkerDied(f"worker {process.pid} died") from None
        results = []
        for process in self.processes:
            assert process.stdout is not None
            try:
                ok, value = _receive(process.stdout)
            except EOFError:
                raise WorkerDied(f"worker {process.pid} died") from None
            if not ok:
                raise RuntimeError(value)
            results.append(value)
        return results

    def shutdown(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                assert process.stdin is not None
                process.stdin.close()
                process.wait(timeout=30)


@pytest.fixture
def elastic_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    shm = tmp_path / "shm"
    shm.mkdir()
    # The reserve's defaults (at least 5 pages, filled at start) are left as they are: over
    # the engine's RPC nothing may fill it from another thread.
    settings = {"KVCACHED_PAGE_SIZE": str(PAGE), "KVCACHED_SHM_DIR": str(shm),
                "KVCACHED_MAX_RESERVED_PAGES": "6", "KVCACHED_IPC_TIMEOUT": "10"}
    for key in [k for k in os.environ if k.startswith("KVCACHED_")]:
        monkeypatch.delenv(key)
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env.update(settings)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), str(HERE.parent), env.get("PYTHONPATH")]))
    return env


class _Core:
    """The part of vLLM's EngineCore the engine-executor seam reads."""

    def __init__(self, executor: PipeExecutor) -> None:
        self.model_executor = executor


def _size_kv_caches(core: _Core, tp: int, pp: int) -> list[int]:
    """EngineCore._initialize_kv_caches as the transforms leave it: decorated by the
    engine-executor seam, calling the KV budget with the Ray executor's name."""

    @engine.kv_caches_sized_with_executor
    def initialize(self: _Core) -> list[int]:
        return engine.kv_cache_budget(
            [REGION * LAYERS * PLANES], block_bytes_per_layer=[UNIT * PLANES],
            user_kv_bytes=None, user_num_blocks=None, executor_backend="ray",
            world_size=tp * pp, pipeline_size=pp)

    return initialize(core)


@contextlib.contextmanager
def ray_like_job(tmp: Path, env: dict[str, str], *, tp: int = 2, pp: int = 1
                 ) -> Iterator[tuple[str, PipeExecutor]]:
    name = f"vllm-{os.getpid()}"
    executor = PipeExecutor(tp * pp, tmp, env)
    try:
        _size_kv_caches(_Core(executor), tp, pp)
        yield name, executor
    finally:
        executor.shutdown()
        pools.close(name)
        workers.withdraw_job(name)


def test_the_scheduler_maps_through_workers_it_reaches_only_by_the_executors_rpc(
        elastic_env: dict[str, str], tmp_path: Path) -> None:
    with ray_like_job(tmp_path, elastic_env) as (name, executor):
        # The KV budget told every worker its job through the executor, before any KV.
        assert executor.calls == ["join_rpc_job"]
        assert not workers.job_root(name).exists()  # nothing on disk for this route
        allocated = executor.collective_rpc(allocate_kv_buffers)
        assert [a["num_blocks"] for a in allocated] == [PAGES * 4] * 2

        engine_pool = workers.scheduler_pool(name)  # what the block pool looks up
        assert engine_pool is not None and pools.lookup(name) is engine_pool
        assert (engine_pool.tiling.min_blocks_per_page, engine_pool.num_blocks) == (4, PAGES * 4)
        pool = engine_pool.pool
        (record,) = limits.list_records(elastic_env["KVCACHED_SHM_DIR"])
        assert record.pool == name and record.capacity_bytes == PAGES * 2 * PAGE_ALL_PLANES

        # No reserve was filled in the background (the allocator's thread would have used
        # the executor beside the engine's): only the null page is mapped.
        time.sleep(0.3)
        assert [s["mapped"] for s in executor.collective_rpc(served_state)] == [[0], [0]]

        calls_before = len(executor.calls)
        pages = pool.alloc(3)
        assert executor.calls[calls_before:] == ["answer_job_broadcast"]  # one RPC, all ranks
        for state in executor.collective_rpc(served_state):
            assert state["mapped"] == sorted([0, *pages])
            assert state["mapped_bytes"] == 4 * PAGE_ALL_PLANES
        pool.free(pages)
        pool.release_retired_through(pool.capture_release_marker())
        assert pool.reserve_pages == 3  # freed pages wait in the reserve, still mapped
        pool.trim()  # the reserve given back: a two-phase unmap on every rank
        for state in executor.collective_rpc(served_state):
            assert state["mapped"] == [0] and state["mapped_bytes"] == PAGE_ALL_PLANES
        assert [s.mapped for s in engine_pool.mapper.worker_states()] == [[0], [0]]

        engine.close_on_shutdown(lambda self: None)(object())
        assert pools.lookup(name) is None
        assert limits.list_records(elastic_env["KVCACHED_SHM_DIR"]) == []


def test_pipeline_stages_answer_for_their_own_rank(elastic_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    with ray_like_job(tmp_path, elastic_env, tp=1, pp=2) as (name, executor):
        executor.collective_rpc(allocate_kv_buffers)
        engine_pool = workers.scheduler_pool(name)
        assert engine_pool is not None
        pages = engine_pool.pool.alloc(2)
        states = engine_pool.mapper.worker_states()
        assert [(s.address.rank, s.address.pp_rank) for s in states] == [(0, 0), (0, 1)]
        assert [s.mapped for s in states] == [sorted([0, *pages])] * 2


def test_a_dead_worker_stops_the_pool_and_names_every_rank(elastic_env: dict[str, str],
                                                           tmp_path: Path) -> None:
    with ray_like_job(tmp_path, elastic_env) as (name, executor):
        executor.collective_rpc(allocate_kv_buffers)
        engine_pool = workers.scheduler_pool(name)
        assert engine_pool is not None
        pool = engine_pool.pool
        pool.alloc(1)
        executor.processes[1].kill()
        executor.processes[1].wait(timeout=30)
        with pytest.raises(StateConsistencyError, match=r"rank 0 \(pp 0\) map: .*died"):
            pool.alloc(8)
        assert pool.page_allocator.state == "failed"


def test_workers_that_never_allocated_are_refused_at_attach(elastic_env: dict[str, str],
                                                            tmp_path: Path) -> None:
    refusal = (r"cannot reach the 2 worker\(s\) of pool .* through the engine's executor: "
               r".*no worker process of the engine serves rank 0")
    with (ray_like_job(tmp_path, elastic_env) as (name, _),
          pytest.raises(KVCachedConfigError, match=refusal)):
        workers.scheduler_pool(name)
    # The engine's shutdown forgot the job: a later engine of the name starts afresh.
    assert workers.scheduler_pool(name) is None


def test_an_executor_with_another_world_size_is_refused(elastic_env: dict[str, str],
                                                        tmp_path: Path) -> None:
    executor = PipeExecutor(1, tmp_path, elastic_env)
    try:
        with pytest.raises(KVCachedConfigError,
                           match=r"the executor runs 1 workers; pool .* expects 2 x 1"):
            _size_kv_caches(_Core(executor), tp=2, pp=1)
    finally:
        executor.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        sys.exit(worker_main(json.loads(sys.argv[2])))
    raise SystemExit(f"unknown role {sys.argv[1]!r}")
