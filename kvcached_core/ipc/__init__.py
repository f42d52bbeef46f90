"""Coordinator-worker protocol: the scheduler process maps and unmaps KV pages on every worker.

`worker.RankServer` answers for one rank's FTensorAllocator, on a private Unix socket
(`worker.WorkerListener`) or in its own process for an engine's worker RPC
(`worker.answer_broadcast`); `coordinator.BroadcastMapper` is the PageMapper a scheduler-side
PageAllocator maps through, over a `coordinator.SocketCarrier` or `coordinator.RpcCarrier`.
"""

from kvcached_core.ipc.coordinator import (
    BroadcastMapper,
    RecoveryRefused,
    RecoveryReport,
    RpcCarrier,
    SocketCarrier,
    WorkerCallError,
    WorkerState,
    ipc_timeout_s,
)
from kvcached_core.ipc.paths import (
    RankId,
    WorkerAddress,
    default_socket_root,
    job_addresses,
    worker_address,
)
from kvcached_core.ipc.protocol import PROTOCOL_VERSION, ProtocolError
from kvcached_core.ipc.worker import RankServer, WorkerListener

__all__ = [
    "PROTOCOL_VERSION",
    "BroadcastMapper",
    "ProtocolError",
    "RankId",
    "RankServer",
    "RecoveryRefused",
    "RecoveryReport",
    "RpcCarrier",
    "SocketCarrier",
    "WorkerAddress",
    "WorkerCallError",
    "WorkerListener",
    "WorkerState",
    "default_socket_root",
    "ipc_timeout_s",
    "job_addresses",
    "worker_address",
]
