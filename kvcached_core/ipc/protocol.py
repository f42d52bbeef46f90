"""Wire format between the coordinator and its workers: length-prefixed JSON, nothing executable.

A frame is a 4-byte big-endian payload length followed by that many bytes of UTF-8 JSON. Every
message is an object with the protocol version `v` and a request id `id`:

    request  {"v": 1, "id": 7, "cmd": "map", "args": {"page_ids": [3, 4]}}
    reply    {"v": 1, "id": 7, "ok": true, "result": {"newly_mapped": [3, 4]}}
    error    {"v": 1, "id": 7, "ok": false, "error": {"kind": "pool_exhausted", "message": "..."}}

Only JSON objects, lists, strings, integers and booleans travel; decoding never builds anything
but those, so a peer cannot make the other side run code. Every field is validated here, once.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeGuard

from kvcached_core.errors import KVCachedError

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class Command(StrEnum):
    HELLO = "hello"
    STATE = "state"
    MAP = "map"
    UNMAP = "unmap"
    PREPARE_UNMAP = "prepare_unmap"
    COMMIT_UNMAP = "commit_unmap"
    ABORT_UNMAP = "abort_unmap"


class ErrorKind(StrEnum):
    POOL_EXHAUSTED = "pool_exhausted"  # recoverable: nothing changed on the worker
    MAP_QUARANTINED = "map_quarantined"  # rollback uncertain: pages quarantined on the worker
    STATE_CONSISTENCY = "state_consistency"  # the worker refused or its memory state is unknown
    CONFIG = "config"
    OPERATION_FAILED = "operation_failed"  # a driver call failed and was rolled back
    PROTOCOL = "protocol"  # malformed frame, message or arguments
    UNKNOWN_COMMAND = "unknown_command"
    STOPPING = "stopping"  # the listener is shutting down and did not run the request


class ProtocolError(KVCachedError):
    """A frame or message that does not follow this protocol."""

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    request_id: int
    command: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    request_id: int | None
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error_kind: str = ""
    message: str = ""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid in this protocol")


def _loads(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"payload is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(message).__name__}")
    return message


def _dumps(message: Mapping[str, Any]) -> bytes:
    payload = json.dumps(message, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload)) + payload


def is_int(value: Any) -> TypeGuard[int]:
    """A JSON integer in int64 range (bool is not an integer here)."""
    return type(value) is int and _INT64_MIN <= value <= _INT64_MAX


def _request_id_of(message: dict[str, Any]) -> int | None:
    value = message.get("id")
    return value if is_int(value) else None


def _check_version(message: dict[str, Any], request_id: int | None) -> None:
    version = message.get("v")
    if version != PROTOCOL_VERSION or not is_int(version):
        raise ProtocolError(
            f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})",
            request_id,
        )


def encode_request(request: Request) -> bytes:
    return _dumps(
        {
            "v": PROTOCOL_VERSION,
            "id": request.request_id,
            "cmd": request.command,
            "args": request.args,
        }
    )


def decode_request(payload: bytes) -> Request:
    message = _loads(payload)
    request_id = _request_id_of(message)
    if request_id is None:
        raise ProtocolError("request has no integer 'id'")
    _check_version(message, request_id)
    command = message.get("cmd")
    if not isinstance(command, str):
        raise ProtocolError("request has no string 'cmd'", request_id)
    args = message.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError("request 'args' must be an object", request_id)
    return Request(request_id, command, args)


def encode_reply(reply: Reply) -> bytes:
    message: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": reply.request_id, "ok": reply.ok}
    if reply.ok:
        message["result"] = reply.result
    else:
        message["error"] = {"kind": reply.error_kind, "message": reply.message}
    return _dumps(message)


def decode_reply(payload: bytes) -> Reply:
    message = _loads(payload)
    request_id = _request_id_of(message)
    _check_version(message, request_id)
    ok = message.get("ok")
    if not isinstance(ok, bool):
        raise ProtocolError("reply has no boolean 'ok'", request_id)
    if ok:
        result = message.get("result", {})
        if not isinstance(result, dict):
            raise ProtocolError("reply 'result' must be an object", request_id)
        return Reply(request_id, True, result)
    error = message.get("error")
    if not (
        isinstance(error, dict)
        and isinstance(error.get("kind"), str)
        and isinstance(error.get("message"), str)
    ):
        raise ProtocolError("error reply needs 'error': {'kind': str, 'message': str}", request_id)
    return Reply(request_id, False, {}, error["kind"], error["message"])


def error_reply(request_id: int | None, kind: ErrorKind, message: str) -> Reply:
    return Reply(request_id, False, {}, kind.value, message)


# ---------------------------------------------------------------------------- argument checks


def page_ids_arg(args: Mapping[str, Any], name: str = "page_ids") -> list[int]:
    value = args.get(name)
    if not isinstance(value, list) or not all(is_int(item) and item >= 0 for item in value):
        raise ProtocolError(f"argument {name!r} must be a list of non-negative integers")
    return list(value)


def int_arg(args: Mapping[str, Any], name: str) -> int:
    value = args.get(name)
    if not is_int(value):
        raise ProtocolError(f"argument {name!r} must be an integer")
    return int(value)


def int_list_field(result: Mapping[str, Any], name: str) -> list[int]:
    value = result.get(name)
    if not isinstance(value, list) or not all(is_int(item) for item in value):
        raise ProtocolError(f"reply field {name!r} must be a list of integers")
    return list(value)


def int_field(result: Mapping[str, Any], name: str, *, optional: bool = False) -> int | None:
    value = result.get(name)
    if value is None and optional:
        return None
    if not is_int(value):
        raise ProtocolError(f"reply field {name!r} must be an integer")
    return int(value)


# ---------------------------------------------------------------------------- framing


class FrameReader:
    """Splits a byte stream into frame payloads (for the listener's non-blocking sockets)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Payloads completed by `data`. ProtocolError when a length is out of bounds: the
        stream cannot be resynchronised after that and must be closed."""
        self._buffer += data
        payloads: list[bytes] = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            payloads.append(bytes(self._buffer[_HEADER.size : end]))
            del self._buffer[:end]
        return payloads


def whole_frame_payload(frame: bytes) -> bytes:
    """The payload of exactly one frame handed over in one piece (the engine's RPC carries
    whole frames, not a stream)."""
    if len(frame) < _HEADER.size:
        raise ProtocolError(f"a frame of {len(frame)} bytes has no length header")
    (length,) = _HEADER.unpack_from(frame)
    if length > MAX_FRAME_BYTES or len(frame) != _HEADER.size + length:
        raise ProtocolError(
            f"a frame announcing {length} bytes carries {len(frame) - _HEADER.size}"
        )
    return frame[_HEADER.size :]


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def send_frame(sock: socket.socket, frame: bytes, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
    sock.sendall(frame)


def _recv_exactly(sock: socket.socket, count: int, deadline: float) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        sock.settimeout(_remaining(deadline))
        chunk = sock.recv(count - len(chunks))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket, deadline: float) -> bytes:
    """One frame's payload; TimeoutError past `deadline`, ConnectionError on end of stream."""
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size, deadline))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return _recv_exactly(sock, length, deadline)
