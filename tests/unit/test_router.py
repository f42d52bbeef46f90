"""The router's configuration and its decisions (who starts, sleeps, stops, waits), with engines
that stand in for server processes; tests/e2e/test_router.py runs real engines."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcached_core.budget import read_budget
from kvcached_core.limits import scan_records
from kvcached_core.processes import group_members
from kvcached_core.router.cli import main as kvrouter_main
from kvcached_core.router.config import (
    DeviceSpec,
    ModelSpec,
    RouterConfig,
    RouterConfigError,
    load_config,
    parse_config,
)
from kvcached_core.router.engines import Engine, EngineStartError, KVUsage
from kvcached_core.router.fleet import EngineUnavailable, Fleet
from kvcached_core.router.telemetry import Telemetry

GIB = 1 << 30


def _model(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "engine": "vllm", "python": sys.executable, "model": f"/m/{name}",
            "device": "gpu0", "memory": "2GiB", **extra}


def _document(*models: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"devices": [{"name": "gpu0", "memory": "5GiB"}], "models": list(models), **top}


# ---------------------------------------------------------------------- configuration


def test_a_valid_file_reads_with_defaults(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_document(_model("a"), _model("b", sleep="stop",
                                                                  priority=3))))
    config = load_config(path)
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.log_dir == tmp_path / "kvrouter-logs"
    a, b = config.models
    assert a.memory_bytes == 2 * GIB and a.sleep == "kv" and a.priority == 0
    assert b.sleep == "stop" and b.priority == 3
    assert config.device("gpu0").budget_name == "kvrouter-gpu0"


@pytest.mark.parametrize(("change", "message"), [
    ({"models": [_model("a", engine="tgi")]},
     "model 'a'.engine: must be one of vllm, sglang, got 'tgi'"),
    ({"models": [_model("a", device="gpu9")]},
     "model 'a'.device: names no device (devices: gpu0), got 'gpu9'"),
    ({"models": [_model("a", memory="6GiB")]},
     "model 'a'.memory: 6.0GiB leaves no KV memory on device gpu0 (5.0GiB)"),
    ({"models": [_model("a", memory="lots")]},
     "model 'a'.memory: must be a size such as 16GiB, got 'lots'"),
    ({"models": [_model("a", args=["--port", "9000"])]},
     "model 'a'.args: --port is set by the router, leave it out"),
    ({"models": [_model("a", env={"KVCACHED_BUDGET": "mine"})]},
     "model 'a'.env: KVCACHED_BUDGET is set by the router (the device's budget), leave it out"),
    ({"models": [_model("a", sleep="deep")]},
     "model 'a'.sleep: must be one of kv, weights, stop, got 'deep'"),
    ({"models": [_model("a", sleep="weights", memory_asleep="1GiB")]},
     "model 'a'.sleep: weights needs --enable-sleep-mode in args (vLLM's sleep mode moves the "
     "weights)"),
    ({"models": [_model("a", sleep="weights", args=["--enable-sleep-mode"])]},
     "model 'a': memory_asleep is required with sleep: weights (what the engine keeps on the "
     "device while its weights are in host memory)"),
    ({"models": [_model("a", engine="sglang", sleep="weights")]},
     "model 'a'.sleep: weights is vLLM's sleep mode; an sglang engine sleeps at kv or stop"),
    ({"models": [_model("a", memory_asleep="1GiB")]},
     "model 'a'.memory_asleep: is only for sleep: weights (at kv the engine keeps its memory, "
     "stopped it keeps none)"),
    ({"models": [_model("a"), _model("a")]}, "models[1].name: 'a' is listed twice"),
    ({"models": [_model("a", python="/no/python")]},
     "model 'a'.python: /no/python is not an executable interpreter"),
    ({"models": [_model("a", gpu="0")]}, "models[0]: unknown key 'gpu' (allowed: args, "
     "device, engine, env, idle_sleep_s, memory, memory_asleep, model, name, priority, python, "
     "sleep)"),
    ({"listen": "8000"}, "listen: must be HOST:PORT, got '8000'"),
    ({"devices": []}, "devices: must list at least one device"),
    ({"idle_sleep_s": -1}, "idle_sleep_s: must be a number of seconds >= 0, got -1"),
])
def test_each_mistake_is_one_line_naming_the_field(change: dict[str, Any], message: str) -> None:
    document = {**_document(_model("a")), **change}
    with pytest.raises(RouterConfigError) as refused:
        parse_config(document, Path("/"))
    assert str(refused.value) == message


def test_a_file_that_is_not_yaml_names_its_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("devices:\n  - name: gpu0\n   memory: [\n")
    assert kvrouter_main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvrouter: {path}: ") and "(line 3)" in err
    assert err.count("\n") == 1


def test_check_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_document(_model("a"), listen="0.0.0.0:9000")))
    assert kvrouter_main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "endpoint http://0.0.0.0:9000/v1 (1 models)",
        "device gpu0: 5.0GiB, KV budget kvrouter-gpu0",
        "  a: vllm /m/a, 2.0GiB awake, sleep kv, priority 0"]


# ---------------------------------------------------------------------- decisions


class FakeEngine(Engine):
    """An engine whose process is a flag: starting takes `start_s`, and may fail."""

    def __init__(self, spec: ModelSpec, device: DeviceSpec, config: RouterConfig,
                 journal: list[str]) -> None:
        super().__init__(spec, device, config.log_dir, config.shm_dir)
        self.journal = journal
        self.running = False
        self.start_s = 0.05
        self.sleep_s = 0.0
        self.fail_start = False

    @property
    def pid(self) -> int | None:
        return 4242 if self.running else None

    def alive(self) -> bool:
        return self.running

    def start(self, timeout_s: float) -> float:
        self.journal.append(f"start {self.spec.name}")
        time.sleep(self.start_s)
        if self.fail_start:
            raise EngineStartError(f"engine of {self.spec.name!r} exited with status 1")
        self.running = True
        return self.start_s

    def stop(self) -> None:
        if self.running:
            self.journal.append(f"stop {self.spec.name}")
        self.running = False

    def sleep_kv(self) -> None:
        self.journal.append(f"sleep {self.spec.name}")
        time.sleep(self.sleep_s)

    def wake_kv(self) -> None:
        self.journal.append(f"wake {self.spec.name}")

    def sleep_weights(self) -> None:
        self.journal.append(f"sleep-weights {self.spec.name}")

    def wake_weights(self) -> None:
        self.journal.append(f"wake-weights {self.spec.name}")

    def usage(self) -> KVUsage:
        return KVUsage(0, 0, 0, 0)


@pytest.fixture()
def make_fleet(tmp_path: Path) -> Any:
    fleets: list[Fleet] = []

    def build(*models: dict[str, Any], **top: Any) -> tuple[Fleet, list[str],
                                                           dict[str, FakeEngine]]:
        document = _document(*models, shm_dir=str(tmp_path / "shm"), **top)
        config = parse_config(document, tmp_path)
        journal: list[str] = []
        engines: dict[str, FakeEngine] = {}

        def factory(spec: ModelSpec, device: DeviceSpec, cfg: RouterConfig) -> Engine:
            engines[spec.name] = FakeEngine(spec, device, cfg, journal)
            return engines[spec.name]

        fleet = Fleet(config, Telemetry(("stopped",)), factory)
        fleet.open()
        fleets.append(fleet)
        return fleet, journal, engines

    yield build
    for fleet in fleets:
        fleet.close()


def _states(fleet: Fleet) -> dict[str, object]:
    return {row["model"]: row["state"] for row in fleet.status()}


def test_a_request_starts_its_engine_and_the_budget_shrinks(make_fleet: Any,
                                                            tmp_path: Path) -> None:
    fleet, journal, _ = make_fleet(_model("a"), _model("b"), idle_sleep_s=0)
    assert read_budget("kvrouter-gpu0", tmp_path / "shm").capacity_bytes == 5 * GIB
    with fleet.use("a") as engine:
        assert engine.spec.name == "a" and _states(fleet)["a"] == "awake"
    assert journal == ["start a"]
    assert read_budget("kvrouter-gpu0", tmp_path / "shm").capacity_bytes == 3 * GIB


def test_a_new_model_stops_the_idle_engine_of_lowest_priority_then_oldest_use(
        make_fleet: Any) -> None:
    fleet, journal, _ = make_fleet(_model("a", priority=1), _model("b", priority=0),
                                   _model("c", priority=0), idle_sleep_s=0)
    for name in ("b", "a"):  # b used first, a later; memory now holds two engines
        with fleet.use(name):
            pass
    with fleet.use("c"):
        pass
    assert journal == ["start b", "start a", "stop b", "start c"]  # b: priority 0
    assert _states(fleet) == {"a": "awake", "b": "stopped", "c": "awake"}


def test_an_engine_falling_asleep_is_still_the_oldest_idle_one_and_is_stopped_first(
        make_fleet: Any) -> None:
    """A new model arrives while the idle loop puts the engine used longest ago to sleep: the
    request waits for that engine's sleep and stops it, never the newer engine beside it."""
    fleet, journal, engines = make_fleet(_model("a", idle_sleep_s=0.1), _model("b"),
                                         _model("c"), idle_sleep_s=0)
    with fleet.use("a"):
        engines["a"].sleep_s = 1.0  # a slow sleep (a busy host)
    with fleet.use("b"):
        pass
    deadline = time.monotonic() + 5
    while _states(fleet)["a"] != "sleeping":
        assert time.monotonic() < deadline, _states(fleet)
        time.sleep(0.01)
    with fleet.use("c"):
        pass
    assert journal == ["start a", "start b", "sleep a", "stop a", "start c"]
    assert _states(fleet) == {"a": "stopped", "b": "awake", "c": "awake"}


