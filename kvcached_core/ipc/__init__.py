"""Coordinator-worker protocol: the scheduler process maps and unmaps KV pages on every worker.

`worker.WorkerListener` serves one rank's FTensorAllocator on a private Unix socket;
`coordinator.BroadcastMapper` is the PageMapper a scheduler-side PageAllocator maps through.
"""

from kvcached_core.ipc.coordinator import (
    BroadcastMapper,
    RecoveryRefused,
    RecoveryReport,
    WorkerCallError,
    WorkerState,
    ipc_timeout_s,
)
from kvcached_core.ipc.paths import (
    WorkerAddress,
    default_socket_root,
    job_addresses,
    worker_address,
)
from kvcached_core.ipc.protocol import PROTOCOL_VERSION, ProtocolError
from kvcached_core.ipc.worker import WorkerListener

__all__ = [
    "PROTOCOL_VERSION",
    "BroadcastMapper",
    "ProtocolError",
    "RecoveryRefused",
    "RecoveryReport",
    "WorkerAddress",
    "WorkerCallError",
    "WorkerListener",
    "WorkerState",
    "default_socket_root",
    "ipc_timeout_s",
    "job_addresses",
    "worker_address",
]
