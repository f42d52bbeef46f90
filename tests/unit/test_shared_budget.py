"""Shared memory budgets: several processes' pools charge one host-wide capacity."""

from __future__ import annotations

import gc
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvcached_core.budget import (
    FILE_SIZE,
    CorruptBudgetError,
    UnknownBudgetError,
    budget_path,
    process_start_time,
    read_budget,
    set_budget,
)
from kvcached_core.errors import KVCachedConfigError, PoolExhausted
from kvcached_core.kvctl import main as kvctl_main
from kvcached_core.pool import KVPool
from kvcached_core.settings import KVCachedSettings
from tests.unit.pool_factory import create_pool

KIB = 1024
MIB = 1 << 20
PAGE = 64 * KIB
# 2 layers x 2 buffers: one allocator page costs 4 x PAGE; a block is a quarter of that.
PAGE_ALL_LAYERS = 4 * PAGE
BLOCKS_PER_PAGE = 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path))
    return tmp_path


def make_pool(name: str, budget: str | None, **options: Any) -> KVPool:
    settings: dict[str, Any] = {
        "num_layers": 2,
        "num_kv_buffers": 2,
        "block_bytes": 16 * KIB,
        "virtual_bytes_per_layer": 2 * 32 * PAGE,
        "page_size": PAGE,
        "min_reserve_pages": 0,
        "max_reserve_pages": 1,
        "metrics_registry": CollectorRegistry(),
        "budget": budget,
    }
    settings.update(options)
    return create_pool(name, **settings)


def kvctl(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = kvctl_main(list(argv), out=out)
    return code, out.getvalue()


def fill(pool: KVPool) -> list[int]:
    """Allocate one block at a time until the pool is refused."""
    held: list[int] = []
    while True:
        try:
            held += pool.alloc(1)
        except PoolExhausted:
            return held


# A pool in its own process: joins the budget, then allocates and frees random runs of blocks
# for `seconds`, and prints what it saw as JSON.
_CHURN = textwrap.dedent(
    """
    import json, random, sys, time
    from prometheus_client import CollectorRegistry
    from kvcached_core.errors import PoolExhausted
    from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec

    name, budget, seconds, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    page = 64 * 1024
    pool = KVPool.create(name, PoolSpec(2, 2, 16 * 1024, 2 * 32 * page, page),
                         PoolPolicy(min_reserve_pages=0, max_reserve_pages=1, budget=budget),
                         metrics_registry=CollectorRegistry())
    rng = random.Random(seed)
    held, refused, granted, peak = [], 0, 0, 0
    print("ready", flush=True)
    sys.stdin.readline()  # "go": every churner has made its pool, so they start together
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if held and rng.random() < 0.45:
            count = rng.randint(1, len(held))
            pool.free(held[-count:])
            del held[-count:]
            continue
        try:
            held += pool.alloc(rng.randint(1, 12))
            granted += 1
        except PoolExhausted:
            refused += 1
        peak = max(peak, pool.mapped_bytes())
    backend = pool.backend
    exact = int(backend.charged_bytes()) == int(backend.inner.committed_bytes())
    print(json.dumps({"refused": refused, "granted": granted, "peak": peak,
                      "charges_match_memory": exact}), flush=True)
    pool.close()
    """
)

# A pool in its own process that takes `pages` pages, says so, and waits to be killed.
_HOLD = textwrap.dedent(
    """
    import sys, time
    from prometheus_client import CollectorRegistry
    from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec

    page = 64 * 1024
    pool = KVPool.create(sys.argv[1], PoolSpec(2, 2, 16 * 1024, 2 * 32 * page, page),
                         PoolPolicy(min_reserve_pages=0, max_reserve_pages=1, budget=sys.argv[2]),
                         metrics_registry=CollectorRegistry())
    blocks = pool.alloc(4 * int(sys.argv[3]))
    print(pool.mapped_bytes(), flush=True)
    time.sleep(600)
    """
)


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)


# ---------------------------------------------------------------------------- one process


