"""Several SGLang engines on one GPU, each set up as if it had the GPU to itself
(`mem_fraction_static=0.9`): patched engines under one shared kvcached budget, and how many
stock engines with the same setting fit.

Phases, in this order:
1. stock (with `--stock-site`): stock engines started one after another, each once the last is
   up, until one fails or `--stock-engines` run; then every one that started bursts at once.
   The first one also serves two short requests while the others start, so SGLang's JIT
   kernels are built (and cached on disk) before any patched engine serves.
2. solo: one patched engine alone on the device bursts once: the reference output.
3. for each start mode (`--modes at-once,staggered`): `--engines` patched engines join one
   budget (`--budget`), started at the same moment or `--stagger-s` apart. At once: the first
   burst of every engine overlaps the others'. Staggered: each engine bursts as soon as it is
   up, while later ones are still starting. Then one overlapping burst of all, alternating
   bursts of two halves (`--alternate-rounds`), and `--idle-s` of idle.

Every burst is the same set of greedy requests (shared prefixes, fixed length); the prefix
cache bound is 0 by default (`--max-cached-tokens`, `KVCACHED_MAX_CACHED_TOKENS`), as in the
recorded run, which predates the bound's page count: with SGLang's one-token pages a cached
request's slots lie on every page a burst used.

A sampler thread reads NVML (device memory in use, all processes), every pool's limit record
(kvcached's mapped KV, attributed to an engine by the process session its owner is in) and
the budget's charge every `--sample-s`; each phase's timeline goes to a CSV and a PNG.

Checks (exit 1 if any fails): the solo engine serves; in every mode every engine starts, no
request fails or ends short, each engine's first burst is token-identical to the solo burst,
and the budget's charge never exceeds its capacity. The stock phase is reported, not judged.

    python benchmarks/gpu_sglang_colocation.py --make-model DIR --out DIR \\
        --patched-site PATH --stock-site PATH [--engines 4] [--budget 4GiB]

A site PATH is prepended to that engine's PYTHONPATH: a directory (or several, joined with
':') holding that sglang build and its dependencies; the patched one also needs kvcached_core.
The sampler needs kvcached_core importable in this process too. `--engine-kwargs` (JSON)
overrides `sglang.Engine(...)` arguments, e.g. for a CPU trial run
(`{"device": "cpu", "attention_backend": "torch_native", "max_total_tokens": 4096}`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_colocation import Timeline, Verdict, parse_size, run_bursts  # noqa: E402
from gpu_engine_server import MSG, EngineProcess, EngineSpec, output_digest  # noqa: E402
from gpu_sglang_e2e import SPECIAL_TOKENS, Workload, kv_bytes_per_token  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
E2E_SCRIPT = Path(__file__).resolve().with_name("gpu_sglang_e2e.py")

# Lines of an engine's log worth keeping in the summary: what free memory it saw, what KV it
# sized, what the start-up seams said (window waits, neighbours' KV counted back), errors,
# and SGLang's retractions when the KV it can take runs short.
LOG_PATTERNS = re.compile(
    r"kvcached|start-up window|avail mem=|max_total_num_tokens=|KV Cache is allocated|"
    r"Error|error:|out of memory|Traceback|Retract requests")


# ---------------------------------------------------------------------------------- child


def _emit(message: Mapping[str, Any]) -> None:
    print(MSG + json.dumps(message), flush=True)


def serve(args: argparse.Namespace) -> int:
    """One `sglang.Engine`, driven by commands on stdin: `start`, then `warm`, `burst TAG`,
    `quit`. The import comes before `start`, so that a parent can have it done ahead of the
    moment the engine is to start (it takes about as long as the engine's own start)."""
    t0 = time.perf_counter()
    import sglang

    import_s = round(time.perf_counter() - t0, 2)
    _emit({"event": "imported", "import_s": import_s})
    for line in sys.stdin:
        if line.strip() == "start":
            break
        if line.strip() == "quit":
            os._exit(0)
    else:
        os._exit(0)
    kwargs = json.loads(args.engine_kwargs)
    t0 = time.perf_counter()
    try:
        engine = sglang.Engine(**kwargs)
    except BaseException as exc:  # SystemExit too: the parent counts the start as failed
        _emit({"event": "start_failed", "import_s": import_s,
               "error": f"{type(exc).__name__}: {exc}"[:2000]})
        sys.stdout.flush()
        os._exit(3)
    start_s = round(time.perf_counter() - t0, 2)
    try:
        info = engine.get_server_info()
        max_tokens: int | None = info.get("max_total_num_tokens")
    except Exception:  # informative only
        max_tokens = None
    try:
        from sglang import _kvcached_build  # noqa: F401  (only the patched build has it)

        patched = True
    except ImportError:
        patched = False
    vocab = int(json.loads((Path(kwargs["model_path"]) / "config.json").read_text())
                ["vocab_size"])
    work = Workload(args.prefixes, args.per_prefix, args.prefix_tokens, args.max_new_tokens,
                    rounds=1, idle_s=0.0)
    prompts = work.prompts(vocab)
    params = {"temperature": 0.0, "max_new_tokens": work.max_new_tokens, "ignore_eos": True}
    _emit({"event": "ready", "import_s": import_s, "start_s": start_s, "pid": os.getpid(),
           "patched_build": patched, "max_total_num_tokens": max_tokens,
           "t_ready": time.monotonic()})
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "quit":
            break
        if command[0] == "warm":
            # Two short requests that share nothing with the workload: SGLang builds its JIT
            # kernels on first use, and the build is cached on disk for every later engine.
            t0 = time.perf_counter()
            try:
                engine.generate(input_ids=[[SPECIAL_TOKENS + i] * 32 for i in range(2)],
                                sampling_params={"temperature": 0.0, "max_new_tokens": 8,
                                                 "ignore_eos": True})
                error = None
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"[:2000]
            _emit({"event": "warm", "seconds": round(time.perf_counter() - t0, 2),
                   "error": error})
            continue
        if command[0] != "burst":
            _emit({"event": "error", "error": f"unknown command {line.strip()!r}"})
            continue
        tag = command[1] if len(command) > 1 else ""
        t_start = time.monotonic()
        try:
            results = engine.generate(input_ids=prompts, sampling_params=params)
            error = None
        except Exception as exc:  # every request of the burst failed
            results, error = [], f"{type(exc).__name__}: {exc}"[:2000]
        t_end = time.monotonic()
        outputs = [list(r["output_ids"]) for r in results]
        _emit({
            "event": "burst", "tag": tag, "t_start": t_start, "t_end": t_end,
            "seconds": t_end - t_start, "tokens": sum(len(o) for o in outputs),
            "failed": len(prompts) - sum(len(o) == work.max_new_tokens for o in outputs),
            "error": error, "digests": [output_digest(o) for o in outputs],
            # Token ids of first bursts only: where an output first differs is worth knowing.
            "outputs": outputs if tag in ("first", "solo") else None,
        })
    try:
        engine.shutdown()
    except Exception as exc:  # reported; the measurements are already out
        print(f"engine shutdown failed: {exc!r}", file=sys.stderr, flush=True)
    _emit({"event": "bye"})
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------- parent


class SglangEngine(EngineProcess):
    """A child `sglang.Engine` (this file's `--child`), driven as `EngineProcess` drives a
    vLLM child: the same message queue, deadlines, `burst` and `close`."""

    def __init__(self, spec: EngineSpec, args: argparse.Namespace, log_dir: Path,
                 base_env: Mapping[str, str]) -> None:
        self.spec = spec
        env = dict(base_env)
        env.update(spec.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (spec.site, env.get("PYTHONPATH", ""))
                                            if p)
        command = [sys.executable, os.path.abspath(__file__), "--child",
                   "--engine-kwargs", json.dumps(spec.llm_kwargs)]
        for name in ("prefixes", "per_prefix", "prefix_tokens", "max_new_tokens"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        self.log_path = log_dir / f"{spec.name}.log"
        self._log = self.log_path.open("w")
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self.started = time.monotonic()
        # A session of its own: SGLang's scheduler and detokenizer processes are in it, so the
        # sampler can tell whose pool a record is, and one killpg leaves nothing behind.
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def start(self, timeout: float) -> dict[str, Any]:
        """Start the engine once its import is done; its `ready` (or why not)."""
        message = self.wait_for(("imported",), timeout)
        if message.get("event") != "imported":
            return message
        self.started = time.monotonic()
        if not self.send("start"):
            return {"event": "exit"}
        return self.wait_for(("ready",), timeout)

    def stop(self, timeout: float) -> None:
        with contextlib.suppress(Exception):
            self.close(timeout)
        # Whatever of the engine's session outlived its shutdown (a scheduler that hung) would
        # hold device memory into the next phase.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def burst_all(engines: Mapping[str, SglangEngine], names: list[str], tag: str,
              timeout: float) -> list[tuple[str, dict[str, Any]]]:
    """`names` burst at the same moment; each answer, in the order of `names`."""
    processes: dict[str, EngineProcess] = dict(engines)
    return run_bursts(processes, names, tag, timeout)


def stop_all(engines: Mapping[str, SglangEngine], timeout: float = 30.0) -> None:
    if not engines:
        return
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        list(pool.map(lambda e: e.stop(timeout), engines.values()))
    # The driver returns a killed process's memory asynchronously; the next phase's start-up
    # sizing and its first samples should not see this one's.
    time.sleep(2.0)


def _session_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[3])  # state, ppid, pgrp, session


