"""The coordinator side: a PageMapper that maps and unmaps on every worker rank.

The scheduler process builds its `PageAllocator` over a `BroadcastMapper`; every page it maps
or unmaps is then mapped or unmapped on each (stage, rank) worker. A `Carrier` takes the
requests there: `SocketCarrier` through each rank's private Unix socket (workers on this host),
`RpcCarrier` through the engine's own worker RPC (workers the engine reaches on other hosts);
the rules below are the same over either.

- Map: sent to every rank at once. When some rank fails, the pages newly mapped on the ranks
  that succeeded are unmapped again; a rank that did not answer, or a rollback that cannot be
  confirmed, leaves the memory in an unknown state: StateConsistencyError.
- Unmap: two phases. PREPARE on every rank (each unmaps to the zero page and keeps its physical
  pages), then COMMIT (release) when all prepared, otherwise ABORT everywhere (restore). A commit
  that is not confirmed is retried, never aborted; an abort that is not confirmed is fatal.
- Every exchange has a deadline (`KVCACHED_IPC_TIMEOUT`, default 60 s) and every error names
  the rank and the command.
- `recover` lets a restarted coordinator finish the transactions it left in doubt and adopt the
  workers' mapped pages, or refuse with the reason.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

from kvcached_core import _C
from kvcached_core.errors import (
    KVCachedConfigError,
    MapQuarantinedError,
    PoolExhausted,
    StateConsistencyError,
)
from kvcached_core.ipc.paths import RankId, WorkerAddress, check_private_dir, job_addresses
from kvcached_core.ipc.protocol import (
    PROTOCOL_VERSION,
    Command,
    ErrorKind,
    ProtocolError,
    Reply,
    Request,
    decode_reply,
    encode_request,
    int_field,
    int_list_field,
    is_int,
    recv_frame,
    send_frame,
    whole_frame_payload,
)
from kvcached_core.settings import current_settings

TIMEOUT_ENV = "KVCACHED_IPC_TIMEOUT"
COMMITTED, ABORTED = "committed", "aborted"


def ipc_timeout_s() -> float:
    """Seconds one exchange with the workers may take (`KVCACHED_IPC_TIMEOUT`, default 60)."""
    return current_settings().ipc_timeout_s


class WorkerCallError(RuntimeError):
    """A worker refused or failed a call cleanly (its memory is as it was before the call)."""

    def __init__(self, address: RankId, command: str, kind: str, message: str) -> None:
        super().__init__(f"{address.label} {command}: {kind}: {message}")
        self.address = address
        self.command = command
        self.kind = kind


class RecoveryRefused(StateConsistencyError):
    """A restarted coordinator found the workers in a state it cannot take over."""


@dataclass(frozen=True)
class Outcome:
    """How one rank answered one exchange."""

    address: RankId
    command: str
    reply: Reply | None  # None: no reply
    delivered: bool  # False only when the request certainly never reached the rank
    failure: str = ""

    @property
    def ok(self) -> bool:
        return self.reply is not None and self.reply.ok

    @property
    def answered(self) -> bool:
        """The rank's state after the call is known: it replied, or never got the request."""
        return self.reply is not None or not self.delivered

    def describe(self) -> str:
        if self.reply is not None:
            if self.reply.ok:
                return f"{self.address.label} {self.command}: ok"
            return f"{self.address.label} {self.command}: {self.reply.error_kind}: " + (
                self.reply.message
            )
        return f"{self.address.label} {self.command}: {self.failure}"