def test_pool_pages_are_charged_and_refused_once_the_budget_is_spent(shm: Path) -> None:
    set_budget("host", 6 * PAGE_ALL_LAYERS)
    with make_pool("a", "host") as pool:
        held = fill(pool)
        state = read_budget("host")
        # Six pages: the null block's page plus five whole pages of blocks (one held a block
        # less because the null block shares page 0).
        assert pool.mapped_bytes() == 6 * PAGE_ALL_LAYERS
        assert state.charged_bytes == 6 * PAGE_ALL_LAYERS
        assert [m.pid for m in state.members] == [os.getpid()]
        assert pool.backend.charged_bytes() == pool.backend.inner.committed_bytes()
        assert pool.backend.budget_free_bytes() == 0
        assert len(held) == 6 * BLOCKS_PER_PAGE - 1
        pool.free(held)
        pool.trim()
        assert read_budget("host").charged_bytes == pool.mapped_bytes() == PAGE_ALL_LAYERS
    # close() stops the pool; its pages (and their charge) go when the pool itself goes.
    del pool
    gc.collect()
    after = read_budget("host")
    assert after.charged_bytes == 0 and after.members == ()


def test_what_a_pool_can_take_under_its_budget_follows_its_neighbour(shm: Path) -> None:
    """`available_under_budget`: the blocks of pages already mapped plus what the budget's free
    bytes still pay for, the size a scheduler admits work by (SGLang's allocators)."""
    set_budget("host", 6 * PAGE_ALL_LAYERS)
    with make_pool("mine", "host", max_reserve_pages=0) as mine, \
            make_pool("neighbour", "host", max_reserve_pages=0) as neighbour:
        # Each has mapped its null block's page: 4 pages of the budget are left.
        assert mine.available_under_budget() == BLOCKS_PER_PAGE - 1 + 4 * BLOCKS_PER_PAGE
        held = fill(neighbour)
        # The neighbour spent the budget: only the free blocks of my mapped page are left,
        # though my own limit would let me map many more pages.
        assert mine.available_under_budget() == BLOCKS_PER_PAGE - 1 < mine.available_size()
        assert mine.alloc(BLOCKS_PER_PAGE - 1)
        with pytest.raises(PoolExhausted):
            mine.alloc(1)
        neighbour.free(held)
        assert mine.available_under_budget() == 4 * BLOCKS_PER_PAGE
    with make_pool("alone", None) as alone:
        assert alone.available_under_budget() == alone.available_size()


def test_two_pools_of_one_process_share_its_slot(shm: Path) -> None:
    set_budget("host", 4 * PAGE_ALL_LAYERS)
    with make_pool("a", "host") as first, make_pool("b", "host") as second:
        first.alloc(BLOCKS_PER_PAGE * 2)
        with pytest.raises(PoolExhausted):
            second.alloc(BLOCKS_PER_PAGE * 2)  # 2 null pages + 2 + 2 > 4
        second.alloc(BLOCKS_PER_PAGE - 1)  # what is left of its own null page
        (member,) = read_budget("host").members
        assert (member.pid, member.attached) == (os.getpid(), 2)
        assert member.charged_bytes == first.mapped_bytes() + second.mapped_bytes()
    del first, second
    gc.collect()
    assert read_budget("host").members == ()


def test_shrinking_below_what_is_charged_only_blocks_new_pages(shm: Path) -> None:
    set_budget("host", 8 * PAGE_ALL_LAYERS)
    with make_pool("a", "host") as pool:
        held = pool.alloc(6 * BLOCKS_PER_PAGE)  # 7 pages with the null block's
        code, text = kvctl("budget", "set", "host", str(2 * PAGE_ALL_LAYERS))
        assert code == 0 and "over capacity" in text
        state = read_budget("host")
        assert state.capacity_bytes == 2 * PAGE_ALL_LAYERS
        assert state.charged_bytes == 7 * PAGE_ALL_LAYERS  # nothing was taken back
        assert pool.mapped_bytes() == 7 * PAGE_ALL_LAYERS
        with pytest.raises(PoolExhausted):
            pool.alloc(BLOCKS_PER_PAGE)
        pool.free(held)
        pool.trim()
        assert read_budget("host").charged_bytes == PAGE_ALL_LAYERS
        pool.alloc(BLOCKS_PER_PAGE)  # back under the capacity: a new page fits again
        assert read_budget("host").charged_bytes == 2 * PAGE_ALL_LAYERS


