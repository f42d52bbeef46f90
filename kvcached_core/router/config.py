"""The router's configuration file: which models it serves, on which engine and device.

A YAML document (`docs/router.md` has a complete example):

    listen: 127.0.0.1:8000        # where the OpenAI endpoint listens
    log_dir: kvrouter-logs        # one log file per engine (relative: to the config's folder)
    shm_dir: /dev/shm             # pools' records and budgets (default: $KVCACHED_SHM_DIR)
    idle_sleep_s: 60              # an engine idle this long sleeps (0: never)
    request_wait_s: 300           # how long a request waits for its engine to start or wake
    start_timeout_s: 600          # how long an engine may take to start
    devices:
      - {name: gpu0, memory: 120GiB, cuda_visible_devices: "0"}
    models:
      - name: llama-8b            # the `model` clients ask for
        engine: vllm              # vllm or sglang: the patched build installed in `python`'s venv
        python: /opt/llama/bin/python
        model: /models/llama-8b   # what the engine loads
        device: gpu0
        memory: 18GiB             # what the engine holds awake besides its elastic KV cache
        sleep: kv                 # kv (default), weights or stop: what an idle engine gives back
        memory_asleep: 1GiB       # with sleep: weights, what it keeps on the device asleep
        priority: 0               # under pressure, lower priorities sleep or stop first
        args: ["--max-model-len", "8192"]
        env: {VLLM_LOGGING_LEVEL: WARNING}

Every mistake is reported as one `RouterConfigError` line naming the field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.settings import format_size, parse_size

ENGINES = ("vllm", "sglang")
# What an idle engine gives back. `kv`: its KV limit goes to zero, its prefix cache is dropped
# and its pages (the reserve's too) are unmapped; its weights stay, so waking is a limit write.
# `weights`: that, and vLLM's own sleep mode (level 1) moves the weights to host memory; waking
# copies them back. `stop`: the engine process exits and gives back everything; waking is a
# fresh start.
SLEEP_LEVELS = ("kv", "weights", "stop")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/\-]{0,127}$")
_DEVICE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_TOP_KEYS = {"listen", "log_dir", "shm_dir", "idle_sleep_s", "request_wait_s",
             "start_timeout_s", "devices", "models"}
_DEVICE_KEYS = {"name", "memory", "cuda_visible_devices"}
_MODEL_KEYS = {"name", "engine", "python", "model", "device", "memory", "sleep", "priority",
               "args", "env", "idle_sleep_s", "memory_asleep"}


class RouterConfigError(KVCachedConfigError):
    """The configuration cannot be served as written (one line: where and why)."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or the host, for CPU engines) whose memory the router shares out.

    `memory_bytes` is what the engines on it may hold together: each awake engine's declared
    `memory` plus the KV pages of all of them, which draw from one budget the router keeps at
    `memory_bytes` minus what the engines hold besides KV."""

    name: str
    memory_bytes: int
    cuda_visible_devices: str | None = None

    @property
    def budget_name(self) -> str:
        """The KV budget (`kvcached_core/budget.py`) every engine on this device joins."""
        return f"kvrouter-{self.name}"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    engine: str
    python: Path
    model: str
    device: str
    memory_bytes: int
    sleep: str = "kv"
    # What the engine keeps on its device while asleep: all of `memory_bytes` at level kv
    # (the weights stay), the declared `memory_asleep` at level weights, nothing once stopped.
    memory_asleep_bytes: int = 0
    priority: int = 0
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    idle_sleep_s: float | None = None  # None: the router's


@dataclass(frozen=True)
class RouterConfig:
    host: str
    port: int
    log_dir: Path
    shm_dir: str | None
    idle_sleep_s: float
    request_wait_s: float
    start_timeout_s: float
    devices: tuple[DeviceSpec, ...]
    models: tuple[ModelSpec, ...]

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)

    def device(self, name: str) -> DeviceSpec:
        return next(d for d in self.devices if d.name == name)

    def describe(self) -> str:
        """What `kvrouter check` prints: the endpoint, every device and model."""
        lines = [f"endpoint http://{self.host}:{self.port}/v1 ({len(self.models)} models)"]
        for device in self.devices:
            lines.append(f"device {device.name}: {format_size(device.memory_bytes)}, "
                         f"KV budget {device.budget_name}")
            for spec in self.models:
                if spec.device == device.name:
                    lines.append(f"  {spec.name}: {spec.engine} {spec.model}, "
                                 f"{format_size(spec.memory_bytes)} awake, sleep {spec.sleep}, "
                                 f"priority {spec.priority}")
        return "\n".join(lines)


def _fail(where: str, why: str) -> RouterConfigError:
    return RouterConfigError(f"{where}: {why}")


def _unknown_keys(where: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise _fail(where, f"unknown key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _seconds(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise _fail(where, f"must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _size(where: str, value: Any) -> int:
    if isinstance(value, bool):
        raise _fail(where, f"must be a size such as 16GiB, got {value!r}")
    try:
        size = value if isinstance(value, int) else parse_size(str(value))
    except (KVCachedConfigError, ValueError) as exc:
        raise _fail(where, f"must be a size such as 16GiB, got {value!r}") from exc
    if size <= 0:
        raise _fail(where, f"must be above zero, got {value!r}")
    return size


def _listen(value: Any) -> tuple[str, int]:
    text = str(value)
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _fail("listen", f"must be HOST:PORT, got {text!r}")
    return host, int(port)


def _device(index: int, data: Any) -> DeviceSpec:
    where = f"devices[{index}]"
    if not isinstance(data, Mapping):
        raise _fail(where, "must be a mapping with name and memory")
    _unknown_keys(where, data, _DEVICE_KEYS)
    name = str(data.get("name", ""))
    if not _DEVICE.match(name):
        raise _fail(f"{where}.name", f"must be letters, digits, '_', '-', '.', got {name!r}")
    if "memory" not in data:
        raise _fail(where, "memory is required")
    visible = data.get("cuda_visible_devices")
    return DeviceSpec(name, _size(f"{where}.memory", data["memory"]),
                      None if visible is None else str(visible))


def _model(index: int, data: Any, base: Path, devices: Mapping[str, DeviceSpec]) -> ModelSpec:
    where = f"models[{index}]"
    if not isinstance(data, Mapping):
        raise _fail(where, "must be a mapping")
    _unknown_keys(where, data, _MODEL_KEYS)
    for key in ("name", "engine", "python", "model", "device", "memory"):
        if key not in data:
            raise _fail(where, f"{key} is required")
    name = str(data["name"])
    if not _NAME.match(name):
        raise _fail(f"{where}.name", f"{name!r} is not a usable model name")
    where = f"model {name!r}"
    engine = str(data["engine"])
    if engine not in ENGINES:
        raise _fail(f"{where}.engine", f"must be one of {', '.join(ENGINES)}, got {engine!r}")
    python = Path(os.path.expanduser(str(data["python"])))
    python = python if python.is_absolute() else base / python
    if not os.access(python, os.X_OK):
        raise _fail(f"{where}.python", f"{python} is not an executable interpreter")
    device = str(data["device"])
    if device not in devices:
        raise _fail(f"{where}.device",
                    f"names no device (devices: {', '.join(devices) or 'none'}), got {device!r}")
    memory = _size(f"{where}.memory", data["memory"])
    if memory >= devices[device].memory_bytes:
        raise _fail(f"{where}.memory", f"{format_size(memory)} leaves no KV memory on device "
                    f"{device} ({format_size(devices[device].memory_bytes)})")
    sleep = str(data.get("sleep", "kv"))
    if sleep not in SLEEP_LEVELS:
        raise _fail(f"{where}.sleep", f"must be one of {', '.join(SLEEP_LEVELS)}, got {sleep!r}")
    if sleep == "weights" and engine != "vllm":
        raise _fail(f"{where}.sleep", "weights is vLLM's sleep mode; an sglang engine sleeps "
                    "at kv or stop")
    if sleep == "weights" and "--enable-sleep-mode" not in [str(a) for a in data.get("args", [])]:
        raise _fail(f"{where}.sleep", "weights needs --enable-sleep-mode in args (vLLM's sleep "
                    "mode moves the weights)")
    if sleep == "weights" and "memory_asleep" not in data:
        raise _fail(f"{where}", "memory_asleep is required with sleep: weights (what the engine "
                    "keeps on the device while its weights are in host memory)")
    if "memory_asleep" in data and sleep != "weights":
        raise _fail(f"{where}.memory_asleep", "is only for sleep: weights (at kv the engine "
                    "keeps its memory, stopped it keeps none)")
    asleep = (_size(f"{where}.memory_asleep", data["memory_asleep"])
              if sleep == "weights" else memory)
    if asleep > memory:
        raise _fail(f"{where}.memory_asleep", f"{format_size(asleep)} is more than its "
                    f"memory awake ({format_size(memory)})")
    priority = data.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise _fail(f"{where}.priority", f"must be an integer, got {priority!r}")
    args = data.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
        raise _fail(f"{where}.args", "must be a list of command-line words")
    words = tuple(str(a) for a in args)
    for owned in ("--port", "--host", "--served-model-name", "--model", "--model-path"):
        if any(w == owned or w.startswith(owned + "=") for w in words):
            raise _fail(f"{where}.args", f"{owned} is set by the router, leave it out")
    env = data.get("env", {})
    if not isinstance(env, Mapping):
        raise _fail(f"{where}.env", "must be a mapping of variable names to values")
    for key in env:
        if str(key) == "KVCACHED_BUDGET":
            raise _fail(f"{where}.env", "KVCACHED_BUDGET is set by the router (the device's "
                        "budget), leave it out")
    idle = data.get("idle_sleep_s")
    return ModelSpec(
        name=name, engine=engine, python=python, model=str(data["model"]), device=device,
        memory_bytes=memory, sleep=sleep, memory_asleep_bytes=asleep, priority=priority,
        args=words,
        env={str(k): str(v) for k, v in env.items()},
        idle_sleep_s=None if idle is None else _seconds(f"{where}.idle_sleep_s", idle))


def parse_config(data: Any, base: Path) -> RouterConfig:
    """Validate a loaded document; relative paths are taken from `base`."""
    if not isinstance(data, Mapping):
        raise _fail("config", "must be a mapping with devices and models")
    _unknown_keys("config", data, _TOP_KEYS)
    host, port = _listen(data.get("listen", "127.0.0.1:8000"))
    raw_devices = data.get("devices")
    if not isinstance(raw_devices, list) or not raw_devices:
        raise _fail("devices", "must list at least one device")
    devices: dict[str, DeviceSpec] = {}
    for index, item in enumerate(raw_devices):
        device = _device(index, item)
        if device.name in devices:
            raise _fail(f"devices[{index}].name", f"{device.name!r} is listed twice")
        devices[device.name] = device
    raw_models = data.get("models")
    if not isinstance(raw_models, list) or not raw_models:
        raise _fail("models", "must list at least one model")
    models: list[ModelSpec] = []
    for index, item in enumerate(raw_models):
        spec = _model(index, item, base, devices)
        if any(m.name == spec.name for m in models):
            raise _fail(f"models[{index}].name", f"{spec.name!r} is listed twice")
        models.append(spec)
    log_dir = Path(os.path.expanduser(str(data.get("log_dir", "kvrouter-logs"))))
    shm = data.get("shm_dir")
    return RouterConfig(
        host=host, port=port, log_dir=log_dir if log_dir.is_absolute() else base / log_dir,
        shm_dir=None if shm is None else str(shm),
        idle_sleep_s=_seconds("idle_sleep_s", data.get("idle_sleep_s", 60)),
        request_wait_s=_seconds("request_wait_s", data.get("request_wait_s", 300)),
        start_timeout_s=_seconds("start_timeout_s", data.get("start_timeout_s", 600)),
        devices=tuple(devices.values()), models=tuple(models))


def load_config(path: str | os.PathLike[str]) -> RouterConfig:
    """Read and validate a YAML configuration file."""
    import yaml

    where = Path(path)
    try:
        text = where.read_text(encoding="utf-8")
    except OSError as exc:
        raise RouterConfigError(f"{where}: cannot read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise RouterConfigError(f"{where}: {problem}{at}") from exc
    return parse_config(data, where.resolve().parent)
