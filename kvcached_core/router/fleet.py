"""Which engines run, sleep or stop: the router's one decision-maker.

Every engine is in one state, changed only under the fleet's condition variable:

    stopped --start--> starting --ready--> awake --sleep--> sleeping --done--> asleep
       ^                  |                  |  ^                                 |
       |               failed                |  +------------ waking <--wake------+
       +------------- stopping <--stop-------+----------------------------------+

`starting`, `sleeping`, `waking` and `stopping` are transitions: the thread that began one
carries it out with the lock released (a start takes seconds to minutes) and then moves the
engine on and wakes every waiter. A request that finds its engine in a transition waits for it.

Invariants, held under the lock:
- `inflight` counts the requests being proxied to an engine. Only an `awake` engine takes one,
  and an engine with `inflight > 0` is never put to sleep or stopped: idle sleep and making
  room both pick only engines with none.
- Memory: on each device, an engine holds its declared `memory` unless it is `asleep` (then
  its `memory_asleep`: all of it at level kv, which keeps the weights) or `stopped` (nothing);
  the rest of the device is the KV budget they all draw from (`kvcached_core/budget.py`),
  rewritten whenever that changes. An engine starts or wakes only if its `memory` fits beside
  what the others hold; if not, idle engines make room, lowest priority and least recently
  used first: one that sleeps at level weights and is awake goes to sleep, any other stops.
  If only busy engines are left, the request waits for one of them to become idle, up to
  `request_wait_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from kvcached_core.budget import delete_budget, set_budget
from kvcached_core.errors import KVCachedError
from kvcached_core.router.config import DeviceSpec, ModelSpec, RouterConfig
from kvcached_core.router.engines import Engine, EngineStartError
from kvcached_core.router.telemetry import Telemetry
from kvcached_core.settings import format_size

STOPPED, STARTING, AWAKE, SLEEPING, ASLEEP, WAKING, STOPPING = (
    "stopped", "starting", "awake", "sleeping", "asleep", "waking", "stopping")
STATES = (STOPPED, STARTING, AWAKE, SLEEPING, ASLEEP, WAKING, STOPPING)
_TRANSITIONS = (STARTING, SLEEPING, WAKING, STOPPING)
IDLE_POLL_S = 0.5


class EngineUnavailable(KVCachedError):
    """A request's engine could not be made ready in time (HTTP 503, with the reason)."""


@dataclass
class _Slot:
    """The fleet's view of one engine (guarded by the fleet's lock)."""

    engine: Engine
    state: str = STOPPED
    inflight: int = 0
    last_used: float = 0.0
    failures: int = 0  # start failures so far: a waiter that saw one fail gives up
    last_error: str = ""


EngineFactory = Callable[[ModelSpec, DeviceSpec, RouterConfig], Engine]


def engine_process(spec: ModelSpec, device: DeviceSpec, config: RouterConfig) -> Engine:
    return Engine(spec, device, config.log_dir, config.shm_dir)