@dataclass(frozen=True)
class WorkerState:
    """What one rank reports about its tensors."""

    address: RankId
    mapped: list[int]
    quarantined: list[int]
    pending_txn: int | None
    physical_free_pages: int
    resident_bytes: int | None
    highest_txn: int
    txn_history: dict[int, str]

    @classmethod
    def from_reply(cls, address: RankId, result: Mapping[str, Any]) -> WorkerState:
        history_raw = result.get("txn_history")
        if not isinstance(history_raw, list) or not all(
            isinstance(entry, list)
            and len(entry) == 2
            and is_int(entry[0])
            and entry[1] in (COMMITTED, ABORTED)
            for entry in history_raw
        ):
            raise ProtocolError("reply field 'txn_history' must be a list of [txn, outcome]")
        resident = result.get("resident_bytes")
        if resident is not None and not is_int(resident):
            raise ProtocolError("reply field 'resident_bytes' must be an integer or null")
        return cls(
            address=address,
            mapped=sorted(int_list_field(result, "mapped")),
            quarantined=sorted(int_list_field(result, "quarantined")),
            pending_txn=int_field(result, "pending_txn", optional=True),
            physical_free_pages=int(int_field(result, "physical_free_pages") or 0),
            resident_bytes=resident,
            highest_txn=int(int_field(result, "highest_txn") or 0),
            txn_history={int(txn): str(outcome) for txn, outcome in history_raw},
        )


@dataclass(frozen=True)
class RecoveryReport:
    """What `BroadcastMapper.recover` found and did."""

    resolved: dict[int, str] = field(default_factory=dict)  # in-doubt txn -> outcome applied
    adopted: list[int] = field(default_factory=list)  # mapped on every rank, left mapped
    released: list[int] = field(default_factory=list)  # mapped on every rank, unmapped here


class _NotDelivered(ConnectionError):
    """The request certainly did not reach the worker (no connection could be made)."""


