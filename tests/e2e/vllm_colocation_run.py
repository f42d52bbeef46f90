"""Colocated engines: one long-lived patched vLLM CPU engine per process, driven over stdin.

Engine side (run with the engine venv's python):

    python vllm_colocation_run.py MODEL_DIR [--tp N]

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; the uni executor, or with
`--tp N` the mp executor and N tensor-parallel worker processes) with the `vllm_cpu_run.py`
engine settings; its KV pool joins whatever `KVCACHED_BUDGET` names. It reads
one JSON command per line on stdin and answers each with one line on stdout that starts with
`REPLY_MARK` (vLLM writes its own logs to the same streams):

    {"cmd": "burst", "prompts": [[token ids], ...], "max_tokens": N}
        -> {"outputs": [[ids], ...], "failed": k, "errors": [...], "seconds": s,
            "generated_tokens": t, "preemptions": p}
    {"cmd": "state"} -> {"mapped_bytes": b, "charged_bytes": c, "committed_bytes": h,
                         "limit_bytes": l, "pid": pid, "page_bytes": one ledger page,
                         "workers": [pids]}
    {"cmd": "quit"}  -> {"bye": true}

(`committed_bytes`: the host memory the KV tensors commit, summed over the workers' own
reports with `--tp`.)

While no command is pending the engine is idle, and an idle engine runs no scheduler step. A
shared limit (`kvctl limit`) is applied by the pool on its next allocation, so every
`IDLE_TICK_S` the idle loop makes an empty allocation, which applies a pending limit and lets
the pool's warm pages above it go at once, as the next engine step would.

Host side (imported by the e2e test and the benchmark): `EngineProcess` starts and drives one
engine; `MemoryTimeline` samples, from the shared-memory records alone, every pool's mapped
bytes and the budget's capacity and per-member charges.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

if __package__:  # imported on the host, as part of the test package
    from .vllm_cpu_run import (
        Executor,
        engine_kwargs,
        metric_totals,
        worker_pids,
    )
else:  # run as a script inside the engine venv
    from vllm_cpu_run import (
        Executor,
        engine_kwargs,
        metric_totals,
        worker_pids,
    )

REPLY_MARK = "@@colocation "
IDLE_TICK_S = 0.05


def reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(REPLY_MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def engine_pool() -> Any:
    from kvcached_core.integration.vllm import engine_pools

    (found,) = engine_pools()
    return found


def burst(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = metric_totals(llm).get("vllm:num_preemptions", 0.0)
    started = time.perf_counter()
    errors: list[str] = []
    outputs: list[list[int]] = []
    try:
        results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params,
                               use_tqdm=False)
        outputs = [list(r.outputs[0].token_ids) for r in results]
    except Exception as exc:  # a failed request is what the caller counts, not a crash
        traceback.print_exc()
        errors.append(f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - started
    failed = len(prompts) - sum(1 for out in outputs if len(out) == max_tokens)
    return {
        "outputs": outputs,
        "failed": failed,
        "errors": errors,
        "seconds": seconds,
        "generated_tokens": sum(len(out) for out in outputs),
        "preemptions": metric_totals(llm).get("vllm:num_preemptions", 0.0) - before,
    }


def state(engine: Any, workers: list[int]) -> dict[str, Any]:
    """What the pool holds and charges, and the limit it applies now (a `kvctl limit` counts
    only once the pool has picked it up)."""
    pool = engine.pool
    backend = pool.backend
    charged = int(backend.charged_bytes()) if hasattr(backend, "charged_bytes") else -1
    limit = int(pool.snapshot().target_pages) * int(pool.geometry.page_bytes_all_layers)
    if engine.mapper is not None:  # the tensors are in the worker processes
        committed = sum(int(s.resident_bytes or 0) for s in engine.mapper.worker_states())
    else:
        committed = int(backend.committed_bytes()) if hasattr(backend, "committed_bytes") \
            else -1
    return {"mapped_bytes": int(pool.mapped_bytes()), "charged_bytes": charged,
            "committed_bytes": committed, "limit_bytes": limit, "pid": os.getpid(),
            "page_bytes": int(pool.geometry.page_bytes_all_layers), "workers": workers}


def serve(model: Path, tp: int) -> None:
    from vllm import LLM

    llm = LLM(**engine_kwargs(model, Executor("mp", tp) if tp > 1 else Executor()))
    engine = engine_pool()
    pool = engine.pool
    workers = worker_pids() if tp > 1 else []
    reply({"ready": True, **state(engine, workers)})
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], IDLE_TICK_S)
        if not readable:
            pool.alloc(0)  # idle tick: applies a pending shared limit
            continue
        line = sys.stdin.readline()
        if not line:
            return
        command = json.loads(line)
        if command["cmd"] == "burst":
            reply(burst(llm, command["prompts"], int(command["max_tokens"])))
        elif command["cmd"] == "state":
            reply(state(engine, workers))
        elif command["cmd"] == "quit":
            reply({"bye": True})
            return
        else:
            reply({"error": f"unknown command {command['cmd']!r}"})


# ---------------------------------------------------------------------------- host side

RUNNER = Path(__file__).resolve()


class EngineProcess:
    """One engine process running `serve` (or `runner`, another engine's program that speaks
    the same protocol: tests/sglang/inside/serve_engine.py), and the line protocol to it."""

    def __init__(self, label: str, python: Path, model: Path, env: dict[str, str],
                 log_path: Path, tp: int = 1, runner: Path = RUNNER) -> None:
        self.label = label
        self._log = log_path.open("w", encoding="utf-8")
        self._process = subprocess.Popen(
            [str(python), str(runner), str(model), *(["--tp", str(tp)] if tp > 1 else [])],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._reader = threading.Thread(target=self._read, args=(self._process.stdout,),
                                        daemon=True)
        self._reader.start()
        self.pid = self._process.pid

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            if line.startswith(REPLY_MARK):
                self._replies.put(json.loads(line[len(REPLY_MARK):]))
            else:
                self._tail.append(line)
                self._log.write(line)
        self._replies.put(None)  # the process closed its output: it is gone

    def _next_reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            got = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"engine {self.label}: no reply in {timeout_s:.0f} s\n"
                               + "".join(self._tail)) from None
        if got is None:
            raise RuntimeError(f"engine {self.label} exited ({self._process.poll()}):\n"
                               + "".join(self._tail))
        return got

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        return self._next_reply(timeout_s)

    def request(self, command: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        return self._next_reply(timeout_s)

    def burst(self, prompts: list[list[int]], max_tokens: int,
              timeout_s: float = 300) -> dict[str, Any]:
        return self.request({"cmd": "burst", "prompts": prompts, "max_tokens": max_tokens},
                            timeout_s)

    def close(self, timeout_s: float = 60) -> int:
        """Ask the engine to quit; kill it if it does not. Returns its exit status."""
        if self._process.poll() is None:
            with contextlib.suppress(OSError, TimeoutError, RuntimeError):
                self.request({"cmd": "quit"}, timeout_s)
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._reader.join(timeout=10)
        self._log.close()
        return int(self._process.returncode)


@dataclass
class MemoryTimeline:
    """Samples pools' mapped bytes (limit records) and a budget (its file) every `interval_s`.

    Each sample: seconds since start, mapped bytes per pool, the budget's capacity, and the
    bytes its live members charge, per pid. Events (label, seconds) mark what the caller did.
    A pool ending in `*` is every live pool whose name starts so, summed: an engine that names
    its pools itself (SGLang's `sglang-<kind>-<pid>-<n>`, new names at every restart).
    """

    pools: list[str]
    budget: str
    directory: Path
    interval_s: float = 0.05
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _started: float = 0.0

    def __enter__(self) -> MemoryTimeline:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def now(self) -> float:
        return time.monotonic() - self._started

    def mark(self, label: str) -> None:
        self.events.append((label, self.now()))

    def sample(self) -> dict[str, Any]:
        from kvcached_core.budget import read_budget
        from kvcached_core.limits import (
            CorruptRecordError,
            UnknownPoolError,
            read_record,
            scan_records,
        )

        row: dict[str, Any] = {"t": self.now()}
        for pool in self.pools:
            if pool.endswith("*"):
                records, _ = scan_records(self.directory)
                row[pool] = sum(r.used_bytes + r.reserved_bytes for r in records
                                if r.pool.startswith(pool[:-1]) and not r.stale)
                continue
            try:
                record = read_record(pool, self.directory)
                row[pool] = record.used_bytes + record.reserved_bytes
            except (UnknownPoolError, CorruptRecordError):  # gone, or being rewritten
                row[pool] = 0
        state = read_budget(self.budget, self.directory)
        row["capacity"] = state.capacity_bytes
        row["charged"] = state.charged_bytes
        row["charged_by_pid"] = {m.pid: m.charged_bytes for m in state.members}
        return row

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval_s)

    def write_csv(self, path: Path, pids: dict[str, int]) -> None:
        """One row per sample: t, each pool's mapped and charged bytes, their sums, budget."""
        with path.open("w", newline="", encoding="utf-8") as out:
            writer = csv.writer(out)
            writer.writerow(["t_s", *(f"{p}_mapped" for p in self.pools),
                             *(f"{p}_charged" for p in self.pools), "sum_mapped",
                             "sum_charged", "budget"])
            for row in self.samples:
                mapped = [row[p] for p in self.pools]
                charged = [row["charged_by_pid"].get(pids[p], 0) for p in self.pools]
                writer.writerow([f"{row['t']:.3f}", *mapped, *charged, sum(mapped),
                                 row["charged"], row["capacity"]])


class Colocation:
    """Two engines (pools `<prefix>-a`, `<prefix>-b`) joined to one budget, and its timeline."""

    def __init__(self, python: Path, model: Path, hidden_dir: Path, shm_dir: Path, *,
                 budget: str, budget_bytes: int, settings: dict[str, str],
                 interval_s: float = 0.05, prefix: str = "colo",
                 extra_pythonpath: str = "") -> None:
        from kvcached_core.budget import set_budget

        from .vllm_cpu_env import engine_env

        self.shm_dir = shm_dir
        self.budget = budget
        set_budget(budget, budget_bytes, directory=shm_dir)
        self.pools = {label: f"{prefix}-{label}" for label in ("a", "b")}
        self.engines: dict[str, EngineProcess] = {}
        for label, pool in self.pools.items():
            env = engine_env(hidden_dir, shm_dir, extra={
                **settings, "KVCACHED_BUDGET": budget, "KVCACHED_POOL_NAME": pool})
            if extra_pythonpath:
                env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{extra_pythonpath}"
            self.engines[label] = EngineProcess(label, python, model, env,
                                                shm_dir.parent / f"engine-{label}.log")
        self.timeline = MemoryTimeline(list(self.pools.values()), budget, shm_dir, interval_s)

    def start(self, timeout_s: float = 300) -> None:
        for engine in self.engines.values():
            engine.wait_ready(timeout_s)
        self.timeline.__enter__()

    def bursts(self, labels: str, prompts: list[list[int]], max_tokens: int,
               timeout_s: float = 180) -> dict[str, dict[str, Any]]:
        """Bursts to every engine in `labels` at once (one label: one engine alone)."""
        results: dict[str, dict[str, Any]] = {}

        def run(label: str) -> None:
            try:
                results[label] = self.engines[label].burst(prompts, max_tokens, timeout_s)
            except (TimeoutError, RuntimeError) as exc:  # the engine hung or died
                results[label] = {"outputs": [], "failed": len(prompts), "errors": [str(exc)],
                                  "seconds": timeout_s, "generated_tokens": 0,
                                  "preemptions": 0.0}

        threads = []
        for label in labels:
            self.timeline.mark(f"burst {label}")
            thread = threading.Thread(target=run, args=(label,))
            threads.append(thread)
            thread.start()
        for thread in threads:
            thread.join()
        return results

    def wait_limit_applied(self, label: str, limit_bytes: int, timeout_s: float = 10) -> None:
        """Until engine `label`'s pool applies a limit of at most `limit_bytes` (an idle engine
        picks a new `kvctl limit` up within its limit watcher's and idle tick's periods)."""
        deadline = time.monotonic() + timeout_s
        while self.engines[label].request({"cmd": "state"})["limit_bytes"] > limit_bytes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {label} did not apply a limit of {limit_bytes} B")
            time.sleep(IDLE_TICK_S)

    def peak_charged(self, label: str, since_s: float = 0.0) -> int:
        pid = self.engines[label].pid
        return max((row["charged_by_pid"].get(pid, 0) for row in self.timeline.samples
                    if row["t"] >= since_s), default=0)

    def close(self) -> dict[str, int]:
        with contextlib.suppress(AssertionError):
            self.timeline.__exit__()
        return {label: engine.close() for label, engine in self.engines.items()}


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    serve(Path(argv[1]), int(argv[argv.index("--tp") + 1]) if "--tp" in argv else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
