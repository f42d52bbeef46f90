"""The wire format and the socket directory: nothing a peer sends can run code or stop a worker,
and nobody but the owner can reach the sockets."""

from __future__ import annotations

import ast
import os
import pickle
import socket
import struct
import time
from pathlib import Path

import pytest
from test_ipc_harness import LOGICAL_PAGE_BYTES, WorkerProcess, raw_call, socket_root, workers

import kvcached_core.ipc
from kvcached_core import native
from kvcached_core.errors import KVCachedConfigError
from kvcached_core.ipc.coordinator import BroadcastMapper
from kvcached_core.ipc.paths import (
    MAX_SOCKET_PATH_BYTES,
    check_private_dir,
    default_socket_root,
    ensure_private_dir,
    job_addresses,
    worker_address,
)
from kvcached_core.ipc.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameReader,
    ProtocolError,
    Reply,
    Request,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    recv_frame,
)
from kvcached_core.ipc.worker import WorkerListener


def _payload(frame: bytes) -> bytes:
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    return frame[4:]


def test_request_and_reply_round_trip() -> None:
    request = Request(7, "map", {"page_ids": [3, 4]})
    assert decode_request(_payload(encode_request(request))) == request
    reply = Reply(7, True, {"newly_mapped": [3]})
    assert decode_reply(_payload(encode_reply(reply))) == reply
    error = Reply(7, False, {}, "pool_exhausted", "no memory")
    assert decode_reply(_payload(encode_reply(error))) == error


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x80\x04K\x01.", "not valid UTF-8 JSON"),  # a pickle
        (b"[1, 2]", "must be a JSON object"),
        (b'{"v": 1, "cmd": "map"}', "no integer 'id'"),
        (b'{"v": 1, "id": true, "cmd": "map"}', "no integer 'id'"),
        (b'{"v": 99, "id": 1, "cmd": "map"}', "unsupported protocol version 99"),
        (b'{"id": 1, "cmd": "map"}', "unsupported protocol version None"),
        (b'{"v": 1, "id": 1, "cmd": 5}', "no string 'cmd'"),
        (b'{"v": 1, "id": 1, "cmd": "map", "args": [1]}', "'args' must be an object"),
        (b'{"v": 1, "id": NaN, "cmd": "map"}', "NaN is not valid"),
    ],
)
def test_malformed_requests_are_rejected_with_the_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode_request(payload)


def test_frame_reader_reassembles_split_frames_and_refuses_huge_lengths() -> None:
    frames = encode_request(Request(1, "hello")) + encode_request(Request(2, "state"))
    reader = FrameReader()
    payloads = [p for byte in range(len(frames)) for p in reader.feed(frames[byte : byte + 1])]
    assert [decode_request(p).request_id for p in payloads] == [1, 2]
    with pytest.raises(ProtocolError, match="exceeds"):
        FrameReader().feed(struct.pack(">I", MAX_FRAME_BYTES + 1))


def test_the_ipc_package_never_imports_an_executable_serialiser() -> None:
    package_dir = Path(kvcached_core.ipc.__file__).parent
    for source in package_dir.glob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in {"pickle", "marshal", "shelve", "dill"}, source


def _send_raw(sock: socket.socket, payload: bytes) -> Reply:
    sock.sendall(struct.pack(">I", len(payload)) + payload)
    return decode_reply(recv_frame(sock, time.monotonic() + 10))


