"""The router's Prometheus metrics (served at `/metrics`), in a registry of its own.

    kvrouter_requests_total{model, status}       requests answered, by HTTP status
    kvrouter_request_seconds{model}              time to the last byte, wakes included
    kvrouter_wakes_total{model, kind}            kind: start (a stopped engine), wake (asleep)
    kvrouter_wake_seconds{model, kind}           how long each took
    kvrouter_wake_failures_total{model, kind}
    kvrouter_sleeps_total{model, level}          level: kv, weights, stop
    kvrouter_engine_deaths_total{model}          engines that exited unasked (started again on
                                                 the next request)
    kvrouter_evictions_total{model}              idle engines put to sleep or stopped for another
    kvrouter_engine_state{model, state}          1 for the engine's current state
    kvrouter_inflight_requests{model}
    kvrouter_kv_mapped_bytes{model}              what the engine's pools map (records)
    kvrouter_kv_in_use_bytes{model}
    kvrouter_kv_budget_bytes{device}             the budget the device's engines share
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Wakes take milliseconds (a limit write) and starts tens of seconds (a process start).
_WAKE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Telemetry:
    def __init__(self, states: tuple[str, ...]) -> None:
        self.registry = CollectorRegistry()
        self._states = states
        r = self.registry
        self._requests = Counter("kvrouter_requests", "Requests answered, by HTTP status",
                                 ["model", "status"], registry=r)
        self._request_seconds = Histogram("kvrouter_request_seconds",
                                          "Time to the last byte, wakes included", ["model"],
                                          buckets=_REQUEST_BUCKETS, registry=r)
        self._wakes = Counter("kvrouter_wakes", "Engines made ready for a request",
                              ["model", "kind"], registry=r)
        self._wake_seconds = Histogram("kvrouter_wake_seconds", "How long a start or wake took",
                                       ["model", "kind"], buckets=_WAKE_BUCKETS, registry=r)
        self._wake_failures = Counter("kvrouter_wake_failures", "Starts and wakes that failed",
                                      ["model", "kind"], registry=r)
        self._sleeps = Counter("kvrouter_sleeps", "Engines put to sleep or stopped",
                               ["model", "level"], registry=r)
        self._evictions = Counter("kvrouter_evictions",
                                  "Idle engines put to sleep or stopped to make room",
                                  ["model"], registry=r)
        self._deaths = Counter("kvrouter_engine_deaths", "Engines that exited unasked",
                               ["model"], registry=r)
        self._state = Gauge("kvrouter_engine_state", "1 for the engine's current state",
                            ["model", "state"], registry=r)
        self._inflight = Gauge("kvrouter_inflight_requests", "Requests being proxied",
                               ["model"], registry=r)
        self._kv_mapped = Gauge("kvrouter_kv_mapped_bytes", "KV memory the engine's pools map",
                                ["model"], registry=r)
        self._kv_in_use = Gauge("kvrouter_kv_in_use_bytes", "KV memory blocks use", ["model"],
                                registry=r)
        self._budget = Gauge("kvrouter_kv_budget_bytes", "The KV budget a device's engines share",
                             ["device"], registry=r)

    def set_state(self, model: str, state: str) -> None:
        for each in self._states:
            self._state.labels(model, each).set(1 if each == state else 0)

    def set_inflight(self, model: str, count: int) -> None:
        self._inflight.labels(model).set(count)

    def observe_request(self, model: str, status: int, seconds: float) -> None:
        self._requests.labels(model, str(status)).inc()
        self._request_seconds.labels(model).observe(seconds)

    def observe_wake(self, model: str, kind: str, seconds: float) -> None:
        self._wakes.labels(model, kind).inc()
        self._wake_seconds.labels(model, kind).observe(seconds)

    def count_failure(self, model: str, transition: str) -> None:
        self._wake_failures.labels(model, "start" if transition == "starting" else "wake").inc()

    def count_sleep(self, model: str, level: str) -> None:
        self._sleeps.labels(model, level).inc()

    def count_death(self, model: str) -> None:
        self._deaths.labels(model).inc()

    def count_eviction(self, model: str) -> None:
        self._evictions.labels(model).inc()

    def set_kv(self, model: str, mapped: int, in_use: int) -> None:
        self._kv_mapped.labels(model).set(mapped)
        self._kv_in_use.labels(model).set(in_use)

    def set_budget(self, device: str, capacity: int) -> None:
        self._budget.labels(device).set(capacity)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