def test_a_busy_engine_is_never_stopped_and_the_request_waits_for_an_idle_one(
        make_fleet: Any) -> None:
    fleet, journal, _ = make_fleet(_model("a"), _model("b"), _model("c"), idle_sleep_s=0)
    release_a = threading.Event()
    holding = threading.Event()

    def hold(name: str, until: threading.Event) -> None:
        with fleet.use(name):
            holding.set()
            until.wait(10)

    threads = [threading.Thread(target=hold, args=("a", release_a))]
    threads[0].start()
    holding.wait(5)
    holding.clear()
    release_b = threading.Event()
    threads.append(threading.Thread(target=hold, args=("b", release_b)))
    threads[1].start()
    holding.wait(5)
    served = threading.Event()

    def ask_c() -> None:
        with fleet.use("c"):
            served.set()

    asker = threading.Thread(target=ask_c)
    asker.start()
    time.sleep(0.5)
    assert not served.is_set() and _states(fleet)["c"] == "stopped"  # both others busy
    release_b.set()
    assert served.wait(5)
    assert journal == ["start a", "start b", "stop b", "start c"]
    release_a.set()
    for thread in [*threads, asker]:
        thread.join(5)


def test_a_request_that_cannot_be_placed_in_time_gets_the_reason(make_fleet: Any) -> None:
    fleet, _, _ = make_fleet(_model("a"), _model("b"), _model("c"), idle_sleep_s=0,
                             request_wait_s=0.3)
    with (fleet.use("a"), fleet.use("b"), pytest.raises(EngineUnavailable) as refused,
          fleet.use("c")):
        pass
    assert str(refused.value) == (
        "model 'c' needs 2.0GiB on device gpu0, where 1.0GiB is free and engines a, b stayed "
        "busy for 0 s")