def test_a_worker_answers_bad_frames_with_errors_and_keeps_serving() -> None:
    with workers(1) as (_, (worker,)):
        assert worker.call("map", page_ids=[2]).ok
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(worker.path))
            evil = pickle.dumps({"cmd": "unmap", "args": {"page_ids": [2]}})
            answers = [
                _send_raw(sock, evil),
                _send_raw(sock, b"{not json"),
                _send_raw(sock, b'{"v": 2, "id": 5, "cmd": "state"}'),
                _send_raw(sock, b'{"v": 1, "id": 6, "cmd": "format_disk"}'),
                _send_raw(sock, b'{"v": 1, "id": 7, "cmd": "unmap", "args": {"page_ids": "2"}}'),
                _send_raw(sock, b'{"v": 1, "id": 8, "cmd": "map", "args": {"page_ids": [-1]}}'),
                _send_raw(sock, b'{"v": 1, "id": 9, "cmd": "map", "args": {"page_ids": [true]}}'),
                _send_raw(sock, b'{"v": 1, "id": 10, "cmd": "prepare_unmap", "args": {}}'),
                _send_raw(sock, b'{"v": 1, "id": 11, "cmd": "map", "args": {"page_ids": [99]}}'),
            ]
            kinds = [(a.ok, a.error_kind) for a in answers]
            assert kinds == [
                (False, "protocol"),
                (False, "protocol"),
                (False, "protocol"),
                (False, "unknown_command"),
                (False, "protocol"),
                (False, "protocol"),
                (False, "protocol"),
                (False, "protocol"),
                (False, "config"),  # page id out of range, refused by the allocator
            ]
            assert answers[2].request_id == 5 and "version 2" in answers[2].message
            assert "format_disk" in answers[3].message
            # The same connection still works after all of that.
            good = _send_raw(sock, b'{"v": 1, "id": 12, "cmd": "state"}')
            assert good.ok and good.request_id == 12 and good.result["mapped"] == [2]

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(worker.path))
            sock.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
            answer = decode_reply(recv_frame(sock, time.monotonic() + 10))
            assert not answer.ok and answer.error_kind == "protocol"
            assert sock.recv(1) == b""  # the stream cannot be resynchronised: hung up

        state = worker.state()  # the worker is alive and its memory untouched
        assert state["mapped"] == [2]
        assert state["resident_bytes"] == LOGICAL_PAGE_BYTES
        assert worker.process is not None and worker.process.poll() is None


def test_socket_directories_are_private_and_checked(tmp_path: Path) -> None:
    created = tmp_path / "job"
    assert ensure_private_dir(created) is True
    assert (created.stat().st_mode & 0o777) == 0o700
    assert ensure_private_dir(created) is False  # reused as is

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    with pytest.raises(KVCachedConfigError, match="mode 0755"):
        ensure_private_dir(open_dir)

    link = tmp_path / "link"
    link.symlink_to(created)
    with pytest.raises(KVCachedConfigError, match="not a directory"):
        check_private_dir(link)

    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(foreign, 12345, 12345)
    else:
        foreign = Path("/")  # owned by root, not by this user
    with pytest.raises(KVCachedConfigError, match="belongs to uid"):
        check_private_dir(foreign)


def test_listener_and_coordinator_refuse_a_directory_others_can_open() -> None:
    with socket_root() as root:
        root.mkdir(mode=0o700)
        root.chmod(0o770)
        allocator = native.FTensorAllocator(native.host_backend(), 64 * 1024, False)
        allocator.create_kv_tensors(64 * 1024 * 4, 1, 2)
        listener = WorkerListener(allocator, worker_address(root, 0))
        with pytest.raises(KVCachedConfigError, match="must be 0700"):
            listener.start()
        assert not listener.path.exists()
        with pytest.raises(KVCachedConfigError, match="must be 0700"):
            BroadcastMapper.for_job(root, 1)


def test_socket_paths_follow_the_stage_layout_and_their_length_is_checked() -> None:
    addresses = job_addresses("/tmp/r", tp_size=2, pp_size=2)
    assert [str(a.path) for a in addresses] == [
        "/tmp/r/w0.sock",
        "/tmp/r/w1.sock",
        "/tmp/r/pp1/w0.sock",
        "/tmp/r/pp1/w1.sock",
    ]
    assert default_socket_root("engine a/b", "/tmp").name.startswith("kvcached-ipc-engine_a_b-")
    long_root = "/tmp/" + "x" * MAX_SOCKET_PATH_BYTES
    with pytest.raises(KVCachedConfigError, match="at most 107"):
        worker_address(long_root, 0)


def test_a_stale_socket_is_replaced_and_a_live_one_is_not_taken_over() -> None:
    with socket_root() as root:
        first = WorkerProcess(root, 0).start()
        try:
            second = WorkerProcess(root, 0)
            with pytest.raises(AssertionError, match="another listener already serves"):
                second.start()
            second.close()
            first.kill()  # leaves its socket file behind
            assert first.path.exists()
            third = WorkerProcess(root, 0).start()
            try:
                reply = raw_call(third.path, "hello", {})
                assert reply.ok and reply.result["pid"] == third.process.pid  # type: ignore[union-attr]
                assert reply.result["protocol"] == PROTOCOL_VERSION
            finally:
                third.close()
        finally:
            first.close()