class _Channel:
    """One persistent connection to one worker; dropped after any failure, so that a late
    reply to an abandoned request can never be read as the answer to a new one."""

    def __init__(self, address: WorkerAddress) -> None:
        self.address = address
        self._sock: socket.socket | None = None

    def send(self, frame: bytes, deadline: float) -> None:
        if self._sock is not None:
            try:
                send_frame(self._sock, frame, deadline)
                return
            except (BrokenPipeError, ConnectionResetError):
                # The worker closed this connection before the request was written (it
                # restarted, or dropped us): nothing was read, so send it on a fresh one.
                self.close()
        self._sock = self._connect(deadline)
        send_frame(self._sock, frame, deadline)

    def _connect(self, deadline: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(str(self.address.path))
        except OSError as exc:
            sock.close()
            raise _NotDelivered(f"cannot connect to {self.address.path}: {exc}") from None
        return sock

    def receive(self, request_id: int, deadline: float) -> Reply:
        assert self._sock is not None
        reply = decode_reply(recv_frame(self._sock, deadline))
        if reply.request_id != request_id:
            raise ProtocolError(f"reply to request {reply.request_id}, expected {request_id}")
        return reply

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


@dataclass(frozen=True)
class Delivery:
    """What became of one request: its reply, or the error that stands for it."""

    reply: Reply | None
    delivered: bool  # False only when the request certainly never reached the rank
    error: BaseException | None = None


class Carrier(Protocol):
    """Takes one exchange's requests to their ranks and brings the replies back."""

    @property
    def ranks(self) -> Sequence[RankId]: ...

    def exchange(
        self, requests: Sequence[tuple[RankId, int, bytes]], deadline: float
    ) -> list[Delivery]:
        """One Delivery per (rank, request id, frame), in order; never raises."""
        ...

    def close(self) -> None: ...


class SocketCarrier:
    """Each rank's private Unix socket (`worker.WorkerListener`), one connection per rank."""

    def __init__(self, addresses: Sequence[WorkerAddress]) -> None:
        for directory in sorted({address.path.parent for address in addresses}):
            check_private_dir(directory)  # never talk to a socket someone else could replace
        self._addresses = list(addresses)
        self._channels: dict[RankId, _Channel] = {a: _Channel(a) for a in addresses}

    @property
    def ranks(self) -> Sequence[RankId]:
        return self._addresses

    def exchange(
        self, requests: Sequence[tuple[RankId, int, bytes]], deadline: float
    ) -> list[Delivery]:
        """Send to every rank first, then collect the replies: the ranks work in parallel."""
        done: dict[int, Delivery] = {}
        waiting: list[tuple[int, _Channel, int]] = []
        for index, (rank, request_id, frame) in enumerate(requests):
            channel = self._channels[rank]
            try:
                channel.send(frame, deadline)
            except _NotDelivered as exc:
                done[index] = Delivery(None, False, exc)
                continue
            except (OSError, ProtocolError) as exc:
                channel.close()
                done[index] = Delivery(None, True, exc)
                continue
            waiting.append((index, channel, request_id))
        for index, channel, request_id in waiting:
            try:
                done[index] = Delivery(channel.receive(request_id, deadline), True)
            except (OSError, ProtocolError) as exc:
                channel.close()
                done[index] = Delivery(None, True, exc)
        return [done[index] for index in range(len(requests))]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


#: The engine's worker RPC: run `worker.answer_broadcast(<job>, frames)` in every worker
#: process within `timeout` seconds and return what each returned (any order).
Broadcast = Callable[[dict[str, bytes], float], Sequence[Any]]


class RpcCarrier:
    """The engine's own worker RPC: one broadcast carries every addressed rank's frame, and
    every worker process answers for the rank it serves (`worker.answer_broadcast`).

    A broadcast that fails or times out may have reached some workers, so every rank of it
    is in an unknown state; one that returns but in which no worker serves a rank certainly
    did not reach that rank.
    """

    def __init__(self, ranks: Sequence[RankId], broadcast: Broadcast) -> None:
        self._ranks = list(ranks)
        self._broadcast = broadcast

    @property
    def ranks(self) -> Sequence[RankId]:
        return self._ranks

    def exchange(
        self, requests: Sequence[tuple[RankId, int, bytes]], deadline: float
    ) -> list[Delivery]:
        frames = {rank.key: frame for rank, _, frame in requests}
        try:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError("deadline passed")
            answers = self._broadcast(frames, timeout)
            replies = _replies_by_rank(answers)
        except Exception as exc:  # the engine's RPC raises its own kinds (a dead actor, ...)
            return [Delivery(None, True, exc) for _ in requests]
        delivered: list[Delivery] = []
        for rank, request_id, _ in requests:
            frame = replies.get(rank.key)
            if frame is None:
                delivered.append(Delivery(None, False, _NotDelivered(
                    f"no worker process of the engine serves {rank.label}")))
                continue
            try:
                reply = decode_reply(whole_frame_payload(frame))
                if reply.request_id != request_id:
                    raise ProtocolError(
                        f"reply to request {reply.request_id}, expected {request_id}")
            except ProtocolError as exc:
                delivered.append(Delivery(None, True, exc))
                continue
            delivered.append(Delivery(reply, True))
        return delivered

    def close(self) -> None:
        return None


def _replies_by_rank(answers: Sequence[Any]) -> dict[str, bytes]:
    """`answer_broadcast`'s answers by rank key; a malformed or doubled answer is an error."""
    replies: dict[str, bytes] = {}
    for answer in answers:
        if answer is None:
            continue
        if not (isinstance(answer, dict) and is_int(answer.get("rank"))
                and is_int(answer.get("pp_rank")) and isinstance(answer.get("reply"), bytes)):
            raise ProtocolError(f"malformed answer to a broadcast: {answer!r:.200}")
        key = RankId(answer["rank"], answer["pp_rank"]).key
        if key in replies:
            raise ProtocolError(f"two worker processes answered for rank key {key}")
        replies[key] = answer["reply"]
    return replies


_SEVERITY = {
    ErrorKind.STATE_CONSISTENCY.value: 4,
    ErrorKind.MAP_QUARANTINED.value: 3,
    ErrorKind.POOL_EXHAUSTED.value: 1,
}


def _raise_clean_failure(failures: Sequence[Outcome], context: str) -> NoReturn:
    """Raise the error of the most severe clean failure (every failing rank answered)."""
    worst = max(failures, key=lambda o: _SEVERITY.get(o.reply.error_kind if o.reply else "", 2))
    detail = "; ".join(o.describe() for o in failures)
    message = f"{context}: {detail}"
    if worst.reply is None:  # never delivered
        raise WorkerCallError(
            worst.address, worst.command, "unreachable", f"{context}: " + worst.failure
        )
    kind = worst.reply.error_kind
    if kind == ErrorKind.STATE_CONSISTENCY:
        raise StateConsistencyError(message)
    if kind == ErrorKind.MAP_QUARANTINED:
        raise MapQuarantinedError(message)
    if kind == ErrorKind.POOL_EXHAUSTED:
        raise PoolExhausted(message)
    if kind == ErrorKind.CONFIG:
        raise KVCachedConfigError(message)
    raise WorkerCallError(worst.address, worst.command, kind, f"{context}: {worst.reply.message}")


def _ids(ids: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:16])
    return f"[{shown}{', ...' if len(ids) > 16 else ''}]"


