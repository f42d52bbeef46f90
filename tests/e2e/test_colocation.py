"""Colocation: two patched vLLM CPU engines on one host share one KV memory budget.

Engines A and B (each its own process, `vllm_colocation_run.py`) join budget `colo`, sized so
that neither can hold its full working set while the other holds its own. Phases:

1. Solo: alternating bursts to each engine alone; each completes with full-length greedy output
   and no preemption, and an engine's first burst is its reference.
2. Contention: both engines burst at once with no per-engine limit, together needing more than
   the budget. Pages one engine holds are refused to the other (vLLM preempts, or a lost page
   race inside `allocate_slots` ends as "no blocks"); every request still completes with its
   engine's solo output.
3. `kvctl limit` on A while it is idle caps A; both burst at once and B holds far more than it
   could while A held its working set. `kvctl list` shows both pools and the budget.

Throughout, the bytes both pools charge, sampled every 50 ms from the budget file, never exceed
the budget.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_core.limits import read_record

from .vllm_colocation_run import Colocation
from .vllm_cpu_env import build_tiny_model, engine_env
from .vllm_cpu_run import MAX_TOKENS, workload_token_ids

PAGE = 16 << 10  # KVCACHED_PAGE_SIZE: one 32-token block of one layer
PAGE_ALL_LAYERS = 2 * PAGE  # what one ledger page maps: both layers
WORKING_SET_PAGES = 28  # measured peak of one burst is 30-32 pages (8 running requests)
BUDGET_PAGES = 44  # < two working sets; >= one working set + a limited neighbour
LIMIT_A_PAGES = 10  # room for a request or two of A at a time
SETTINGS = {
    "KVCACHED_PAGE_SIZE": str(PAGE),
    "KVCACHED_MAX_CACHED_TOKENS": "0",  # an idle engine keeps nothing mapped but its null page
    # One compute thread per engine: two engines that each spin a thread per core on a 2-core
    # host run their concurrent bursts 5-30x slower than their share of the CPU.
    "OMP_NUM_THREADS": "1",
}
BURST_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def colocation(engine_venv: Path, unloadable_packages_hidden: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Colocation]:
    where = tmp_path_factory.mktemp("colocation")
    shm = where / "shm"
    shm.mkdir()
    model = build_tiny_model(engine_venv, where / "model",
                             engine_env(unloadable_packages_hidden, where))
    scenario = Colocation(engine_venv, model, unloadable_packages_hidden, shm, budget="colo",
                          budget_bytes=BUDGET_PAGES * PAGE_ALL_LAYERS, settings=SETTINGS)
    try:
        scenario.start()
        yield scenario
    finally:
        codes = scenario.close()
    assert codes == {"a": 0, "b": 0}
    assert [p.name for p in shm.iterdir()] == ["kvcached-budget-colo"], "a pool outlived its engine"


def _kvctl(shm: Path, *argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kvcached_core.kvctl", "--shm-dir", str(shm),
                           *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _check_burst(result: dict[str, object], reference: list[list[int]]) -> None:
    assert result["failed"] == 0 and result["errors"] == [], result["errors"]
    assert result["outputs"] == reference


def _max_charged(colocation: Colocation, since_s: float) -> int:
    return max(row["charged"] for row in colocation.timeline.samples if row["t"] >= since_s)


def test_two_engines_share_one_budget(colocation: Colocation) -> None:
    budget = BUDGET_PAGES * PAGE_ALL_LAYERS
    prompts = workload_token_ids() * 2
    shm = colocation.shm_dir

    # Solo: each engine alone; its first burst is the reference for all its later ones.
    references: dict[str, list[list[int]]] = {}
    peaks: dict[str, int] = {}
    for label in "abab":
        since = colocation.timeline.now()
        result = colocation.bursts(label, prompts, MAX_TOKENS)[label]
        if label not in references:
            assert result["failed"] == 0, result["errors"]
            references[label] = result["outputs"]  # type: ignore[assignment]
            assert all(len(out) == MAX_TOKENS for out in references[label])
        _check_burst(result, references[label])
        assert result["preemptions"] == 0, "an engine alone never runs short of pages"
        peaks[label] = max(peaks.get(label, 0), colocation.peak_charged(label, since))
    assert references["a"] == references["b"], "same model, same prompts, greedy"
    # Each engine alone reached its working set; both at once would not fit the budget.
    assert min(peaks.values()) >= WORKING_SET_PAGES * PAGE_ALL_LAYERS
    assert peaks["a"] + peaks["b"] > budget

    # Contention: both at once, no per-engine limit. Each gets only what the other leaves.
    colocation.timeline.mark("contention")
    since = colocation.timeline.now()
    contended = colocation.bursts("ab", prompts, MAX_TOKENS)
    for label in "ab":
        _check_burst(contended[label], references[label])
    assert sum(contended[label]["preemptions"] for label in "ab") > 0, (
        "neither engine was refused a page: the bursts did not contend")
    assert budget - 4 * PAGE_ALL_LAYERS <= _max_charged(colocation, since) <= budget

    listing = _kvctl(shm, "list")
    assert "colo-a" in listing and "colo-b" in listing
    budget_row = next(line for line in listing.splitlines() if line.startswith("colo "))
    members = budget_row.split()[-1].split(",")
    assert sorted(members) == sorted(str(e.pid) for e in colocation.engines.values())

    # kvctl limit on A while it is idle: applied by A's idle tick, A's record follows.
    limit = LIMIT_A_PAGES * PAGE_ALL_LAYERS
    _kvctl(shm, "limit", "colo-a", str(limit))
    colocation.timeline.mark("kvctl limit colo-a")
    colocation.wait_limit_applied("a", limit)
    deadline = time.monotonic() + 10
    while read_record("colo-a", shm).used_bytes + read_record("colo-a", shm).reserved_bytes > limit:
        assert time.monotonic() < deadline, "A did not shrink to its limit while idle"
        time.sleep(0.05)

    since = colocation.timeline.now()
    both = colocation.bursts("ab", prompts, MAX_TOKENS)
    for label in "ab":
        _check_burst(both[label], references[label])
    assert colocation.peak_charged("a", since) <= limit
    # B now holds far more than the budget left it while A held its working set.
    assert colocation.peak_charged("b", since) > budget - peaks["a"]

    samples = colocation.timeline.samples
    assert len(samples) > 20
    worst = max(samples, key=lambda row: row["charged"])
    assert worst["charged"] <= budget, worst
    assert all(row["capacity"] == budget for row in samples)