class EngineTimeline(Timeline):
    """`Timeline` with one KV column per engine. SGLang names its pools by the scheduler's pid;
    a record is an engine's when its owner is in the session of that engine's child."""

    def __init__(self, budget: str, engines: list[str], period_s: float,
                 shm_dir: str | None) -> None:
        super().__init__(budget, engines, period_s, shm_dir)
        self.sessions: dict[int, str] = {}
        self._owners: dict[int, str | None] = {}

    def register(self, name: str, session: int) -> None:
        self.sessions[session] = name

    def at(self, monotonic: float) -> float:
        return monotonic - self._t0

    def _engine_of(self, owner: int) -> str | None:
        if owner not in self._owners or self._owners[owner] is None:
            session = _session_of(owner)
            self._owners[owner] = None if session is None else self.sessions.get(session)
        return self._owners[owner]

    def sample(self) -> dict[str, float]:
        from kvcached_core.budget import read_budget
        from kvcached_core.limits import list_records

        row: dict[str, float] = {"t": time.monotonic() - self._t0}
        if self._nvml is not None:
            nvml, handle = self._nvml
            row["device_used"] = float(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        for pool in self.pools:
            row[f"kv_{pool}"] = 0.0
            row[f"inuse_{pool}"] = 0.0
        for record in list_records(self.shm_dir):
            engine = self._engine_of(record.owner_pid)
            if engine is None:
                continue
            row[f"kv_{engine}"] += float(record.used_bytes + record.reserved_bytes)
            row[f"inuse_{engine}"] += float(record.used_bytes)
        with contextlib.suppress(Exception):  # no budget in this phase
            state = read_budget(self.budget, self.shm_dir)
            row["budget_charged"] = float(state.charged_bytes)
            row["budget_capacity"] = float(state.capacity_bytes)
        return row

    def window(self, start: float, end: float) -> list[dict[str, float]]:
        return [r for r in self.rows if start <= r["t"] <= end]


def _gib(value: float | None) -> float | None:
    return None if value is None else round(value / GIB, 2)


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def _peak(rows: list[dict[str, float]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return max(values) if values else None


def log_excerpt(path: Path, limit: int = 14) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    kept = [line[:400] for line in lines if LOG_PATTERNS.search(line)
            and not line.startswith(MSG)]
    return kept[:limit]


def engine_environment(args: argparse.Namespace, extra: Mapping[str, str]) -> dict[str, str]:
    """What every child starts from: no inherited kvcached settings, offline, no multicast."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    env.update(extra)
    env.update(item.split("=", 1) for item in args.env)
    return env


def patched_env(args: argparse.Namespace, shm_dir: str, name: str,
                budget: str | None) -> dict[str, str]:
    extra = {"KVCACHED_ENABLE": "1", "KVCACHED_SHM_DIR": shm_dir,
             "KVCACHED_MAX_CACHED_TOKENS": str(args.max_cached_tokens),
             "KVCACHED_POOL_NAME": name}
    if budget:
        extra["KVCACHED_BUDGET"] = budget
    return engine_environment(args, extra)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model_path=args.model, dtype="bfloat16", attention_backend=args.attention_backend,
        sampling_backend="pytorch", mem_fraction_static=args.mem_fraction_static,
        random_seed=0, log_level="info", skip_server_warmup=True,
        disable_flashinfer_autotune=True,
    )
    if args.cuda_graph_max_bs > 0:
        kwargs["cuda_graph_max_bs_decode"] = args.cuda_graph_max_bs
    else:
        kwargs["disable_cuda_graph"] = True
    kwargs.update(json.loads(args.engine_kwargs))
    return kwargs


def start_info(engine: SglangEngine, message: dict[str, Any], timeline: EngineTimeline,
               kv_per_token: int) -> dict[str, Any]:
    """What an engine's start reported, with the device and its KV at that moment."""
    info: dict[str, Any] = {"event": message.get("event")}
    if message.get("event") == "ready":
        now = timeline.sample()
        tokens = message.get("max_total_num_tokens")
        info.update(
            import_s=message.get("import_s"), start_s=message.get("start_s"),
            ready_after_s=round(message["t_ready"] - engine.started, 1),
            max_total_num_tokens=tokens,
            kv_capacity_gib=_gib(tokens * kv_per_token) if tokens else None,
            device_used_at_ready_gib=_gib(now.get("device_used")),
            kv_mapped_at_ready_mib=_mib(now.get(f"kv_{engine.spec.name}")),
            patched_build=message.get("patched_build"),
        )
    else:
        info["error"] = message.get("error") or message.get("rc")
    info["log"] = log_excerpt(engine.log_path)
    return info


def first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                 min(len(x), len(y))) for x, y in zip(a, b, strict=False) if x != y]


def burst_failures(bursts: list[tuple[str, dict[str, Any]]], requests: int) -> int:
    """Requests that failed or ended short; a burst that never answered loses them all."""
    return sum(int(b.get("failed", requests)) if b.get("event") == "burst" else requests
               for _, b in bursts)


def burst_report(name: str, burst: dict[str, Any], timeline: EngineTimeline
                 ) -> dict[str, Any]:
    if burst.get("event") != "burst":
        return {"event": burst.get("event"), "error": burst.get("error")}
    start, end = timeline.at(burst["t_start"]), timeline.at(burst["t_end"])
    rows = timeline.window(start, end)
    return {"tag": burst["tag"], "t": [round(start, 1), round(end, 1)],
            "seconds": round(burst["seconds"], 2),
            "tok_s": round(burst["tokens"] / burst["seconds"], 1) if burst["seconds"] else None,
            "failed": burst["failed"], "error": burst.get("error"),
            "peak_kv_mapped_mib": _mib(_peak(rows, f"kv_{name}")),
            "peak_kv_in_use_mib": _mib(_peak(rows, f"inuse_{name}"))}


# ---------------------------------------------------------------------------------- phases


class Phase:
    """One phase's engines, launched ahead of it: each child imports sglang and waits for its
    `start`, so the next phase's imports run while the current phase measures."""

    def __init__(self, args: argparse.Namespace, kind: str, names: list[str], out: Path,
                 budget: str | None = None) -> None:
        from kvcached_core.budget import set_budget

        self.kind = kind
        self.names = names
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.shm_dir: str | None = None
        self.budget = budget
        self.capacity = parse_size(args.budget)
        if kind == "stock":
            env = {name: engine_environment(args, {"KVCACHED_ENABLE": "0"}) for name in names}
            site = args.stock_site
        else:
            # Pool records, the budget and the device's start-up window: one directory per
            # phase, so no phase sees another's records.
            self.shm_dir = tempfile.mkdtemp(prefix=f"kvcached-{kind}-")
            if budget:
                set_budget(budget, self.capacity, directory=self.shm_dir)
            env = {name: patched_env(args, self.shm_dir, name, budget) for name in names}
            site = args.patched_site
        self.engines = {name: SglangEngine(EngineSpec(name, site, engine_kwargs(args)), args,
                                           out, env[name]) for name in names}

    def timeline(self, args: argparse.Namespace) -> EngineTimeline:
        timeline = EngineTimeline(self.budget or "none", self.names, args.sample_s,
                                  self.shm_dir)
        for name, engine in self.engines.items():
            timeline.register(name, engine.proc.pid)
        timeline.start()
        return timeline

    def close(self, timeline: EngineTimeline, title: str) -> None:
        stop_all(self.engines)
        timeline.mark("closed")
        timeline.stop()
        timeline.write(self.out, title)
        if self.shm_dir:
            shutil.rmtree(self.shm_dir, ignore_errors=True)


def count_stock(args: argparse.Namespace, phase: Phase) -> dict[str, Any]:
    """Stock engines at the same fraction, each started once the last is up, until one fails;
    then every one that started serves a burst."""
    timeline = phase.timeline(args)
    engines = phase.engines
    starts: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {"engines_tried": 0}
    deadline = time.monotonic() + args.stock_phase_s
    try:
        for index, name in enumerate(phase.names):
            left = deadline - time.monotonic()
            if left < 30:
                report["stopped"] = "stock phase time limit"
                break
            timeline.mark(f"start {name}")
            engine = engines[name]
            report["engines_tried"] += 1
            message = engine.start(min(args.start_timeout, left))
            starts[name] = start_info(engine, message, timeline, args.kv_per_token)
            print(f"   {name}: {_short(starts[name])}", flush=True)
            if message.get("event") != "ready":
                engine.stop(10.0)
                starts[name]["log_tail"] = engine.log_path.read_text(
                    errors="replace").splitlines()[-25:]
                break
            if index == 0:
                engine.send("warm")
        live = [n for n in phase.names if starts.get(n, {}).get("event") == "ready"]
        report["started"] = len(live)
        if live:
            warm = engines[live[0]].wait_for(
                ("warm",), max(10.0, min(args.warm_timeout, deadline + 60 - time.monotonic())))
            report["warm"] = {k: v for k, v in warm.items() if k != "event"}
            timeline.mark("burst (all stock)")
            # An engine left without memory for its activations may hang rather than fail:
            # the count must not cost the patched phases their time.
            bursts = burst_all(engines, live, "first", min(args.burst_timeout, 40.0))
            report["failed_requests"] = burst_failures(bursts, args.requests)
            report["bursts"] = {n: burst_report(n, b, timeline) for n, b in bursts}
            report["outputs"] = {n: b.get("outputs") for n, b in bursts}
        report["start"] = starts
        report["peak_device_used_gib"] = _gib(_peak(timeline.rows, "device_used"))
    finally:
        phase.close(timeline, f"stock SGLang engines at mem_fraction_static "
                              f"{args.mem_fraction_static}, one after another")
    return report


def run_solo(args: argparse.Namespace, phase: Phase) -> dict[str, Any]:
    """One patched engine alone on the device: its burst is every engine's reference."""
    timeline = phase.timeline(args)
    engine = phase.engines["solo"]
    report: dict[str, Any] = {}
    try:
        message = engine.start(args.start_timeout)
        report["start"] = start_info(engine, message, timeline, args.kv_per_token)
        print(f"   solo: {_short(report['start'])}", flush=True)
        if message.get("event") == "ready":
            timeline.mark("solo burst")
            # The first patched burst may still build a JIT kernel the stock engines did not
            # use: the warm-up's limit.
            burst = engine.burst("solo", args.warm_timeout)
            report["burst"] = burst_report("solo", burst, timeline)
            report["failed_requests"] = burst_failures([("solo", burst)], args.requests)
            report["outputs"] = burst.get("outputs")
            timeline.mark("idle")
            time.sleep(args.idle_s)
            idle = timeline.sample()
            report["idle_kv_mapped_mib"] = _mib(idle.get("kv_solo"))
            report["idle_kv_in_use_mib"] = _mib(idle.get("inuse_solo"))
            report["idle_device_used_gib"] = _gib(idle.get("device_used"))
        report["peak_device_used_gib"] = _gib(_peak(timeline.rows, "device_used"))
        report["peak_kv_mapped_mib"] = _mib(_peak(timeline.rows, "kv_solo"))
    finally:
        phase.close(timeline, "one patched SGLang engine alone (the reference)")
    return report


def run_mode(args: argparse.Namespace, mode: str, phase: Phase,
             reference: list[list[int]] | None) -> dict[str, Any]:
    names = phase.names
    engines = phase.engines
    capacity = phase.capacity
    timeline = phase.timeline(args)
    ready: dict[str, dict[str, Any]] = {}
    starts: dict[str, dict[str, Any]] = {}
    first: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {"mode": mode, "engines": len(names), "budget_bytes": capacity}
    # Imports first (they ran during the last phase): "at the same moment" is the moment
    # every `sglang.Engine(...)` is called.
    for engine in engines.values():
        engine.wait_for(("imported",), args.start_timeout)
        engine.messages.put({"event": "imported"})
    origin = time.monotonic()

    def bring_up(index: int) -> None:
        name = names[index]
        if mode == "staggered":
            time.sleep(max(0.0, origin + index * args.stagger_s - time.monotonic()))
        timeline.mark(f"start {name}")
        engine = engines[name]
        ready[name] = engine.start(args.start_timeout)
        starts[name] = start_info(engine, ready[name], timeline, args.kv_per_token)
        print(f"   {name}: {_short(starts[name])}", flush=True)
        if mode == "staggered" and ready[name].get("event") == "ready":
            # Traffic as soon as an engine is up: its burst maps pages while later engines
            # take their start-up figures.
            timeline.mark(f"first burst {name}")
            first[name] = engine.burst("first", args.burst_timeout)

    try:
        timeline.mark(f"start ({mode})")
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            list(pool.map(bring_up, range(len(names))))
        live = [n for n in names if ready.get(n, {}).get("event") == "ready"]
        report["started"] = len(live)
        # The log excerpts again now: a neighbour's window wait may be logged after ready.
        for name in starts:
            starts[name]["log"] = log_excerpt(engines[name].log_path)
        report["start"] = starts
        if mode != "staggered":
            timeline.mark("first bursts (overlapping)")
            first.update(burst_all(engines, live, "first", args.burst_timeout))
        bursts: list[tuple[str, dict[str, Any]]] = [(n, first[n]) for n in live if n in first]
        timeline.mark("overlapping")
        bursts += burst_all(engines, live, "overlap", args.burst_timeout)
        half = max(1, len(live) // 2)
        for round_index in range(args.alternate_rounds):
            for side, group in (("A", live[:half]), ("B", live[half:])):
                if group:
                    timeline.mark(f"alternating {side}{round_index + 1}")
                    bursts += burst_all(engines, group, f"alt{side}{round_index + 1}",
                                        args.burst_timeout)
        timeline.mark("idle")
        time.sleep(args.idle_s)
        idle = timeline.sample()
        report["idle_kv_mapped_mib"] = {n: _mib(idle.get(f"kv_{n}")) for n in live}
        report["idle_kv_in_use_mib"] = {n: _mib(idle.get(f"inuse_{n}")) for n in live}
        report["idle_device_used_gib"] = _gib(idle.get("device_used"))
        report["bursts"] = {n: [burst_report(n, b, timeline) for m, b in bursts if m == n]
                            for n in live}

        failed = burst_failures(bursts, args.requests)
        same = compared = 0
        divergence: dict[str, list[int | None]] = {}
        if reference is not None:
            ref_digests = [output_digest(o) for o in reference]
            for name in live:
                outputs = first.get(name, {}).get("outputs") or []
                compared += len(reference)
                same += sum(output_digest(o) == d
                            for o, d in zip(outputs, ref_digests, strict=False))
                if outputs != reference:
                    divergence[name] = first_divergence(outputs, reference)[:8]
            later = [b["digests"] for _, b in bursts
                     if b.get("tag") != "first" and b.get("event") == "burst"]
            later_same = sum(d == r for digests in later
                             for d, r in zip(digests, ref_digests, strict=False))
            # Reported, not judged: the check is on each engine's first burst.
            report["later_bursts_identical_to_solo"] = (
                f"{later_same}/{len(later) * len(reference)}")
        peak_charged = _peak(timeline.rows, "budget_charged") or 0.0
        peak_sum = max((sum(r.get(f"kv_{n}", 0.0) for n in names) for r in timeline.rows),
                       default=0.0)
        verdict = Verdict(len(live), len(names), failed, compared - same, compared,
                          peak_charged, float(capacity))
        report.update(
            requests=len(bursts) * args.requests,
            failed_requests=failed,
            first_burst_identical_to_solo=f"{same}/{compared}" if reference else "no reference",
            first_divergence=divergence,
            peak_budget_charged_mib=_mib(peak_charged),
            budget_exceeded=peak_charged > capacity,
            peak_kv_mapped_sum_mib=_mib(peak_sum),
            peak_kv_mapped_mib={n: _mib(_peak(timeline.rows, f"kv_{n}")) for n in names},
            peak_device_used_gib=_gib(_peak(timeline.rows, "device_used")),
            failures=verdict.failures() + ([] if reference else ["no solo reference"]),
        )
    finally:
        phase.close(timeline, f"{len(names)} patched SGLang engines at mem_fraction_static "
                              f"{args.mem_fraction_static}, {mode}, budget {args.budget}")
    return report


def _short(info: dict[str, Any]) -> str:
    if info.get("event") != "ready":
        return f"did not start ({info.get('event')}): {str(info.get('error'))[:300]}"
    return (f"up after {info.get('ready_after_s')} s, {info.get('max_total_num_tokens')} "
            f"tokens ({info.get('kv_capacity_gib')} GiB of KV), device "
            f"{info.get('device_used_at_ready_gib')} GiB, kv mapped "
            f"{info.get('kv_mapped_at_ready_mib')} MiB")


def make_model(args: argparse.Namespace) -> None:
    """The random-weight Llama of gpu_sglang_e2e.py, written by its own writer in a child on
    an engine's path (transformers and tokenizers come with the engine)."""
    if (Path(args.model) / "config.json").exists():
        return
    site = args.stock_site or args.patched_site
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (site, os.environ.get("PYTHONPATH", "")) if p))
    subprocess.run([sys.executable, str(E2E_SCRIPT), "--write-model", args.model,
                    "--vocab-words", str(args.vocab_words)], check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (with --make-model: where to write)")
    parser.add_argument("--make-model", metavar="DIR",
                        help="write gpu_sglang_e2e.py's random-weight Llama to DIR and use it")
    parser.add_argument("--vocab-words", type=int, default=2048)
    parser.add_argument("--patched-site", help="PYTHONPATH of the patched engines")
    parser.add_argument("--stock-site", help="PYTHONPATH of stock engines: count how many fit")
    parser.add_argument("--out", default="gpu-sglang-colocation-out")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--stock-engines", type=int, default=4,
                        help="stop the stock count after this many started")
    parser.add_argument("--budget", default="4GiB", help="shared kvcached budget per mode")
    parser.add_argument("--modes", default="at-once,staggered")
    parser.add_argument("--stagger-s", type=float, default=8.0)
    parser.add_argument("--alternate-rounds", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--sample-s", type=float, default=0.1)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--mem-fraction-static", type=float, default=0.9)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=0,
                        help="largest captured decode batch; 0 (default) runs eager")
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--max-cached-tokens", type=int, default=0,
                        help="KVCACHED_MAX_CACHED_TOKENS of the patched engines")
    parser.add_argument("--engine-kwargs", default="{}",
                        help="JSON object overriding sglang.Engine(...) arguments")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for every engine")
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--burst-timeout", type=float, default=90.0)
    parser.add_argument("--warm-timeout", type=float, default=200.0,
                        help="limit of a first burst that may build JIT kernels")
    parser.add_argument("--stock-phase-s", type=float, default=200.0,
                        help="no stock engine is started after this many seconds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return serve(args)
    # A run stopped by `timeout` still ends its engines and writes its timelines.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if any("=" not in item for item in args.env):
        parser.error("--env wants KEY=VALUE")
    if not args.patched_site:
        parser.error("--patched-site is required")
    if args.make_model:
        args.model = args.make_model
    if not args.model:
        parser.error("--model or --make-model is required")
    make_model(args)
    args.kv_per_token = kv_bytes_per_token(Path(args.model))
    args.requests = args.prefixes * args.per_prefix
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
    }
    failures: list[str] = []

    def save() -> None:
        # After every phase: a run cut short keeps what it measured.
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    def patched_phase(mode: str) -> Phase:
        return Phase(args, mode, [f"{mode}-{i}" for i in range(args.engines)], out / mode,
                     budget=f"sglang-{mode}")

    t0 = time.monotonic()
    phases: list[Phase] = []
    try:
        stock = None
        if args.stock_site:
            stock = Phase(args, "stock", [f"stock-{i}" for i in range(args.stock_engines)],
                          out / "stock")
            phases.append(stock)
        solo_phase = Phase(args, "solo", ["solo"], out / "solo")
        phases.append(solo_phase)
        if stock is not None:
            print("== stock", flush=True)
            summary["stock"] = count_stock(args, stock)
            summary["stock"]["phase_s"] = round(time.monotonic() - t0, 1)
            save()
        # Each phase's children import while the phase before it runs.
        upcoming = [patched_phase(mode) for mode in modes[:1]]
        phases += upcoming
        print("== solo", flush=True)
        t1 = time.monotonic()
        solo = run_solo(args, solo_phase)
        solo["phase_s"] = round(time.monotonic() - t1, 1)
        summary["solo"] = solo
        reference: list[list[int]] | None = solo.get("outputs")
        if not reference or solo.get("failed_requests"):
            failures.append("solo: the reference engine did not serve its burst in full")
        stock_outputs = summary.get("stock", {}).pop("outputs", None) or {}
        if reference and stock_outputs:
            summary["stock"]["identical_to_patched_solo"] = {
                n: f"{sum(a == b for a, b in zip(o or [], reference, strict=False))}"
                   f"/{len(reference)}" for n, o in stock_outputs.items()}
        solo.pop("outputs", None)
        save()
        for index, mode in enumerate(modes):
            phase = upcoming.pop(0)
            if index + 1 < len(modes):
                upcoming.append(patched_phase(modes[index + 1]))
                phases.append(upcoming[-1])
            print(f"== {mode}", flush=True)
            t1 = time.monotonic()
            report = run_mode(args, mode, phase, reference)
            report["phase_s"] = round(time.monotonic() - t1, 1)
            summary[mode] = report
            failures += [f"{mode}: {line}" for line in report.get("failures", [])]
            save()
            print(json.dumps({k: v for k, v in report.items() if k not in ("start", "bursts")},
                             indent=1), flush=True)
    finally:
        # Children of phases that never ran (a run cut short) wait on stdin: end them.
        for phase in phases:
            for engine in phase.engines.values():
                engine.kill()
    summary["failures"] = failures
    summary["total_s"] = round(time.monotonic() - t0, 1)
    save()
    for line in failures:
        print(f"FAIL {line}")
    print("ok" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
