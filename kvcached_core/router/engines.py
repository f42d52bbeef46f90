"""One engine the router runs: its server process, its pools, and how it sleeps and wakes.

An engine is the engine's own OpenAI server (`vllm.entrypoints.openai.api_server` or
`sglang.launch_server`) from a patched build, started on a free port of 127.0.0.1 with the
model's name as its served name, so a client's request body passes through unchanged. It is
started in a session of its own: stopping it signals the whole process group, and the engine's
children (vLLM's engine core and workers, SGLang's scheduler and detokenizer) go with it.

Sleeping at level `kv` uses only what every patched engine has: the pools' limit records
(`kvcached_core/limits.py`). The limit goes to zero, which unmaps the reserve at once and keeps
every block the engine frees from being mapped again, and the engine is asked to drop its
prefix cache (vLLM's `/reset_prefix_cache`, SGLang's `/flush_cache`), which frees the cached
blocks, so their pages are unmapped too. Waking writes the limits back: the engine's next
allocation sees them, so a wake costs no engine call at all.

Sleeping at level `weights` (vLLM only) does that first and then calls vLLM's own sleep mode
(`POST /sleep?level=1`, which needs `--enable-sleep-mode` and vLLM's development mode): vLLM
moves the weights to host memory and frees what its allocator holds. The KV cache is not in that
allocator (kvcached reserves it and maps its pages), so vLLM's sleep neither frees nor discards
it: the limit write already unmapped its pages. Waking calls `POST /wake_up` (the weights come
back) and then writes the limits back.

Every method here blocks; `fleet.py` decides who calls what, and when.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvcached_core.limits import LimitRecord, collect_stale, scan_records, set_limit
from kvcached_core.processes import group_members, in_tree_of
from kvcached_core.router.config import DeviceSpec, ModelSpec

READY_POLL_S = 0.5
STOP_GRACE_S = 30.0
# How long a sleep waits for the engine's pages to be unmapped after its prefix cache is
# dropped (they drain as the engine's own threads free them).
DRAIN_WAIT_S = 10.0
_LOG_TAIL = 3000


class EngineStartError(RuntimeError):
    """The engine process exited, or did not answer, before it was ready."""


@dataclass(frozen=True)
class KVUsage:
    """What an engine's pools map now (bytes), read from their limit records."""

    mapped_bytes: int
    in_use_bytes: int
    limit_bytes: int
    pools: int


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_call(port: int, method: str, path: str, body: dict[str, object] | None = None,
              timeout_s: float = 30.0) -> tuple[int, bytes]:
    """One request to an engine's server on 127.0.0.1 (status, body); (0, b"") if unreachable."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {} if payload is None else {"Content-Type": "application/json"}
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    except OSError:
        return 0, b""
    finally:
        connection.close()


class Engine:
    """The process of one model's engine server, and its pools' records."""

    def __init__(self, spec: ModelSpec, device: DeviceSpec, log_dir: Path,
                 shm_dir: str | None) -> None:
        self.spec = spec
        self.device = device
        self.log_path = log_dir / f"{spec.name.replace('/', '_')}.log"
        self.shm_dir = shm_dir
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        # Each pool's limit before the engine slept, written back when it wakes.
        self._limits_before_sleep: dict[str, int] = {}

    # ------------------------------------------------------------------ the process

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        spec = self.spec
        if spec.engine == "vllm":
            head = ["-m", "vllm.entrypoints.openai.api_server", "--model", spec.model]
        else:
            head = ["-m", "sglang.launch_server", "--model-path", spec.model]
        return [str(spec.python), *head, "--served-model-name", spec.name,
                "--host", "127.0.0.1", "--port", str(self.port), *spec.args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.spec.env)
        env["KVCACHED_BUDGET"] = self.device.budget_name
        if self.shm_dir is not None:
            env["KVCACHED_SHM_DIR"] = self.shm_dir
        if self.device.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.device.cuda_visible_devices
        if self.spec.engine == "vllm":
            # vLLM serves `/reset_prefix_cache` only in its development mode; the engine
            # listens on 127.0.0.1 alone, behind the router.
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    def start(self, timeout_s: float) -> float:
        """Start the server and wait until it answers `/v1/models`; seconds it took."""
        started = time.monotonic()
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"\n=== kvrouter: starting {' '.join(self.command())}\n".encode())
        self._log.flush()
        self._limits_before_sleep = {}
        self.process = subprocess.Popen(self.command(), env=self.environment(),
                                        stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = started + timeout_s
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                self._close_log()
                raise EngineStartError(f"engine of {self.spec.name!r} exited with status "
                                       f"{code} while starting; log {self.log_path}: "
                                       f"{self.log_tail()}")
            status, _ = http_call(self.port, "GET", "/v1/models", timeout_s=5)
            if status == 200:
                return time.monotonic() - started
            if time.monotonic() > deadline:
                self.stop()
                raise EngineStartError(f"engine of {self.spec.name!r} was not ready after "
                                       f"{timeout_s:.0f} s; log {self.log_path}")
            time.sleep(READY_POLL_S)

    def stop(self) -> None:
        """Stop the process group (SIGTERM, then SIGKILL after STOP_GRACE_S); remove the
        records of pools whose owner is gone (an SGLang scheduler never removes its own)."""
        process = self.process
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_GRACE_S)
            # The server may be gone while its children still run: the group goes either way.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_GRACE_S)
            # SIGKILL lands when each child next runs: until then it still owns its records.
            deadline = time.monotonic() + STOP_GRACE_S
            while group_members(process.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        self.process = None
        self._close_log()
        self._limits_before_sleep = {}
        collect_stale(self.shm_dir)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text[-_LOG_TAIL:].strip().splitlines()[-6:])

    # ------------------------------------------------------------------ the pools

    def records(self) -> list[LimitRecord]:
        """The live records of pools owned by this engine's process or its children."""
        pid = self.pid
        if pid is None:
            return []
        found, _corrupt = scan_records(self.shm_dir)
        return [r for r in found if not r.stale and in_tree_of(r.owner_pid, pid)]

    def usage(self) -> KVUsage:
        records = self.records()
        return KVUsage(mapped_bytes=sum(r.used_bytes + r.reserved_bytes for r in records),
                       in_use_bytes=sum(r.used_bytes for r in records),
                       limit_bytes=sum(r.limit_bytes for r in records), pools=len(records))

    def sleep_kv(self) -> None:
        """Limit every pool to zero, drop the prefix cache, wait for the pages to drain."""
        records = self.records()
        for record in records:
            self._limits_before_sleep.setdefault(record.pool, record.limit_bytes)
            set_limit(record.pool, 0, directory=self.shm_dir)
        if self.spec.engine == "vllm":
            http_call(self.port, "POST", "/reset_prefix_cache")
        else:
            http_call(self.port, "POST", "/flush_cache")
        # The engine frees the cached blocks on its own thread and its pool then rewrites its
        # record: wait until what it maps stops falling.
        deadline = time.monotonic() + DRAIN_WAIT_S
        last, steady = self.usage().mapped_bytes, 0
        while time.monotonic() < deadline and steady < 5:
            time.sleep(0.1)
            now = self.usage().mapped_bytes
            steady = steady + 1 if now == last else 0
            last = now

    def sleep_weights(self) -> None:
        """Level weights: the KV pages first, then vLLM's sleep mode moves the weights out."""
        self.sleep_kv()
        status, body = http_call(self.port, "POST", "/sleep?level=1", timeout_s=300)
        if status != 200:
            raise EngineStartError(f"engine of {self.spec.name!r} refused to sleep (HTTP "
                                   f"{status}: {body[-300:].decode(errors='replace')})")

    def wake_weights(self) -> None:
        status, body = http_call(self.port, "POST", "/wake_up", timeout_s=300)
        if status != 200:
            raise EngineStartError(f"engine of {self.spec.name!r} did not wake (HTTP "
                                   f"{status}: {body[-300:].decode(errors='replace')})")
        self.wake_kv()

    def wake_kv(self) -> None:
        """Write back the limits the pools had before the engine slept."""
        for pool, limit in self._limits_before_sleep.items():
            with contextlib.suppress(OSError, LookupError):
                set_limit(pool, limit, directory=self.shm_dir)
        self._limits_before_sleep = {}
