"""Real worker (and coordinator) processes for the IPC tests, and the tests of the harness itself.

Run as a script, this file is one process of a job:
    python test_ipc_harness.py worker '<json config>'       one rank's tensors + listener
    python test_ipc_harness.py coordinator '<json config>'  a scheduler: PageAllocator + ledger
A worker can stop at a barrier inside one command (before or after the native call) until the
test releases it, so that a test can kill it, time it out or shut it down at that exact point.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached_core import native
from kvcached_core.ipc.paths import worker_address
from kvcached_core.ipc.protocol import (
    Reply,
    Request,
    decode_reply,
    encode_request,
    recv_frame,
    send_frame,
)

PAGE = 64 * 1024
PAGES = 16
LAYERS = 2
BUFFERS = 2
LOGICAL_PAGE_BYTES = PAGE * LAYERS * BUFFERS
BLOCK_BYTES = PAGE // 4  # four blocks per page in the coordinator's ledger
REPO_ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- worker process


class GatedAllocator:
    """An FTensorAllocator that stops at a barrier on the n-th call of one command."""

    def __init__(self, inner: Any, gate: dict[str, Any]) -> None:
        self._inner = inner
        self._command = str(gate["command"])
        self._when = str(gate.get("when", "before"))
        self._occurrence = int(gate.get("occurrence", 1))
        self._dir = Path(gate["dir"])
        self._calls = 0

    def _barrier(self, command: str, when: str) -> None:
        if command != self._command or when != self._when or self._calls != self._occurrence:
            return
        (self._dir / f"reached-{command}").touch()
        release = self._dir / f"release-{command}"
        while not release.exists():
            time.sleep(0.005)

    def _call(self, command: str, operation: Callable[[], Any]) -> Any:
        if command == self._command:
            self._calls += 1
        self._barrier(command, "before")
        try:
            return operation()
        finally:
            self._barrier(command, "after")

    def map_pages(self, page_ids: list[int]) -> list[int]:
        return self._call("map_pages", lambda: self._inner.map_pages(page_ids))

    def unmap_pages(self, page_ids: list[int]) -> None:
        self._call("unmap_pages", lambda: self._inner.unmap_pages(page_ids))

    def prepare_unmap(self, txn_id: int, page_ids: list[int]) -> None:
        self._call("prepare_unmap", lambda: self._inner.prepare_unmap(txn_id, page_ids))

    def commit_unmap(self, txn_id: int) -> None:
        self._call("commit_unmap", lambda: self._inner.commit_unmap(txn_id))

    def abort_unmap(self, txn_id: int) -> None:
        self._call("abort_unmap", lambda: self._inner.abort_unmap(txn_id))

    @property
    def pending_txn(self) -> int | None:
        return self._inner.pending_txn

    @property
    def num_logical_pages(self) -> int:
        return self._inner.num_logical_pages

    @property
    def logical_page_bytes(self) -> int:
        return self._inner.logical_page_bytes

    @property
    def tensors_created(self) -> bool:
        return self._inner.tensors_created

    def mapped_page_ids(self) -> list[int]:
        return self._inner.mapped_page_ids()

    def quarantined_page_ids(self) -> list[int]:
        return self._inner.quarantined_page_ids()

    def physical_free_pages(self) -> int:
        return self._inner.physical_free_pages()


def worker_main(config: dict[str, Any]) -> int:
    from kvcached_core.ipc.worker import WorkerListener

    backend = native.host_backend()
    allocator = native.FTensorAllocator(backend, PAGE, False)
    allocator.create_kv_tensors(PAGE * config.get("pages", PAGES), LAYERS, BUFFERS)
    for op, nth in config.get("inject", []):  # counted from the first call after start-up
        backend.inject_failure(op, nth=nth)
    served: Any = GatedAllocator(allocator, config["gate"]) if config.get("gate") else allocator
    address = worker_address(config["root"], config["rank"], config.get("pp_rank", 0))
    listener = WorkerListener(served, address, resident_bytes=backend.committed_bytes)
    stop_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    listener.start()
    print("ready", flush=True)
    while not stop_requested.wait(0.05):
        pass
    timeout_s = float(config.get("stop_timeout_s", 5.0))
    while True:
        stopped = listener.stop(timeout_s)
        print(f"stopped {stopped} socket_exists {address.path.exists()}", flush=True)
        if stopped:
            return 0


def coordinator_main(config: dict[str, Any]) -> int:
    """Allocate `blocks` blocks on every rank, report, then free them all (and exit)."""
    from kvcached_core.ipc.coordinator import BroadcastMapper
    from kvcached_core.ledger import BlockLedger

    mapper = BroadcastMapper.for_job(config["root"], config["tp_size"])
    pages = native.PageAllocator(mapper, 0, 0, False)
    manager = BlockLedger(pages, BLOCK_BYTES, PAGE, set_aside_null_block=False)
    blocks = manager.alloc(config["blocks"])
    print(f"allocated {json.dumps(blocks)}", flush=True)
    manager.free(blocks)
    print("freed", flush=True)
    manager.shutdown()
    return 0


# ---------------------------------------------------------------------------- test side


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def spawn(role: str, config: dict[str, Any], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), role, json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_child_env(), **env},
    )


@dataclass
class WorkerProcess:
    """One worker rank running in its own process."""

    root: Path
    rank: int
    pp_rank: int = 0
    pages: int = PAGES
    gate: dict[str, Any] | None = None
    inject: list[tuple[str, int]] = field(default_factory=list)
    stop_timeout_s: float = 5.0
    gate_dir: Path | None = None
    process: subprocess.Popen[str] | None = None

    def start(self) -> WorkerProcess:
        config: dict[str, Any] = {
            "root": str(self.root),
            "rank": self.rank,
            "pp_rank": self.pp_rank,
            "pages": self.pages,
            "inject": self.inject,
            "stop_timeout_s": self.stop_timeout_s,
        }
        if self.gate is not None:
            self.gate_dir = Path(tempfile.mkdtemp(prefix="kvc-gate-"))
            config["gate"] = {**self.gate, "dir": str(self.gate_dir)}
        self.process = spawn("worker", config)
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.process.kill()
            _, err = self.process.communicate(timeout=10)
            raise AssertionError(f"worker {self.rank} did not start: {line!r} {err}")
        return self

    @property
    def path(self) -> Path:
        return worker_address(self.root, self.rank, self.pp_rank).path

    def reached(self, command: str) -> bool:
        assert self.gate_dir is not None
        return (self.gate_dir / f"reached-{command}").exists()

    def wait_reached(self, command: str, timeout_s: float = 10.0) -> None:
        wait_for(lambda: self.reached(command), timeout_s, f"rank {self.rank} reach {command}")

    def release(self, command: str) -> None:
        assert self.gate_dir is not None
        (self.gate_dir / f"release-{command}").touch()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def call(self, command: str, **args: Any) -> Reply:
        return raw_call(self.path, command, args)

    def state(self) -> dict[str, Any]:
        reply = self.call("state")
        assert reply.ok, reply.message
        return reply.result

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        if self.process is not None:
            for stream in (self.process.stdout, self.process.stderr):
                if stream is not None:
                    stream.close()
        if self.gate_dir is not None:
            shutil.rmtree(self.gate_dir, ignore_errors=True)


def raw_call(path: Path, command: str, args: dict[str, Any], timeout_s: float = 10.0) -> Reply:
    """One request on a fresh connection, as any client of the socket would send it."""
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        send_frame(sock, encode_request(Request(1, command, args)), deadline)
        return decode_reply(recv_frame(sock, deadline))


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting to {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def socket_root() -> Iterator[Path]:
    """A short private base directory (Unix socket paths are limited to 107 bytes)."""
    base = Path(tempfile.mkdtemp(prefix="kvc-"))
    try:
        yield base / "job"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def workers(count: int, **options: Any) -> Iterator[tuple[Path, list[WorkerProcess]]]:
    """`count` tensor-parallel ranks; `options` keyed by rank: {"gate": {1: {...}}}."""
    with socket_root() as root:
        started: list[WorkerProcess] = []
        try:
            for rank in range(count):
                per_rank = {key: value.get(rank) for key, value in options.items()}
                kwargs = {key: value for key, value in per_rank.items() if value is not None}
                started.append(WorkerProcess(root, rank, **kwargs).start())
            yield root, started
        finally:
            for worker in started:
                worker.close()


# ---------------------------------------------------------------------------- harness tests


def test_worker_process_answers_hello_with_its_geometry() -> None:
    with workers(1) as (_, (worker,)):
        reply = worker.call("hello")
        assert reply.ok
        assert reply.result["num_logical_pages"] == PAGES
        assert reply.result["logical_page_bytes"] == LOGICAL_PAGE_BYTES
        assert reply.result["rank"] == 0
        assert reply.result["pid"] == worker.process.pid  # type: ignore[union-attr]
        assert worker.state()["resident_bytes"] == 0


def test_gate_holds_a_call_until_released() -> None:
    gate = {"command": "map_pages", "when": "after"}
    with workers(1, gate={0: gate}) as (_, (worker,)):
        result: list[Reply] = []
        caller = threading.Thread(target=lambda: result.append(worker.call("map", page_ids=[1])))
        caller.start()
        worker.wait_reached("map_pages")
        time.sleep(0.1)
        assert not result  # the reply waits for the barrier
        worker.release("map_pages")
        caller.join(10)
        assert result and result[0].ok and result[0].result["newly_mapped"] == [1]


if __name__ == "__main__":
    role, raw_config = sys.argv[1], sys.argv[2]
    mains = {"worker": worker_main, "coordinator": coordinator_main}
    if role not in mains:
        raise SystemExit(f"unknown role {role!r}")
    sys.exit(mains[role](json.loads(raw_config)))