def test_free_bytes_reported_to_the_allocator_are_capped_by_the_budget(shm: Path) -> None:
    set_budget("host", 3 * PAGE_ALL_LAYERS)
    with make_pool("a", "host") as pool:
        assert pool.backend.physical_free_bytes() == 2 * PAGE_ALL_LAYERS
        assert pool.backend.physical_free_bytes() <= pool.backend.inner.physical_free_bytes()
        set_budget("host", 64 * MIB)
        assert pool.backend.physical_free_bytes() == min(
            64 * MIB - PAGE_ALL_LAYERS, pool.backend.inner.physical_free_bytes()
        )


def test_pool_without_a_budget_is_unchanged(shm: Path) -> None:
    with make_pool("a", None) as pool:
        assert type(pool.backend).__name__ == "HostBackend"
        pool.alloc(BLOCKS_PER_PAGE * 8)
    assert not list(shm.glob("kvcached-budget-*"))


# ---------------------------------------------------------------------------- processes


def test_two_processes_churning_never_exceed_the_budget(
    shm: Path, children: list[subprocess.Popen[str]]
) -> None:
    capacity = 10 * PAGE_ALL_LAYERS
    set_budget("shared", capacity)
    for name, seed in (("a", "1"), ("b", "2")):
        children.append(spawn(_CHURN, name, "shared", "2.0", seed))
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready", (
            child.stderr.read() if child.stderr else ""
        )
    # Only now may they churn: one that started at once could spend the whole budget before
    # the other's pool had its first page (a slow start is not what this test is about).
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    peak_charged, members_seen = 0, set()
    while any(child.poll() is None for child in children):
        state = read_budget("shared")
        peak_charged = max(peak_charged, state.charged_bytes)
        members_seen.update(m.pid for m in state.members)
        assert state.charged_bytes <= capacity, state
        time.sleep(0.002)
    reports = []
    for child in children:
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert members_seen == {child.pid for child in children}
    assert all(r["charges_match_memory"] for r in reports)
    # Both really competed: each was refused at some point, and together they used it all.
    assert all(r["refused"] > 0 and r["granted"] > 0 for r in reports), reports
    assert peak_charged > capacity - 2 * PAGE_ALL_LAYERS
    final = read_budget("shared")
    assert final.charged_bytes == 0 and final.members == ()