class BroadcastMapper(_C.PageMapper):
    """A PageMapper whose pages live in the worker processes of every (stage, rank)."""

    def __init__(
        self,
        carrier: Carrier,
        *,
        timeout_s: float | None = None,
        commit_attempts: int = 3,
        retry_delay_s: float = 0.05,
    ) -> None:
        super().__init__()
        if not carrier.ranks:
            raise KVCachedConfigError("a BroadcastMapper needs at least one worker rank")
        if commit_attempts < 1:
            raise KVCachedConfigError(f"commit_attempts must be >= 1, got {commit_attempts}")
        self.ranks = list(carrier.ranks)
        self.timeout_s = ipc_timeout_s() if timeout_s is None else float(timeout_s)
        self.commit_attempts = commit_attempts
        self.retry_delay_s = retry_delay_s
        self._carrier = carrier
        self._request_ids = itertools.count(1)
        self._lock = threading.Lock()  # one broadcast at a time: every rank sees the same order
        self._pending: int | None = None
        self._next_txn = 1
        self._num_logical_pages = 0
        self._logical_page_bytes = 0
        self._tensors_created = False
        try:
            self._handshake()
        except BaseException:
            carrier.close()
            raise

    @classmethod
    def for_job(
        cls, root: str | os.PathLike[str], tp_size: int, pp_size: int = 1, **options: Any
    ) -> BroadcastMapper:
        """Over the sockets of a job's workers on this host."""
        return cls(SocketCarrier(job_addresses(Path(root), tp_size, pp_size)), **options)

    # ------------------------------------------------------------------ exchanges

    def _exchange(
        self,
        command: Command,
        args: Mapping[str, Any] | Callable[[RankId], Mapping[str, Any]],
        targets: Sequence[RankId] | None = None,
    ) -> list[Outcome]:
        """Send `command` to every target; the ranks work in parallel and the whole exchange
        shares one deadline."""
        targets = list(self.ranks if targets is None else targets)
        deadline = time.monotonic() + self.timeout_s
        requests = []
        for rank in targets:
            rank_args = args(rank) if callable(args) else args
            request_id = next(self._request_ids)
            frame = encode_request(Request(request_id, command.value, dict(rank_args)))
            requests.append((rank, request_id, frame))
        deliveries = self._carrier.exchange(requests, deadline)
        return [
            Outcome(rank, command.value, d.reply, d.delivered,
                    "" if d.error is None else self._failure_text(d.error))
            for rank, d in zip(targets, deliveries, strict=True)
        ]

    def _failure_text(self, exc: BaseException) -> str:
        if isinstance(exc, _NotDelivered):
            return str(exc)
        if isinstance(exc, TimeoutError):
            return f"no answer within {self.timeout_s:g} s ({TIMEOUT_ENV})"
        return f"connection failed: {exc}"

    def _call_all(self, command: Command, args: Mapping[str, Any]) -> list[Outcome]:
        """An exchange that must succeed on every rank; any failure raises, naming the rank."""
        outcomes = self._exchange(command, args)
        failures = [o for o in outcomes if not o.ok]
        if failures:
            unknown = [o for o in failures if not o.answered]
            if unknown:
                raise StateConsistencyError("; ".join(o.describe() for o in unknown))
            _raise_clean_failure(failures, f"{command.value} failed")
        return outcomes

    def _handshake(self) -> None:
        outcomes = self._call_all(Command.HELLO, {})
        pages: dict[RankId, int] = {}
        highest = 0
        for outcome in outcomes:
            assert outcome.reply is not None
            result = outcome.reply.result
            address = outcome.address
            if result.get("protocol") != PROTOCOL_VERSION:
                raise KVCachedConfigError(
                    f"{address.label} speaks protocol {result.get('protocol')!r}, "
                    f"this coordinator {PROTOCOL_VERSION}"
                )
            if (result.get("rank"), result.get("pp_rank")) != (address.rank, address.pp_rank):
                raise KVCachedConfigError(
                    f"the requests for {address.label} ({address.route}) are served by rank "
                    f"{result.get('rank')!r} (pp {result.get('pp_rank')!r})"
                )
            if result.get("tensors_created") is not True:
                raise KVCachedConfigError(f"{address.label} has not created its KV tensors yet")
            pages[address] = int(int_field(result, "num_logical_pages") or 0)
            self._logical_page_bytes += int(int_field(result, "logical_page_bytes") or 0)
            highest = max(highest, int(int_field(result, "highest_txn") or 0))
        if len(set(pages.values())) != 1:
            detail = ", ".join(f"{a.label}: {n}" for a, n in pages.items())
            raise KVCachedConfigError(f"the ranks disagree on the number of pages ({detail})")
        self._num_logical_pages = next(iter(pages.values()))
        self._tensors_created = True
        self._next_txn = highest + 1  # never reuse an id a worker remembers

    def _new_txn(self) -> int:
        txn = self._next_txn
        self._next_txn += 1
        return txn

    # ------------------------------------------------------------------ map

    def map_pages(self, page_ids: list[int]) -> list[int]:
        ids = [int(i) for i in page_ids]
        with self._lock:
            outcomes = self._exchange(Command.MAP, {"page_ids": ids})
            failures = [o for o in outcomes if not o.ok]
            newly: dict[RankId, list[int]] = {}
            for outcome in outcomes:
                if outcome.ok:
                    assert outcome.reply is not None
                    newly[outcome.address] = int_list_field(outcome.reply.result, "newly_mapped")
            if not failures:
                return sorted({i for mapped in newly.values() for i in mapped})
            unconfirmed = [o.describe() for o in failures if not o.answered]
            to_undo = [address for address, mapped in newly.items() if mapped]
            if to_undo:
                undone = self._exchange(
                    Command.UNMAP, lambda address: {"page_ids": newly[address]}, to_undo
                )
                unconfirmed += [f"rollback {o.describe()}" for o in undone if not o.ok]
            context = f"map of pages {_ids(ids)}"
            if unconfirmed:
                raise StateConsistencyError(
                    f"{context} failed and the state of the workers is unknown: "
                    + "; ".join(unconfirmed)
                )
            _raise_clean_failure(failures, f"{context} failed (rolled back on every rank)")

    def unmap_pages(self, page_ids: list[int]) -> None:
        ids = [int(i) for i in page_ids]
        with self._lock:
            self._unmap_locked(ids)

    def _unmap_locked(self, ids: list[int]) -> None:
        txn = self._new_txn()
        self._pending = txn
        try:
            prepared = self._exchange(Command.PREPARE_UNMAP, {"txn": txn, "page_ids": ids})
            failures = [o for o in prepared if not o.ok]
            if not failures:
                self._commit_locked(txn)
                return
            context = f"unmap transaction {txn} of pages {_ids(ids)}: prepare failed"
            unconfirmed = self._abort_locked(txn)
            if unconfirmed:
                raise StateConsistencyError(
                    f"{context} ({'; '.join(o.describe() for o in failures)}) and the abort "
                    f"could not be confirmed: {'; '.join(unconfirmed)}"
                )
            _raise_clean_failure(failures, f"{context}, aborted on every rank")
        finally:
            self._pending = None

    # ------------------------------------------------------------------ two-phase unmap

    def prepare_unmap(self, txn_id: int, page_ids: list[int]) -> None:
        """PREPARE on every rank; any failure aborts the transaction everywhere and raises."""
        ids = [int(i) for i in page_ids]
        with self._lock:
            self._next_txn = max(self._next_txn, txn_id + 1)
            prepared = self._exchange(Command.PREPARE_UNMAP, {"txn": txn_id, "page_ids": ids})
            failures = [o for o in prepared if not o.ok]
            if not failures:
                self._pending = txn_id
                return
            context = f"unmap transaction {txn_id}: prepare failed"
            unconfirmed = self._abort_locked(txn_id)
            if unconfirmed:
                raise StateConsistencyError(
                    f"{context} ({'; '.join(o.describe() for o in failures)}) and the abort "
                    f"could not be confirmed: {'; '.join(unconfirmed)}"
                )
            _raise_clean_failure(failures, f"{context}, aborted on every rank")

    def commit_unmap(self, txn_id: int) -> None:
        with self._lock:
            self._commit_locked(txn_id)
            if self._pending == txn_id:
                self._pending = None

    def abort_unmap(self, txn_id: int) -> None:
        with self._lock:
            self._next_txn = max(self._next_txn, txn_id + 1)
            unconfirmed = self._abort_locked(txn_id)
            if self._pending == txn_id:
                self._pending = None
            if unconfirmed:
                raise StateConsistencyError(
                    f"abort of unmap transaction {txn_id} could not be confirmed: "
                    + "; ".join(unconfirmed)
                )

    def _commit_locked(self, txn: int) -> None:
        """COMMIT on every rank. A rank that does not answer is asked again (a commit is never
        turned into an abort); a refusal, or silence after every attempt, is fatal."""
        remaining = list(self.ranks)
        silent: list[Outcome] = []
        for attempt in range(self.commit_attempts):
            if attempt:
                time.sleep(self.retry_delay_s * attempt)
            outcomes = self._exchange(Command.COMMIT_UNMAP, {"txn": txn}, remaining)
            refused = [o for o in outcomes if o.reply is not None and not o.reply.ok]
            if refused:
                raise StateConsistencyError(
                    f"commit of unmap transaction {txn} failed: "
                    + "; ".join(o.describe() for o in refused)
                )
            silent = [o for o in outcomes if o.reply is None]
            remaining = [o.address for o in silent]
            if not remaining:
                return
        raise StateConsistencyError(
            f"commit of unmap transaction {txn} could not be confirmed after "
            f"{self.commit_attempts} attempt(s): " + "; ".join(o.describe() for o in silent)
        )

    def _abort_locked(self, txn: int) -> list[str]:
        """ABORT on every rank (also those that never saw the prepare: they record the abort,
        so a late prepare is rejected). Returns what could not be confirmed."""
        remaining = list(self.ranks)
        unconfirmed: list[str] = []
        for attempt in range(self.commit_attempts):
            if attempt:
                time.sleep(self.retry_delay_s * attempt)
            outcomes = self._exchange(Command.ABORT_UNMAP, {"txn": txn}, remaining)
            refused = [o for o in outcomes if o.reply is not None and not o.reply.ok]
            silent = [o for o in outcomes if o.reply is None]
            unconfirmed = [o.describe() for o in refused + silent]
            remaining = [o.address for o in silent]
            if not remaining:
                break
        return unconfirmed

    # ------------------------------------------------------------------ queries

    def worker_states(self) -> list[WorkerState]:
        """Every rank's mapped, quarantined and pending state (raises if a rank is silent)."""
        with self._lock:
            return self._states_locked()

    def _states_locked(self) -> list[WorkerState]:
        outcomes = self._call_all(Command.STATE, {})
        states = []
        for outcome in outcomes:
            assert outcome.reply is not None
            try:
                states.append(WorkerState.from_reply(outcome.address, outcome.reply.result))
            except ProtocolError as exc:
                raise StateConsistencyError(f"{outcome.address.label} state: {exc}") from None
        return states

    def pending_txn(self) -> int | None:
        """The transaction in progress here, else one some rank still holds prepared (left in
        doubt by a previous coordinator: `recover` resolves it)."""
        if self._pending is not None:
            return self._pending
        with self._lock:
            pending = [s.pending_txn for s in self._states_locked() if s.pending_txn is not None]
        return min(pending) if pending else None

    def mapped_page_ids(self) -> list[int]:
        with self._lock:
            states = self._states_locked()
        reason = _divergence(states)
        if reason:
            raise StateConsistencyError(reason)
        return states[0].mapped

    def quarantined_page_ids(self) -> list[int]:
        with self._lock:
            states = self._states_locked()
        return sorted({i for state in states for i in state.quarantined})

    def num_logical_pages(self) -> int:
        return self._num_logical_pages

    def logical_page_bytes(self) -> int:
        return self._logical_page_bytes

    def tensors_created(self) -> bool:
        return self._tensors_created

    def physical_free_pages(self) -> int:
        with self._lock:
            return min(state.physical_free_pages for state in self._states_locked())

    # ------------------------------------------------------------------ restart

    def recover(self, *, adopt: bool = True) -> RecoveryReport:
        """Take over workers that a previous coordinator drove.

        An unmap transaction left in doubt is committed everywhere if some rank committed it
        (the previous coordinator had decided), and aborted everywhere otherwise. Then every
        rank must map the same pages and hold none quarantined; those pages are kept for the
        new PageAllocator (`adopt`, pass `adopt_mapped=True` to it) or unmapped everywhere.
        Anything else raises RecoveryRefused with the reason.
        """
        with self._lock:
            states = self._states_locked()
            self._next_txn = max([self._next_txn] + [s.highest_txn + 1 for s in states])
            resolved: dict[int, str] = {}
            in_doubt = sorted({s.pending_txn for s in states if s.pending_txn is not None})
            for txn in in_doubt:
                committed = [s for s in states if s.txn_history.get(txn) == COMMITTED]
                if committed:
                    try:
                        self._commit_locked(txn)
                    except StateConsistencyError as exc:
                        raise RecoveryRefused(
                            f"transaction {txn} was committed on {committed[0].address.label} "
                            f"but cannot be committed everywhere: {exc}"
                        ) from None
                    resolved[txn] = COMMITTED
                else:
                    unconfirmed = self._abort_locked(txn)
                    if unconfirmed:
                        raise RecoveryRefused(
                            f"transaction {txn} in doubt could not be aborted everywhere: "
                            + "; ".join(unconfirmed)
                        )
                    resolved[txn] = ABORTED
            states = self._states_locked() if in_doubt else states
            quarantined = [s for s in states if s.quarantined]
            if quarantined:
                raise RecoveryRefused(
                    "; ".join(
                        f"{s.address.label} holds quarantined pages {_ids(s.quarantined)}"
                        for s in quarantined
                    )
                    + ": their memory state is unknown"
                )
            reason = _divergence(states)
            if reason:
                raise RecoveryRefused(reason)
            mapped = states[0].mapped
            if adopt or not mapped:
                return RecoveryReport(resolved, adopted=mapped)
            self._unmap_locked(mapped)
            return RecoveryReport(resolved, released=mapped)

    def close(self) -> None:
        with self._lock:
            self._carrier.close()


def _divergence(states: Sequence[WorkerState]) -> str:
    """Why the ranks' mapped pages differ, or "" when they agree."""
    reference = states[0]
    expected = set(reference.mapped)
    for state in states[1:]:
        mapped = set(state.mapped)
        if mapped == expected:
            continue
        extra = sorted(mapped - expected)
        missing = sorted(expected - mapped)
        parts = []
        if extra:
            parts.append(f"maps pages {_ids(extra)} that {reference.address.label} does not")
        if missing:
            parts.append(f"lacks pages {_ids(missing)} that {reference.address.label} maps")
        return f"the ranks disagree on the mapped pages: {state.address.label} " + (
            " and ".join(parts)
        )
    return ""