def test_idle_engines_sleep_at_their_level_and_the_next_request_wakes_them(
        make_fleet: Any) -> None:
    fleet, journal, _ = make_fleet(_model("a"), _model("b", sleep="stop"), idle_sleep_s=0.2)
    for name in ("a", "b"):
        with fleet.use(name):
            pass
    deadline = time.monotonic() + 5
    while _states(fleet) != {"a": "asleep", "b": "stopped"}:
        assert time.monotonic() < deadline, _states(fleet)
        time.sleep(0.05)
    with fleet.use("a"), fleet.use("b"):
        pass
    assert journal == ["start a", "start b", "sleep a", "stop b", "wake a", "start b"]


def test_requests_that_arrive_while_an_engine_starts_all_wait_for_it(make_fleet: Any) -> None:
    fleet, journal, engines = make_fleet(_model("a"), idle_sleep_s=0)
    engines["a"].start_s = 0.5
    served: list[str] = []

    def ask() -> None:
        with fleet.use("a"):
            served.append("a")

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert served == ["a"] * 8 and journal == ["start a"]


def test_a_failed_start_answers_every_waiting_request_and_the_next_one_tries_again(
        make_fleet: Any) -> None:
    fleet, journal, engines = make_fleet(_model("a"), idle_sleep_s=0)
    engines["a"].fail_start = True
    engines["a"].start_s = 0.3
    errors: list[str] = []

    def ask() -> None:
        try:
            with fleet.use("a"):
                pass
        except EngineUnavailable as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert errors == ["engine of 'a' exited with status 1"] * 3
    assert journal == ["start a"] and _states(fleet)["a"] == "stopped"
    engines["a"].fail_start = False
    with fleet.use("a"):
        pass
    assert journal == ["start a", "start a"]


