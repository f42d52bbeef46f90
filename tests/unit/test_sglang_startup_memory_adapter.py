"""The free-memory figure a patched SGLang's start-up sizing asks kvcached for.

Not elastic, it must be SGLang's own measure, called exactly as SGLang called it. Elastic, it
must count the KV live elastic neighbours hold (they give it back), count neither this
process's pool nor dead owners' records, and reduce across ranks after counting, so that an
engine starting during a neighbour's burst is neither refused nor sized to that moment, while
a device that is full even without neighbours' KV is still refused by SGLang's own checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcached_core.integration.sglang.startup import elastic_free_memory_gb
from kvcached_core.startup_memory import holds_startup_window, release_startup_windows
from tests.unit.neighbour_records import write_record

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]


class Measure:
    """SGLang's get_available_gpu_memory with a fixed local figure and a fixed other rank."""

    def __init__(self, local_gb: float, other_rank_gb: float | None = None) -> None:
        self.local_gb = local_gb
        self.other_rank_gb = other_rank_gb
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, distributed: bool = False, cpu_group: Any = None,
                 **kwargs: Any) -> float:
        self.calls.append((args, {"distributed": distributed, "cpu_group": cpu_group, **kwargs}))
        if distributed and self.other_rank_gb is not None:
            return min(self.local_gb, self.other_rank_gb)
        return self.local_gb


def profile_budget_gb(available_gb: float, pre_model_load_gb: float,
                      mem_fraction_static: float) -> float:
    """KVCacheConfigurator._profile_available_bytes's arithmetic (0.5.23), in GiB; <= 0 is
    refused ("Loaded weights leave no GPU memory for the KV cache")."""
    return available_gb - pre_model_load_gb * (1 - mem_fraction_static)


@given(local=st.floats(min_value=0, max_value=200), other=st.floats(min_value=0, max_value=200),
       distributed=st.booleans())
def test_stock_is_sglangs_own_measure_called_as_sglang_called_it(
        local: float, other: float, distributed: bool) -> None:
    measure = Measure(local, other)
    group = object()
    figure = elastic_free_memory_gb(measure, "cuda", 0, distributed=distributed,
                                    cpu_group=group, empty_cache=True, elastic=False)
    assert figure == measure(distributed=distributed)
    assert measure.calls[0] == (("cuda", 0), {"distributed": distributed, "cpu_group": group,
                                              "empty_cache": True})


def test_stock_ignores_neighbours_records(records: Path) -> None:
    write_record(records, "neighbour", used=40 * GIB, reserved=0, pid=os.getppid())
    assert elastic_free_memory_gb(Measure(10.0), "cuda", 0, distributed=False, elastic=False,
                                  records_directory=str(records)) == 10.0


def test_elastic_counts_live_neighbours_kv_only(records: Path, dead_pid: int) -> None:
    write_record(records, "neighbour", used=30 * GIB, reserved=2 * GIB, pid=os.getppid())
    write_record(records, "gone", used=50 * GIB, reserved=0, pid=dead_pid)
    write_record(records, "mine", used=8 * GIB, reserved=0, pid=os.getpid())
    measure = Measure(100.0)
    figure = elastic_free_memory_gb(measure, "cuda", 0, distributed=False, cpu_group=None,
                                    elastic=True, records_directory=str(records))
    assert figure == 132.0
    assert measure.calls == [(("cuda", 0), {"distributed": False, "cpu_group": None})]


def test_elastic_counts_each_rank_before_the_minimum(records: Path) -> None:
    # The local figure is measured per rank (not reduced by SGLang's measure) and the counted
    # figure is what is reduced, so every rank sizes its pools from one number.
    write_record(records, "neighbour", used=20 * GIB, reserved=0, pid=os.getppid())
    measure = Measure(100.0, other_rank_gb=90.0)
    reduced: list[tuple[float, object]] = []
    group = object()

    def other_rank_has_less(value: float, cpu_group: object) -> float:
        reduced.append((value, cpu_group))
        return min(value, 95.0)

    figure = elastic_free_memory_gb(measure, "cuda", 0, distributed=True, cpu_group=group,
                                    elastic=True, records_directory=str(records),
                                    min_across_ranks=other_rank_has_less)
    assert reduced == [(120.0, group)]
    assert figure == 95.0
    assert measure.calls[0][1]["distributed"] is False


