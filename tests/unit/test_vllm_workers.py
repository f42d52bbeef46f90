"""vLLM with workers in other processes: the scheduler announces the job, real worker processes
find it, allocate their KV buffers through the adapter and serve them on their rank's socket,
and the scheduler's pool maps through all of them (host backend).

Run as a script, this file is one worker process:
    python test_vllm_workers.py worker '<json config>'
It joins a gloo group (its rank comes from torch.distributed, as in a vLLM worker), allocates
its KV buffers with `kv_buffers._create_pool` (the call vLLM's rewritten allocation makes),
prints `ready`, and serves until SIGTERM; exiting stops its listener.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvcached_core import limits
from kvcached_core.errors import KVCachedConfigError, PoolExhausted
from kvcached_core.integration.vllm import engine, pools, workers
from kvcached_core.ipc.paths import worker_address

PAGE = 64 << 10  # KVCACHED_PAGE_SIZE: one ledger page per layer and plane
UNIT = PAGE // 4  # a vLLM block's bytes per plane: four blocks a page
LAYERS = 2
PLANES = 2  # K and V
PAGES = 16
REGION = PAGES * PAGE
PAGE_ALL_PLANES = PAGE * LAYERS * PLANES  # what one page costs one rank
REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60


# ---------------------------------------------------------------------------- worker process


def worker_main(config: dict[str, Any]) -> int:
    import torch.distributed as dist

    from kvcached_core.integration.vllm import kv_buffers

    dist.init_process_group("gloo", init_method=f"file://{config['store']}",
                            rank=config["rank"], world_size=config["world_size"])
    engine_pool = kv_buffers._create_pool("cpu", num_tensors=LAYERS, regions=PLANES,
                                          region_bytes=REGION, unit_bytes=UNIT)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(json.dumps({"ready": True, "blocks_per_page": engine_pool.tiling.min_blocks_per_page,
                      "num_blocks": engine_pool.num_blocks,
                      "shares_limits": any(p.name.startswith("kvcached.")
                                           for p in Path(config["shm"]).iterdir())}),
          flush=True)
    stop.wait()
    return 0  # interpreter exit: the registered pool is closed and the listener stopped


# ---------------------------------------------------------------------------- test side


@dataclass
class Worker:
    process: subprocess.Popen[str]
    hello: dict[str, Any]

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def _start_workers(count: int, tmp: Path, env: dict[str, str]) -> list[Worker]:
    store = tmp / "gloo-store"
    started = []
    for rank in range(count):
        config = {"rank": rank, "world_size": count, "store": str(store),
                  "shm": env["KVCACHED_SHM_DIR"]}
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "worker", json.dumps(config)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        started.append(process)
    ready = []
    for process in started:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("{"):
            for other in started:
                other.kill()
            raise AssertionError(f"worker did not start: {line!r} {process.communicate()[1]}")
        ready.append(Worker(process, json.loads(line)))
    return ready


@pytest.fixture
def elastic_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    shm = tmp_path / "shm"
    shm.mkdir()
    settings = {"KVCACHED_PAGE_SIZE": str(PAGE), "KVCACHED_SHM_DIR": str(shm),
                "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "1",
                "KVCACHED_PREALLOC": "0", "KVCACHED_IPC_TIMEOUT": "10"}
    for key in [k for k in os.environ if k.startswith("KVCACHED_")]:
        monkeypatch.delenv(key)
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env.update(settings)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def mp_job(tmp: Path, env: dict[str, str], *, tp: int = 2, pp: int = 1
           ) -> Iterator[tuple[workers.JobDescription, list[Worker]]]:
    """This process as the scheduler of an mp-executor job with `tp` x `pp` worker processes."""
    name = f"vllm-{os.getpid()}"  # what config.pool_name() gives without KVCACHED_POOL_NAME
    engine.kv_cache_budget([REGION * LAYERS * PLANES], block_bytes_per_layer=[UNIT * PLANES],
                           user_kv_bytes=None, user_num_blocks=None, executor_backend="mp",
                           world_size=tp * pp, pipeline_size=pp)
    job = workers.read_job(workers.job_root(name))
    assert job is not None
    ranks: list[Worker] = []
    try:
        ranks = _start_workers(tp * pp, tmp, env)
        yield job, ranks
    finally:
        for worker in ranks:
            if worker.process.poll() is None:
                worker.stop()
        pools.close(name)
        workers.withdraw_job(name)


def _state(job: workers.JobDescription, rank: int, pp_rank: int = 0) -> dict[str, Any]:
    from test_ipc_harness import raw_call

    reply = raw_call(worker_address(job.root, rank, pp_rank).path, "state", {})
    assert reply.ok, reply.message
    return reply.result


def test_the_budget_announces_an_mp_job_and_shutdown_withdraws_it(
        elastic_env: dict[str, str]) -> None:
    name = f"vllm-{os.getpid()}"
    root = workers.job_root(name)
    budget = engine.kv_cache_budget([10 << 20], block_bytes_per_layer=[UNIT * PLANES],
                                    user_kv_bytes=None, user_num_blocks=None,
                                    executor_backend="mp", world_size=4, pipeline_size=2)
    assert budget == [(10 << 20) // (UNIT * PLANES * 4) * (UNIT * PLANES * 4)]
    job = workers.read_job(root)
    assert job == workers.JobDescription(name, 2, 2, os.getpid())
    assert oct((root / workers.JOB_FILE).stat().st_mode & 0o777) == "0o600"
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    # The scheduler's block pool attaches only once workers serve: none here, a clear error.
    with pytest.raises(KVCachedConfigError, match=r"cannot reach the 4 worker\(s\)"):
        workers.scheduler_pool(name)
    # EngineCore.shutdown (decorated) withdraws the announcement and the directory.
    engine.close_on_shutdown(lambda self: None)(object())
    assert not root.exists()


def test_a_uni_engine_announces_nothing_and_other_executors_are_refused(
        elastic_env: dict[str, str]) -> None:
    root = workers.job_root(f"vllm-{os.getpid()}")
    engine.kv_cache_budget([10 << 20], block_bytes_per_layer=[UNIT * PLANES], user_kv_bytes=None,
                           user_num_blocks=None, executor_backend="uni", world_size=1)
    assert not root.exists()
    refusals = {
        # A build without the engine-executor seam never hands kvcached the executor.
        "ray": r"does not support the 'ray' executor in this build \(no vllm-engine-executor "
               r"seam\): use 'uni' \(one device\), 'mp'",
        "external_launcher": r"does not support the 'external_launcher' executor \(world size "
                             r"2\): use 'uni' \(one device\), 'mp' .* or 'ray'",
    }
    for backend, refusal in refusals.items():
        with pytest.raises(KVCachedConfigError, match=refusal):
            engine.kv_cache_budget([10 << 20], block_bytes_per_layer=[UNIT * PLANES],
                                   user_kv_bytes=None, user_num_blocks=None,
                                   executor_backend=backend, world_size=2)
    assert not root.exists()


def test_a_live_engine_keeps_its_pool_name_and_a_dead_ones_announcement_is_replaced(
        elastic_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_POOL_NAME", f"shared-{os.getpid()}")
    root = workers.job_root(f"shared-{os.getpid()}")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        root.mkdir(mode=0o700)
        os.chmod(root, 0o700)
        stale = {"pool": f"shared-{os.getpid()}", "tp_size": 2, "pp_size": 1,
                 "coordinator_pid": other.pid, "format": 1}
        (root / workers.JOB_FILE).write_text(json.dumps(stale))
        with pytest.raises(KVCachedConfigError, match=f"in use by the engine in process {other.pid}"
                           ):
            workers.announce_job(f"shared-{os.getpid()}", tp_size=1, pp_size=1)
        other.kill()
        other.wait()
        (root / "w1.sock").touch()  # left by a worker that was killed
        job = workers.announce_job(f"shared-{os.getpid()}", tp_size=1, pp_size=1)
        assert workers.read_job(root) == job and job.coordinator_pid == os.getpid()
        assert not (root / "w1.sock").exists()
    finally:
        other.kill()
        other.wait()
        workers.withdraw_job(f"shared-{os.getpid()}")
    assert not root.exists()


def test_a_child_process_finds_the_job_of_its_engine(elastic_env: dict[str, str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    probe = ("from kvcached_core.integration.vllm import workers; job = workers.find_job(); "
             "print(job.pool if job else None)")
    name = f"vllm-{os.getpid()}"
    workers.announce_job(name, tp_size=1, pp_size=1)
    try:
        found = subprocess.run([sys.executable, "-c", probe], env=elastic_env, check=True,
                               capture_output=True, text=True).stdout.strip()
        assert found == name  # derived from the parent's pid
        # A grandchild (a forkserver in between) finds it too.
        nested = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {probe!r}])"
        found = subprocess.run([sys.executable, "-c", nested], env=elastic_env, check=True,
                               capture_output=True, text=True).stdout.strip()
        assert found == name
        # This process is the engine, not one of its workers: no job of an ancestor.
        assert workers.find_job() is None
    finally:
        workers.withdraw_job(name)
    # With KVCACHED_POOL_NAME the engine and its workers share the name from the environment.
    workers.announce_job("named-job", tp_size=1, pp_size=1)
    try:
        found = subprocess.run([sys.executable, "-c", probe],
                               env={**elastic_env, "KVCACHED_POOL_NAME": "named-job"},
                               check=True, capture_output=True, text=True).stdout.strip()
        assert found == "named-job"
    finally:
        workers.withdraw_job("named-job")


def test_the_scheduler_pool_maps_through_two_worker_processes(
        elastic_env: dict[str, str], tmp_path: Path) -> None:
    with mp_job(tmp_path, elastic_env, tp=2) as (job, ranks):
        for worker in ranks:
            assert worker.hello["blocks_per_page"] == 4
            assert worker.hello["num_blocks"] == PAGES * 4
            assert not worker.hello["shares_limits"]  # only the scheduler owns a limit record
        # Each worker serves its own rank, told by torch.distributed.
        for rank in range(2):
            assert worker_address(job.root, rank).path.exists()
            assert (job.root / f"w{rank}.json").exists()

        engine_pool = workers.scheduler_pool(job.pool)
        assert engine_pool is not None and engine_pool.mapper is not None
        assert pools.lookup(job.pool) is engine_pool  # what the block pool looks up
        assert (engine_pool.tiling.min_blocks_per_page, engine_pool.num_blocks) == (4, PAGES * 4)
        pool = engine_pool.pool
        assert pool.null_block_id == 0
        # The limit record is the scheduler's and counts every rank's memory.
        (record,) = limits.list_records(elastic_env["KVCACHED_SHM_DIR"])
        assert record.pool == job.pool and record.owner_pid == os.getpid()
        assert record.capacity_bytes == PAGES * 2 * PAGE_ALL_PLANES

        pages = pool.alloc(3)
        for rank in range(2):
            state = _state(job, rank)
            assert sorted(state["mapped"]) == sorted([0, *pages])
            assert state["resident_bytes"] == 4 * PAGE_ALL_PLANES
        assert pool.mapped_bytes() == 4 * 2 * PAGE_ALL_PLANES
        assert limits.read_record(job.pool, elastic_env["KVCACHED_SHM_DIR"]).used_bytes == (
            4 * 2 * PAGE_ALL_PLANES)

        # Release epochs: freed pages stay mapped until their epoch is released, then one
        # stays in the reserve (max 1) and the others are unmapped on every rank.
        pool.free(pages)
        marker = pool.capture_release_marker()
        assert len(_state(job, 0)["mapped"]) == 4
        pool.release_retired_through(marker)
        for rank in range(2):
            state = _state(job, rank)
            assert len(state["mapped"]) == 2  # the null page and one reserve page
            assert state["resident_bytes"] == 2 * PAGE_ALL_PLANES

        # kvctl's limit reaches the pool through the shared record: two pages across both
        # ranks leave room for the null page and one more.
        limits.set_limit(job.pool, 2 * 2 * PAGE_ALL_PLANES,
                         directory=elastic_env["KVCACHED_SHM_DIR"])
        deadline = time.monotonic() + 10
        while True:  # the pool's watcher applies the new limit on a following allocation
            try:
                blocks = pool.alloc(2)  # two pages next to the null page: over the limit
            except PoolExhausted:
                break
            pool.free(blocks)
            pool.release_retired_through(pool.capture_release_marker())
            assert time.monotonic() < deadline, "the limit never reached the pool"
            time.sleep(0.05)
        assert pool.snapshot().capacity_pages == 2

        # Clean shutdown: workers first (as vLLM's executor does), then the scheduler.
        for worker in ranks:
            assert worker.stop() == 0
        for rank in range(2):
            assert not worker_address(job.root, rank).path.exists()
        engine.close_on_shutdown(lambda self: None)(object())
        assert pools.lookup(job.pool) is None
        assert not job.root.exists()
        assert limits.list_records(elastic_env["KVCACHED_SHM_DIR"]) == []


def test_pipeline_stages_are_addressed_from_the_distributed_rank(
        elastic_env: dict[str, str], tmp_path: Path) -> None:
    with mp_job(tmp_path, elastic_env, tp=1, pp=2) as (job, _):
        assert worker_address(job.root, 0, 0).path.exists()
        assert worker_address(job.root, 0, 1).path == job.root / "pp1" / "w0.sock"
        assert worker_address(job.root, 0, 1).path.exists()
        engine_pool = workers.scheduler_pool(job.pool)
        assert engine_pool is not None
        pages = engine_pool.pool.alloc(2)
        assert sorted(_state(job, 0, 1)["mapped"]) == sorted([0, *pages])


def test_a_dead_worker_fails_allocation_clearly_and_leaks_no_page(
        elastic_env: dict[str, str], tmp_path: Path) -> None:
    with mp_job(tmp_path, elastic_env, tp=2) as (job, ranks):
        engine_pool = workers.scheduler_pool(job.pool)
        assert engine_pool is not None
        pool = engine_pool.pool
        held = pool.alloc(1)
        before = pool.snapshot()
        rank0_before = sorted(_state(job, 0)["mapped"])

        ranks[1].kill()
        # A clean failure (rolled back everywhere) that names the rank; to the scheduler it is
        # "no pages now", so vLLM waits or preempts while its executor notices the death.
        with pytest.raises(PoolExhausted, match=r"rank 1 \(pp 0\) map: unreachable.*"
                                                r"rolled back on every rank.*w1.sock"):
            pool.alloc(2)
        # Rolled back on the surviving rank; the ledger holds exactly what it held.
        assert sorted(_state(job, 0)["mapped"]) == rank0_before
        after = pool.snapshot()
        assert (after.in_use_pages, after.num_used_blocks) == (
            before.in_use_pages, before.num_used_blocks)
        assert pool.page_allocator.num_in_use == before.in_use_pages
        del held

        # Shutdown with a killed worker: its socket is removed by the scheduler.
        ranks[0].stop()
        assert worker_address(job.root, 1).path.exists()
        engine.close_on_shutdown(lambda self: None)(object())
        assert not job.root.exists()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    sys.exit(worker_main(json.loads(sys.argv[2])))