def _weights(name: str, **extra: Any) -> dict[str, Any]:
    return _model(name, sleep="weights", memory_asleep="0.5GiB", args=["--enable-sleep-mode"],
                  **extra)


def test_an_engine_sleeping_at_weights_holds_only_its_asleep_memory(make_fleet: Any,
                                                                   tmp_path: Path) -> None:
    fleet, journal, _ = make_fleet(_weights("a"), _model("b"), idle_sleep_s=0.2)
    with fleet.use("a"):
        pass
    deadline = time.monotonic() + 5
    while _states(fleet)["a"] != "asleep":
        assert time.monotonic() < deadline, _states(fleet)
        time.sleep(0.05)
    # Asleep, a holds 0.5 GiB of its 2: the budget gets the rest back.
    assert read_budget("kvrouter-gpu0", tmp_path / "shm").capacity_bytes == int(4.5 * GIB)
    with fleet.use("a"):
        pass
    assert journal == ["start a", "sleep-weights a", "wake-weights a"]


def test_to_make_room_an_idle_engine_sleeping_at_weights_sleeps_instead_of_stopping(
        make_fleet: Any) -> None:
    fleet, journal, _ = make_fleet(_weights("a"), _model("b"), _model("c"), idle_sleep_s=0)
    for name in ("a", "b"):
        with fleet.use(name):
            pass
    with fleet.use("c"):  # 2 + 2 GiB held, 2 more needed of 5: a goes to sleep (0.5 GiB)
        pass
    assert journal == ["start a", "start b", "sleep-weights a", "start c"]
    assert _states(fleet) == {"a": "asleep", "b": "awake", "c": "awake"}
    # Waking a needs its 1.5 GiB back: b, the idle engine used longest ago, stops for it.
    with fleet.use("a"):
        pass
    assert journal[-2:] == ["stop b", "wake-weights a"]


def test_an_engine_that_died_is_cleaned_up_and_started_again_by_the_next_request(
        make_fleet: Any) -> None:
    fleet, journal, engines = make_fleet(_model("a"), idle_sleep_s=0)
    with fleet.use("a"):
        pass
    engines["a"].running = False  # the process exited unasked
    with fleet.use("a"):
        pass
    assert journal == ["start a", "start a"]
    row = next(r for r in fleet.status() if r["model"] == "a")
    assert row["state"] == "awake"
    assert str(row["last_error"]).startswith("engine of 'a' exited unasked with status")


# ---------------------------------------------------------------------- stopping a process

# The server's child owns a pool (as SGLang's scheduler does) and outlives SIGTERM.
_SERVER_WITH_A_POOL_OWNING_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
from kvcached_core.limits import LimitSegment
signal.signal(signal.SIGTERM, signal.SIG_IGN)
segment = LimitSegment.create("scheduler-pool", capacity_bytes=1 << 20, directory=sys.argv[1])
time.sleep(600)
''', sys.argv[1]])
child.wait()
"""


def test_stopping_an_engine_leaves_no_record_of_its_childrens_pools(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    config = parse_config(_document(_model("a"), shm_dir=str(shm)), tmp_path)
    engine = Engine(config.models[0], config.device("gpu0"), config.log_dir, str(shm))
    engine.process = subprocess.Popen(
        [sys.executable, "-c", _SERVER_WITH_A_POOL_OWNING_CHILD, str(shm)],
        start_new_session=True)
    deadline = time.monotonic() + 60
    while not scan_records(shm)[0]:
        assert time.monotonic() < deadline and engine.alive(), "the child made no pool"
        time.sleep(0.05)
    group = engine.process.pid
    engine.stop()
    # The moment stop() returns, the child is gone and so is its record: a router that
    # shuts down leaves nothing for the next one to find.
    assert scan_records(shm) == ([], [])
    assert group_members(group) == []