def test_a_neighbours_burst_during_start_up_neither_refuses_nor_shrinks_the_engine(
        records: Path) -> None:
    # A 139 GiB device, mem_fraction_static 0.9, 1.5 GiB of weights; the neighbour idles at
    # 1.5 GiB without KV and is in a 125 GiB burst while this engine profiles its budget.
    pre_load = elastic_free_memory_gb(Measure(137.5), "cuda", 0, elastic=True,
                                      records_directory=str(records))
    write_record(records, "neighbour", used=123 * GIB, reserved=2 * GIB, pid=os.getppid())
    in_burst_free = 137.5 - 1.5 - 125.0
    stock = profile_budget_gb(in_burst_free, 137.5, 0.9)
    elastic = profile_budget_gb(
        elastic_free_memory_gb(Measure(in_burst_free), "cuda", 0, elastic=True,
                               records_directory=str(records)),
        pre_load, 0.9)
    alone = profile_budget_gb(137.5 - 1.5, 137.5, 0.9)
    assert stock <= 0  # refused: "Loaded weights leave no GPU memory for the KV cache"
    assert elastic == pytest.approx(alone)


def test_elastic_still_refuses_a_device_full_without_neighbours_kv(records: Path) -> None:
    # Stock engines (no records) hold the device: what SGLang refuses stays refused.
    write_record(records, "neighbour", used=1 * GIB, reserved=0, pid=os.getppid())
    pre_load = elastic_free_memory_gb(Measure(20.0), "cuda", 0, elastic=True,
                                      records_directory=str(records))
    available = elastic_free_memory_gb(Measure(0.5), "cuda", 0, elastic=True,
                                       records_directory=str(records))
    assert profile_budget_gb(available, pre_load, 0.9) <= 0


def test_tp_balance_is_not_tripped_by_a_neighbours_kv_on_one_rank(records: Path) -> None:
    # SGLang's check: pre_model_load_memory (minimum of the ranks) < 0.9 * this rank's local
    # free memory is an error. A neighbour holds 40 GiB of KV on the other rank's device.
    write_record(records, "neighbour", used=40 * GIB, reserved=0, pid=os.getppid())
    local = 139.0
    other_rank_free = 99.0
    stock_minimum = min(local, other_rank_free)
    assert stock_minimum < 0.9 * local

    def reduce_with_other_rank(value: float, cpu_group: object) -> float:
        return min(value, other_rank_free + 40.0)

    elastic_minimum = elastic_free_memory_gb(Measure(local), "cuda", 0, distributed=True,
                                             elastic=True, records_directory=str(records),
                                             min_across_ranks=reduce_with_other_rank)
    assert not elastic_minimum < 0.9 * local


# --- the start-up window: the pre-load read opens it, the KV-profile read closes it ----------

SGLANG_ENGINE = textwrap.dedent("""
    import sys
    from kvcached_core.integration.sglang.startup import elastic_free_memory_gb
    for command in sys.stdin:
        window = command.strip()
        elastic_free_memory_gb(lambda *a, **k: 1.0, "cuda", 0, elastic=True,
                               records_directory=sys.argv[1], startup_window=window)
        print(window, flush=True)
""")