def test_a_killed_member_gives_its_bytes_back(
    shm: Path, children: list[subprocess.Popen[str]]
) -> None:
    set_budget("shared", 8 * PAGE_ALL_LAYERS)
    holder = spawn(_HOLD, "holder", "shared", "5")  # 6 pages with its null block's
    children.append(holder)
    assert holder.stdout is not None
    assert int(holder.stdout.readline()) == 6 * PAGE_ALL_LAYERS
    assert read_budget("shared").charged_bytes == 6 * PAGE_ALL_LAYERS
    with make_pool("mine", "shared") as pool:
        with pytest.raises(PoolExhausted):
            pool.alloc(2 * BLOCKS_PER_PAGE)
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_start_time(holder.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # a zombie counts as gone: no need to reap it first
        assert [m.pid for m in read_budget("shared").members] == [os.getpid()]
        pool.alloc(6 * BLOCKS_PER_PAGE)  # the dead member's pages are charged to this one
        assert read_budget("shared").charged_bytes == 7 * PAGE_ALL_LAYERS


def test_a_reused_pid_does_not_keep_a_dead_members_bytes(shm: Path) -> None:
    set_budget("shared", 4 * PAGE_ALL_LAYERS)
    path = budget_path("shared")
    # A slot naming this live pid with another start time: the process it named is gone.
    slot = (os.getpid()).to_bytes(8, "little", signed=True) + (1).to_bytes(8, "little")
    slot += (4 * PAGE_ALL_LAYERS).to_bytes(8, "little") + (1).to_bytes(8, "little")
    with open(path, "r+b") as file:
        file.seek(64 + 32 * 5)
        file.write(slot)
    assert read_budget("shared").members == ()
    with make_pool("a", "shared") as pool:
        pool.alloc(3 * BLOCKS_PER_PAGE)
        assert read_budget("shared").charged_bytes == 4 * PAGE_ALL_LAYERS


# ---------------------------------------------------------------------------- errors


def test_a_missing_budget_is_a_config_error_at_pool_creation(shm: Path) -> None:
    with pytest.raises(KVCachedConfigError, match=r"kvctl budget set gpu0 SIZE"):
        make_pool("a", "gpu0")
    assert not list(shm.glob("kvcached.*"))  # no limit record was left behind


def test_settings_read_the_budget_name(shm: Path) -> None:
    assert KVCachedSettings.from_env({}).budget is None
    assert KVCachedSettings.from_env({"KVCACHED_BUDGET": " gpu0 "}).budget == "gpu0"
    with pytest.raises(KVCachedConfigError, match="KVCACHED_BUDGET"):
        KVCachedSettings.from_env({"KVCACHED_BUDGET": "../etc"})


@pytest.mark.parametrize("name", ["../x", "a/b", "", "-lead", "x" * 129])
def test_bad_budget_names_are_refused(shm: Path, name: str) -> None:
    code, _ = kvctl("budget", "set", "--", name, "1G")
    assert code == 1
    with pytest.raises(KVCachedConfigError, match="invalid budget name"):
        set_budget(name, MIB)


@pytest.mark.parametrize("size", ["-1G", "1.5", "12X", "lots"])
def test_bad_budget_sizes_are_refused(
    shm: Path, size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = kvctl("budget", "set", "--", "gpu0", size)
    assert code == 1
    assert "invalid size" in capsys.readouterr().err
    assert not budget_path("gpu0").exists()


def test_a_file_that_is_not_a_budget_is_refused(shm: Path) -> None:
    budget_path("junk").write_bytes(b"\0" * FILE_SIZE)
    with pytest.raises(CorruptBudgetError):
        read_budget("junk")
    with pytest.raises(KVCachedConfigError, match="not a budget file"):
        make_pool("a", "junk")
    with pytest.raises(UnknownBudgetError):
        read_budget("absent")


# ---------------------------------------------------------------------------- kvctl


def test_kvctl_shows_budgets_with_their_members(shm: Path) -> None:
    code, text = kvctl("budget", "set", "gpu0", "4M")
    assert (code, text.split(":")[0]) == (0, "budget gpu0")
    with make_pool("engine-a", "gpu0") as pool:
        pool.alloc(BLOCKS_PER_PAGE)
        code, text = kvctl("list")
        assert code == 0
        pools_table, budgets_table = text.split("\n\n")
        assert "engine-a" in pools_table
        header, row = budgets_table.strip().splitlines()
        assert header.split() == ["BUDGET", "CAPACITY", "CHARGED", "FREE", "CHARGED%", "MEMBERS"]
        assert row.split() == ["gpu0", "4.0MiB", "512.0KiB", "3.5MiB", "12.5%", str(os.getpid())]
        code, text = kvctl("budget", "show", "gpu0", "--json")
        shown = json.loads(text)
        assert shown["capacity_bytes"] == 4 * MIB
        assert shown["charged_bytes"] == 2 * PAGE_ALL_LAYERS
        assert shown["members"] == [
            {"pid": os.getpid(), "charged_bytes": 2 * PAGE_ALL_LAYERS, "attached": 1}
        ]
        code, _ = kvctl("budget", "delete", "gpu0")
        assert code == 1  # a live member charges it
    del pool
    gc.collect()
    code, text = kvctl("budget", "list")
    assert "gpu0" in text and "  -" in text
    assert kvctl("budget", "delete", "gpu0")[0] == 0
    assert kvctl("budget", "list")[1].startswith("no budgets")