class Fleet:
    def __init__(self, config: RouterConfig, telemetry: Telemetry,
                 make_engine: EngineFactory = engine_process) -> None:
        self.config = config
        self.telemetry = telemetry
        self._cv = threading.Condition()
        self._slots = {
            spec.name: _Slot(make_engine(spec, config.device(spec.device), config))
            for spec in config.models}
        self._closing = False
        self._idle_thread: threading.Thread | None = None
        for spec in config.models:
            telemetry.set_state(spec.name, STOPPED)

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Create every device's KV budget and start the idle watcher."""
        with self._cv:
            for device in self.config.devices:
                self._write_budget(device.name)
        self._idle_thread = threading.Thread(target=self._idle_loop, name="kvrouter-idle",
                                             daemon=True)
        self._idle_thread.start()

    def close(self) -> None:
        """Stop every engine (waiting for transitions under way) and remove the budgets."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            while any(s.state in _TRANSITIONS for s in self._slots.values()):
                self._cv.wait(1.0)
            running = [s for s in self._slots.values() if s.state != STOPPED]
            for slot in running:
                self._move(slot, STOPPING)
        # Each engine may take its grace period to drain: stop them all at once.
        stoppers = [threading.Thread(target=slot.engine.stop, name="kvrouter-stop")
                    for slot in running]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join()
        with self._cv:
            for slot in running:
                self._move(slot, STOPPED)
        if self._idle_thread is not None:
            self._idle_thread.join(timeout=5)
        for device in self.config.devices:
            with suppress(KVCachedError, OSError):
                delete_budget(device.budget_name, directory=self.config.shm_dir, force=True)

    # ------------------------------------------------------------------ requests

    def names(self) -> list[str]:
        return list(self._slots)

    @contextmanager
    def use(self, name: str) -> Iterator[Engine]:
        """The model's engine, awake, for the duration of one request."""
        slot = self._acquire(name)
        try:
            yield slot.engine
        finally:
            with self._cv:
                slot.inflight -= 1
                slot.last_used = time.monotonic()
                self.telemetry.set_inflight(name, slot.inflight)
                self._cv.notify_all()

    def _acquire(self, name: str) -> _Slot:
        slot = self._slots[name]
        deadline = time.monotonic() + self.config.request_wait_s
        with self._cv:
            failures_seen = slot.failures
            while True:
                if self._closing:
                    raise EngineUnavailable("the router is shutting down")
                if slot.failures != failures_seen:
                    raise EngineUnavailable(slot.last_error)
                if slot.state in (AWAKE, ASLEEP) and not slot.engine.alive():
                    self._bury(slot)
                    continue
                if slot.state == AWAKE:
                    slot.inflight += 1
                    slot.last_used = time.monotonic()
                    self.telemetry.set_inflight(name, slot.inflight)
                    return slot
                if slot.state == ASLEEP and self._make_room(slot):
                    self._run_transition(slot, WAKING, AWAKE, self._wake)
                    continue
                if slot.state == STOPPED and self._make_room(slot):
                    self._run_transition(slot, STARTING, AWAKE, self._start)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineUnavailable(self._why_waiting(slot))
                self._cv.wait(min(remaining, 1.0))

    def _why_waiting(self, slot: _Slot) -> str:
        name = slot.engine.spec.name
        if slot.state not in (STOPPED, ASLEEP):
            return (f"model {name!r} was still {slot.state} after "
                    f"{self.config.request_wait_s:.0f} s")
        device = slot.engine.device
        busy = [s.engine.spec.name for s in self._on_device(device.name)
                if s is not slot and s.state != STOPPED]
        return (f"model {name!r} needs {format_size(self._to_fit(slot))} on device "
                f"{device.name}, where {format_size(self._free_memory(device.name))} is free "
                f"and engines {', '.join(busy)} stayed busy for "
                f"{self.config.request_wait_s:.0f} s")

    # ------------------------------------------------------------------ transitions

    def _run_transition(self, slot: _Slot, during: str, after: str,
                        work: Callable[[_Slot], None]) -> None:
        """Carry out one transition with the lock released (called and returning with it)."""
        before = slot.state
        self._move(slot, during)
        self._cv.release()
        error: BaseException | None = None
        try:
            work(slot)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter, then re-raised
            error = exc
        finally:
            self._cv.acquire()
        if error is None:
            self._move(slot, after)
            return
        slot.failures += 1
        slot.last_error = str(error)
        if during in (STARTING, WAKING):
            self.telemetry.count_failure(slot.engine.spec.name, during)
        # A failed start or wake leaves nothing running; a failed sleep leaves the engine
        # as it was (its pages drain later), a failed stop leaves it stopped anyway.
        self._move(slot, STOPPED if during in (STARTING, WAKING, STOPPING) else before)
        if isinstance(error, (EngineStartError, KVCachedError, OSError)):
            return
        raise error

    def _move(self, slot: _Slot, state: str) -> None:
        held_before = self._holds(slot)
        slot.state = state
        self.telemetry.set_state(slot.engine.spec.name, state)
        if self._holds(slot) != held_before:
            self._write_budget(slot.engine.device.name)
        self._cv.notify_all()

    def _start(self, slot: _Slot) -> None:
        try:
            seconds = slot.engine.start(self.config.start_timeout_s)
        except BaseException:
            slot.engine.stop()
            raise
        self.telemetry.observe_wake(slot.engine.spec.name, "start", seconds)

    def _wake(self, slot: _Slot) -> None:
        started = time.monotonic()
        if not slot.engine.alive():
            raise EngineStartError(f"engine of {slot.engine.spec.name!r} died while asleep; "
                                   f"log {slot.engine.log_path}: {slot.engine.log_tail()}")
        if slot.engine.spec.sleep == "weights":
            slot.engine.wake_weights()
        else:
            slot.engine.wake_kv()
        self.telemetry.observe_wake(slot.engine.spec.name, "wake",
                                    time.monotonic() - started)

    def _sleep(self, slot: _Slot) -> None:
        if slot.engine.spec.sleep == "weights":
            slot.engine.sleep_weights()
        else:
            slot.engine.sleep_kv()
        self.telemetry.count_sleep(slot.engine.spec.name, slot.engine.spec.sleep)

    def _stop(self, slot: _Slot) -> None:
        slot.engine.stop()
        self.telemetry.count_sleep(slot.engine.spec.name, "stop")

    def _bury(self, slot: _Slot) -> None:
        """An engine whose process exited unasked: clean its process group and records up and
        mark it stopped, so the next request starts it again (lock held; released meanwhile).
        Requests in flight on it have already failed on their connection."""
        engine = slot.engine
        code = engine.process.returncode if engine.process is not None else None
        slot.last_error = (f"engine of {engine.spec.name!r} exited unasked with status {code}; "
                           f"log {engine.log_path}: {engine.log_tail()}")
        self.telemetry.count_death(engine.spec.name)
        self._run_transition(slot, STOPPING, STOPPED, self._clean_up)

    @staticmethod
    def _clean_up(slot: _Slot) -> None:
        slot.engine.stop()

    def sleep(self, name: str) -> str:
        """Put an idle, awake engine to sleep at its level now (an operator's request)."""
        slot = self._slots[name]
        with self._cv:
            if slot.state != AWAKE or slot.inflight:
                return slot.state
            self._put_to_sleep(slot)
            return slot.state

    def stop(self, name: str) -> str:
        slot = self._slots[name]
        with self._cv:
            if slot.state in (AWAKE, ASLEEP) and not slot.inflight:
                self._run_transition(slot, STOPPING, STOPPED, self._stop)
            return slot.state

    def _put_to_sleep(self, slot: _Slot) -> None:
        if slot.engine.spec.sleep == "stop":
            self._run_transition(slot, STOPPING, STOPPED, self._stop)
        else:
            self._run_transition(slot, SLEEPING, ASLEEP, self._sleep)

    # ------------------------------------------------------------------ memory

    def _on_device(self, device: str) -> list[_Slot]:
        return [s for s in self._slots.values() if s.engine.device.name == device]

    @staticmethod
    def _holds(slot: _Slot) -> int:
        """What the engine holds on its device in its state (declared, not measured)."""
        if slot.state == STOPPED:
            return 0
        if slot.state == ASLEEP:
            return slot.engine.spec.memory_asleep_bytes
        return slot.engine.spec.memory_bytes

    def _held(self, device: str) -> int:
        return sum(self._holds(s) for s in self._on_device(device))

    def _to_fit(self, slot: _Slot) -> int:
        """What the slot must add to its device's holdings to run."""
        return slot.engine.spec.memory_bytes - self._holds(slot)

    def _free_memory(self, device: str) -> int:
        return max(0, self.config.device(device).memory_bytes - self._held(device))

    def _write_budget(self, device: str) -> None:
        spec = self.config.device(device)
        set_budget(spec.budget_name, self._free_memory(device), directory=self.config.shm_dir)
        self.telemetry.set_budget(device, self._free_memory(device))

    def _make_room(self, slot: _Slot) -> bool:
        """Make idle engines on the slot's device give memory back until the slot fits (lock
        held; released while an engine sleeps or stops). False: it does not fit and no idle
        engine has anything left to give."""
        device = slot.engine.device.name
        state = slot.state
        while self._free_memory(device) < self._to_fit(slot):
            if any(s.state in (SLEEPING, STOPPING) for s in self._on_device(device)):
                # An engine is giving memory back now (an idle one the idle loop put to
                # sleep, or a victim of another request): wait for it and look again, rather
                # than choose a victim among the others without it. An engine that is only
                # falling asleep is still the oldest idle one, and stopping a newer engine in
                # its place would break the eviction order.
                self._cv.wait(1.0)
                if slot.state != state:
                    return False
                continue
            idle = [s for s in self._on_device(device)
                    if s is not slot and s.state in (AWAKE, ASLEEP) and not s.inflight
                    and self._holds(s) > 0]
            if not idle:
                return False
            victim = min(idle, key=lambda s: (s.engine.spec.priority, s.last_used))
            self.telemetry.count_eviction(victim.engine.spec.name)
            if (victim.state == AWAKE and victim.engine.spec.sleep == "weights"
                    and victim.engine.spec.memory_asleep_bytes < victim.engine.spec.memory_bytes):
                self._run_transition(victim, SLEEPING, ASLEEP, self._sleep)
            else:
                self._run_transition(victim, STOPPING, STOPPED, self._stop)
            if slot.state != state:  # another request moved it meanwhile
                return False
        return True

    # ------------------------------------------------------------------ idle engines

    def _idle_loop(self) -> None:
        while True:
            with self._cv:
                if self._closing:
                    return
                now = time.monotonic()
                for slot in self._slots.values():
                    if slot.state in (AWAKE, ASLEEP) and not slot.engine.alive():
                        self._bury(slot)
                        break  # the lock was released: look again
                    idle_s = slot.engine.spec.idle_sleep_s
                    idle_s = self.config.idle_sleep_s if idle_s is None else idle_s
                    if (slot.state == AWAKE and not slot.inflight and idle_s > 0
                            and now - slot.last_used >= idle_s):
                        self._put_to_sleep(slot)
                        break  # the lock was released: look again
                else:
                    self._cv.wait(IDLE_POLL_S)

    # ------------------------------------------------------------------ status

    def status(self) -> list[dict[str, object]]:
        """Every model's engine as `/router/status` reports it."""
        with self._cv:
            rows = [(name, s.state, s.inflight, s.last_used, s.last_error, s.engine)
                    for name, s in self._slots.items()]
        now = time.monotonic()
        out: list[dict[str, object]] = []
        for name, state, inflight, last_used, last_error, engine in rows:
            usage = engine.usage()
            out.append({
                "model": name, "engine": engine.spec.engine, "device": engine.device.name,
                "state": state, "inflight": inflight, "pid": engine.pid,
                "port": engine.port if engine.pid else None,
                "idle_s": round(now - last_used, 1) if last_used else None,
                "memory_bytes": engine.spec.memory_bytes,
                "kv_mapped_bytes": usage.mapped_bytes, "kv_in_use_bytes": usage.in_use_bytes,
                "kv_limit_bytes": usage.limit_bytes, "pools": usage.pools,
                "last_error": last_error or None, "log": str(engine.log_path)})
        return out

    def refresh_memory(self) -> None:
        """Update the per-model KV gauges from the pools' records."""
        for name, slot in self._slots.items():
            usage = slot.engine.usage()
            self.telemetry.set_kv(name, usage.mapped_bytes, usage.in_use_bytes)