class SGLangEngine:
    """Another SGLang process on the same device: each line sent is a read it takes
    ("begin": the pre-load figure, "end": the KV-profile figure)."""

    def __init__(self, records: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", SGLANG_ENGINE, str(records)], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self, window: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(window + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == window

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def window_env(records: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # SGLang's gpu_id 0 is physical device 3 here; torch without CUDA names it cuda-3.
    for name, value in {"KVCACHED_SHM_DIR": str(records), "CUDA_VISIBLE_DEVICES": "3",
                        "KVCACHED_START_WINDOW_TIMEOUT": "30"}.items():
        monkeypatch.setenv(name, value)
    yield
    release_startup_windows()


class WindowSeen(Measure):
    """A measure that also notes whether this process held the device's window when called."""

    def __init__(self, local_gb: float = 10.0, fails: bool = False) -> None:
        super().__init__(local_gb)
        self.fails = fails
        self.window_held: list[bool] = []

    def __call__(self, *args: Any, **kwargs: Any) -> float:
        self.window_held.append(holds_startup_window("cuda-3"))
        if self.fails:
            raise RuntimeError("measure failed")
        return super().__call__(*args, **kwargs)


@pytest.mark.usefixtures("window_env")
@pytest.mark.parametrize("by_name", [False, True])
def test_the_pre_load_read_takes_the_window_before_measuring_and_keeps_it(
        records: Path, by_name: bool) -> None:
    measure = WindowSeen()
    where: dict[str, Any] = {"device": "cuda", "gpu_id": 0}
    args = () if by_name else tuple(where.values())
    figure = elastic_free_memory_gb(measure, *args, distributed=False, elastic=True,
                                    records_directory=str(records), startup_window="begin",
                                    **(where if by_name else {}))
    assert figure == 10.0
    assert measure.window_held == [True]
    assert holds_startup_window("cuda-3")


@pytest.mark.usefixtures("window_env")
def test_the_kv_profile_read_releases_the_window_after_measuring(records: Path) -> None:
    elastic_free_memory_gb(WindowSeen(), "cuda", 0, elastic=True,
                           records_directory=str(records), startup_window="begin")
    measure = WindowSeen(local_gb=7.0)
    assert elastic_free_memory_gb(measure, "cuda", 0, elastic=True,
                                  records_directory=str(records), startup_window="end") == 7.0
    assert measure.window_held == [True]
    assert not holds_startup_window("cuda-3")


@pytest.mark.usefixtures("window_env")
def test_the_kv_profile_read_releases_the_window_when_the_measure_raises(
        records: Path) -> None:
    elastic_free_memory_gb(WindowSeen(), "cuda", 0, elastic=True,
                           records_directory=str(records), startup_window="begin")
    with pytest.raises(RuntimeError, match="measure failed"):
        elastic_free_memory_gb(WindowSeen(fails=True), "cuda", 0, elastic=True,
                               records_directory=str(records), startup_window="end")
    assert not holds_startup_window("cuda-3")


@pytest.mark.usefixtures("window_env")
@pytest.mark.parametrize(("device", "elastic", "windows"), [
    ("cuda", False, ("begin", "end")),  # stock
    ("cpu", True, ("begin", "end")),
    ("cuda", True, (None,)),  # a draft worker's pre-load read
])
def test_stock_and_cpu_engines_take_no_window_and_wait_for_none(
        records: Path, device: str, elastic: bool, windows: tuple[str | None, ...]) -> None:
    neighbour = SGLangEngine(records)
    try:
        neighbour.read("begin")
        measure = WindowSeen()
        started = time.monotonic()
        for window in windows:
            elastic_free_memory_gb(measure, device, 0, elastic=elastic,
                                   records_directory=str(records), startup_window=window)
        assert time.monotonic() - started < 5  # the neighbour's window is not waited for
        assert measure.window_held == [False] * len(windows)
        assert not holds_startup_window("cuda-3")
    finally:
        neighbour.stop()


@pytest.mark.usefixtures("window_env")
def test_a_second_engines_pre_load_read_waits_until_the_first_has_profiled(
        records: Path) -> None:
    first = SGLangEngine(records)
    try:
        first.read("begin")
        measure = WindowSeen()
        second = threading.Thread(target=elastic_free_memory_gb, args=(measure, "cuda", 0),
                                  kwargs={"elastic": True, "records_directory": str(records),
                                          "startup_window": "begin"}, daemon=True)
        second.start()
        time.sleep(0.5)
        assert second.is_alive() and measure.window_held == []  # not measured yet
        first.read("end")
        second.join(10)
        assert not second.is_alive()
        assert measure.window_held == [True]
    finally:
        first.stop()


@pytest.mark.usefixtures("window_env")
def test_a_holder_that_never_profiles_delays_the_pre_load_read_by_the_timeout_only(
        records: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_START_WINDOW_TIMEOUT", "0.5")
    first = SGLangEngine(records)
    try:
        first.read("begin")
        measure = WindowSeen()
        started = time.monotonic()
        assert elastic_free_memory_gb(measure, "cuda", 0, elastic=True,
                                      records_directory=str(records),
                                      startup_window="begin") == 10.0
        assert 0.5 <= time.monotonic() - started < 10
        assert measure.window_held == [False]
    finally:
        first.stop()


def test_an_unknown_window_value_is_refused() -> None:
    with pytest.raises(ValueError, match="startup_window"):
        elastic_free_memory_gb(Measure(1.0), "cuda", 0, elastic=False, startup_window="open")
