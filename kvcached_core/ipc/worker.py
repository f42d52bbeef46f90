"""The worker side: a rank that maps and unmaps its KV tensors on the coordinator's request.

Each worker process owns an FTensorAllocator (its tensors) and answers the coordinator through
a `RankServer`, one request at a time, so the allocator sees the coordinator's calls in order.
A request that cannot be parsed, names an unknown command or carries bad arguments gets an
error reply; nothing a peer sends stops the server. Requests reach it one of two ways:

- `WorkerListener`: the rank's private Unix socket (workers on the scheduler's host);
- `answer_broadcast`: called in the worker's process by the engine's own worker RPC (vLLM's
  `collective_rpc` on Ray actors), for ranks the coordinator's host cannot reach by socket.
  Such a rank is registered here under its job's name (`serve_in_process`).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kvcached_core.errors import (
    KVCachedConfigError,
    MapQuarantinedError,
    PoolExhausted,
    StateConsistencyError,
)
from kvcached_core.ipc.paths import RankId, WorkerAddress, ensure_private_dir
from kvcached_core.ipc.protocol import (
    PROTOCOL_VERSION,
    Command,
    ErrorKind,
    FrameReader,
    ProtocolError,
    Reply,
    Request,
    decode_request,
    encode_reply,
    error_reply,
    int_arg,
    page_ids_arg,
    whole_frame_payload,
)

# Outcomes the listener remembers, as many as the native transaction history keeps.
TXN_HISTORY = 64
COMMITTED, ABORTED = "committed", "aborted"
_SEND_TIMEOUT_S = 5.0
_RECV_CHUNK = 65536


class LocalAllocator(Protocol):
    """What the listener uses of `kvcached_core._C.FTensorAllocator`."""

    @property
    def pending_txn(self) -> int | None: ...
    @property
    def num_logical_pages(self) -> int: ...
    @property
    def logical_page_bytes(self) -> int: ...
    @property
    def tensors_created(self) -> bool: ...

    def map_pages(self, page_ids: list[int]) -> list[int]: ...
    def unmap_pages(self, page_ids: list[int]) -> None: ...
    def prepare_unmap(self, txn_id: int, page_ids: list[int]) -> None: ...
    def commit_unmap(self, txn_id: int) -> None: ...
    def abort_unmap(self, txn_id: int) -> None: ...
    def mapped_page_ids(self) -> list[int]: ...
    def quarantined_page_ids(self) -> list[int]: ...
    def physical_free_pages(self) -> int: ...


class _UnknownCommand(ProtocolError):
    def __init__(self, command: str) -> None:
        super().__init__(f"unknown command {command!r}")


def error_kind_of(exc: BaseException) -> ErrorKind:
    if isinstance(exc, _UnknownCommand):
        return ErrorKind.UNKNOWN_COMMAND
    if isinstance(exc, ProtocolError):
        return ErrorKind.PROTOCOL
    if isinstance(exc, MapQuarantinedError):
        return ErrorKind.MAP_QUARANTINED
    if isinstance(exc, StateConsistencyError):
        return ErrorKind.STATE_CONSISTENCY
    if isinstance(exc, PoolExhausted):
        return ErrorKind.POOL_EXHAUSTED
    if isinstance(exc, KVCachedConfigError):
        return ErrorKind.CONFIG
    return ErrorKind.OPERATION_FAILED


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()


class RankServer:
    """Answers the coordinator's requests for one rank's allocator, whatever carries them.

    Calls are serialised by a lock: a socket listener has one thread, but an engine's RPC may
    run calls on a pool of threads.
    """

    def __init__(
        self,
        allocator: LocalAllocator,
        rank: int,
        pp_rank: int,
        *,
        resident_bytes: Callable[[], int] | None = None,
    ) -> None:
        self._allocator = allocator
        self.rank = rank
        self.pp_rank = pp_rank
        self._resident_bytes = resident_bytes
        self._history: OrderedDict[int, str] = OrderedDict()
        self._highest_txn = 0
        self._lock = threading.Lock()

    def answer(self, payload: bytes) -> Reply:
        with self._lock:
            return self._answer(payload)

    def answer_addressed(self, frames: dict[str, bytes]) -> dict[str, Any] | None:
        """The reply to the frame addressed to this rank (by `RankId.key`) in one broadcast,
        with the rank that answers; None when the broadcast addressed no frame to it."""
        frame = frames.get(RankId(self.rank, self.pp_rank).key)
        if frame is None:
            return None
        try:
            reply = self.answer(whole_frame_payload(frame))
        except ProtocolError as exc:
            reply = error_reply(exc.request_id, ErrorKind.PROTOCOL, str(exc))
        return {"rank": self.rank, "pp_rank": self.pp_rank, "reply": encode_reply(reply)}

    def _answer(self, payload: bytes) -> Reply:
        try:
            request = decode_request(payload)
        except ProtocolError as exc:
            return error_reply(exc.request_id, ErrorKind.PROTOCOL, str(exc))
        try:
            return Reply(request.request_id, True, self._dispatch(request))
        except Exception as exc:  # every failure becomes a reply: the listener keeps serving
            return error_reply(request.request_id, error_kind_of(exc), f"{exc}")

    def _dispatch(self, request: Request) -> dict[str, Any]:
        args = request.args
        allocator = self._allocator
        command = request.command
        if command == Command.HELLO:
            return {
                "protocol": PROTOCOL_VERSION,
                "rank": self.rank,
                "pp_rank": self.pp_rank,
                "pid": os.getpid(),
                "num_logical_pages": int(allocator.num_logical_pages),
                "logical_page_bytes": int(allocator.logical_page_bytes),
                "tensors_created": bool(allocator.tensors_created),
                "highest_txn": self._highest_txn,
            }
        if command == Command.STATE:
            return self._state()
        if command == Command.MAP:
            return {"newly_mapped": [int(i) for i in allocator.map_pages(page_ids_arg(args))]}
        if command == Command.UNMAP:
            allocator.unmap_pages(page_ids_arg(args))
            return {}
        if command == Command.PREPARE_UNMAP:
            txn = self._txn_arg(args)
            allocator.prepare_unmap(txn, page_ids_arg(args))
            return {}
        if command == Command.COMMIT_UNMAP:
            self._finish(self._txn_arg(args), allocator.commit_unmap, COMMITTED)
            return {}
        if command == Command.ABORT_UNMAP:
            self._finish(self._txn_arg(args), allocator.abort_unmap, ABORTED)
            return {}
        raise _UnknownCommand(command)

    def _txn_arg(self, args: dict[str, Any]) -> int:
        txn = int_arg(args, "txn")
        self._highest_txn = max(self._highest_txn, txn)
        return txn

    def _finish(self, txn: int, operation: Callable[[int], None], outcome: str) -> None:
        # The native allocator keeps the authoritative history; this copy lets a restarted
        # coordinator learn how an in-doubt transaction ended on each rank.
        was_pending = self._allocator.pending_txn == txn
        try:
            operation(txn)
        except Exception:
            # A commit whose release failed, or an abort that quarantined pages, still ended
            # the transaction natively.
            if was_pending and self._allocator.pending_txn != txn:
                self._remember(txn, outcome)
            raise
        self._remember(txn, outcome)

    def _remember(self, txn: int, outcome: str) -> None:
        self._history[txn] = outcome
        while len(self._history) > TXN_HISTORY:
            self._history.popitem(last=False)

    def _state(self) -> dict[str, Any]:
        allocator = self._allocator
        return {
            "mapped": [int(i) for i in allocator.mapped_page_ids()],
            "quarantined": [int(i) for i in allocator.quarantined_page_ids()],
            "pending_txn": allocator.pending_txn,
            "physical_free_pages": int(allocator.physical_free_pages()),
            "resident_bytes": None if self._resident_bytes is None else self._resident_bytes(),
            "highest_txn": self._highest_txn,
            "txn_history": [[txn, outcome] for txn, outcome in self._history.items()],
        }


class WorkerListener:
    """Serves one rank's allocator on `address` until `stop`."""

    def __init__(
        self,
        allocator: LocalAllocator,
        address: WorkerAddress,
        *,
        resident_bytes: Callable[[], int] | None = None,
    ) -> None:
        self.address = address
        self._server = RankServer(
            allocator, address.rank, address.pp_rank, resident_bytes=resident_bytes
        )
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._listen_sock: socket.socket | None = None
        self._wake_read, self._wake_write = -1, -1
        self._dirs: list[Path] = []
        self._socket_identity: tuple[int, int] | None = None
        self._removed = False

    @property
    def path(self) -> Path:
        return self.address.path

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"listener of {self.address.label} already started")
        stage_dir = self.path.parent
        directories = [stage_dir] if self.address.pp_rank == 0 else [stage_dir.parent, stage_dir]
        for directory in directories:
            ensure_private_dir(directory)
        self._dirs = directories
        self._clear_stale_socket()
        listen_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listen_sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            listen_sock.listen(16)
            listen_sock.setblocking(False)
            info = os.stat(self.path)
            self._socket_identity = (info.st_dev, info.st_ino)
        except BaseException:
            listen_sock.close()
            raise
        self._listen_sock = listen_sock
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._thread = threading.Thread(
            target=self._serve, name=f"kvcached-ipc-{self.address.label}", daemon=True
        )
        self._thread.start()

    def _clear_stale_socket(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise KVCachedConfigError(f"{str(self.path)!r} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(self.path)  # left by a listener that died: nobody accepts on it
            return
        finally:
            probe.close()
        raise KVCachedConfigError(f"another listener already serves {str(self.path)!r}")

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop accepting, let the call in progress finish and answer, join the thread, and only
        then remove the socket and its directory (and the stage's root) when they are empty.

        Returns False, keeping the socket and directories, when the thread does not finish within
        `timeout_s` (a map or unmap still running): call again later; the allocator must not be
        torn down before this returns True.
        """
        thread = self._thread
        if thread is None:
            return True
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")
        thread.join(timeout_s)
        if thread.is_alive():
            return False
        if not self._removed:
            self._remove_files()
            for fd in (self._wake_read, self._wake_write):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._removed = True
        return True

    def _remove_files(self) -> None:
        try:
            info = os.lstat(self.path)
            # Unlink only our own socket: a successor may already have bound a new one here.
            if (info.st_dev, info.st_ino) == self._socket_identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        for directory in reversed(self._dirs):
            with contextlib.suppress(OSError):  # not empty: other ranks still use it
                os.rmdir(directory)

    def __enter__(self) -> WorkerListener:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ serving

    def _serve(self) -> None:
        listen_sock = self._listen_sock
        assert listen_sock is not None
        selector = selectors.DefaultSelector()
        selector.register(listen_sock, selectors.EVENT_READ, None)
        selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        connections: list[_Connection] = []
        try:
            while not self._stopping.is_set():
                for key, _ in selector.select():
                    if self._stopping.is_set():
                        break
                    if key.data is None:
                        self._accept(listen_sock, selector, connections)
                    elif key.data != "wake":
                        self._read(key.data, selector, connections)
        finally:
            for connection in connections:
                with contextlib.suppress(Exception):
                    selector.unregister(connection.sock)
                connection.sock.close()
            selector.close()
            listen_sock.close()

    def _accept(
        self,
        listen_sock: socket.socket,
        selector: selectors.BaseSelector,
        connections: list[_Connection],
    ) -> None:
        try:
            sock, _ = listen_sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.settimeout(_SEND_TIMEOUT_S)  # reads happen only when select says data is there
        connection = _Connection(sock)
        connections.append(connection)
        selector.register(sock, selectors.EVENT_READ, connection)

    def _drop(
        self,
        connection: _Connection,
        selector: selectors.BaseSelector,
        connections: list[_Connection],
    ) -> None:
        with contextlib.suppress(Exception):
            selector.unregister(connection.sock)
        connection.sock.close()
        connections.remove(connection)

    def _read(
        self,
        connection: _Connection,
        selector: selectors.BaseSelector,
        connections: list[_Connection],
    ) -> None:
        try:
            data = connection.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return
        except OSError:
            self._drop(connection, selector, connections)
            return
        if not data:
            self._drop(connection, selector, connections)
            return
        try:
            payloads = connection.reader.feed(data)
        except ProtocolError as exc:
            # A bad length: the stream cannot be resynchronised. Say why, then hang up.
            self._send(connection, error_reply(None, ErrorKind.PROTOCOL, str(exc)))
            self._drop(connection, selector, connections)
            return
        for payload in payloads:
            if self._stopping.is_set():
                reply = error_reply(None, ErrorKind.STOPPING, "the listener is stopping")
            else:
                reply = self._server.answer(payload)
            if not self._send(connection, reply):
                self._drop(connection, selector, connections)
                return

    def _send(self, connection: _Connection, reply: Reply) -> bool:
        try:
            connection.sock.sendall(encode_reply(reply))
        except OSError:
            return False  # the coordinator went away; the call itself stands
        return True


# ---------------------------------------------------------------------------- over the engine's RPC

#: Ranks of this process served over the engine's RPC, by job name (normally one).
_in_process: dict[str, RankServer] = {}
_in_process_lock = threading.Lock()


def serve_in_process(job: str, server: RankServer) -> None:
    """Answer `job`'s broadcasts in this process with `server` (one rank per job and process)."""
    with _in_process_lock:
        if job in _in_process:
            raise KVCachedConfigError(f"this process already serves a rank of job {job!r}")
        _in_process[job] = server


def withdraw_in_process(job: str) -> None:
    with _in_process_lock:
        _in_process.pop(job, None)


def answer_broadcast(job: str, frames: dict[str, bytes]) -> dict[str, Any] | None:
    """This process's answer to one broadcast of `job` (see `RankServer.answer_addressed`);
    None when it serves no rank of `job`."""
    with _in_process_lock:
        server = _in_process.get(job)
    return None if server is None else server.answer_addressed(frames)
