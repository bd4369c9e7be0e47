"""mrc: a multipath, RDMA-style reliable transport with SRv6 source routing.

ep = mrc.Endpoint(["127.0.0.1", "127.0.0.2"])
conn = ep.connect("127.0.0.3", port)
mr = ep.register(numpy_array)
conn.write(mr, remote_descriptor).wait()
"""

from __future__ import annotations

from mrc._datapath import (
    TAG_ANY,
    CompletionQueue,
    Connection,
    Endpoint,
    MemoryRegion,
    Operation,
    RemoteRegion,
)

# After the binding: the communicator builds on Endpoint and Connection.
from mrc.collectives.communicator import Communicator, get_unique_id  # noqa: E402
from mrc.errors import (
    BusyError,
    CollectiveError,
    ConnectionClosedError,
    KeyRejectedError,
    MrcError,
    NoBuffersError,
    PathDownError,
    ProtocolError,
    ReceiverNotReadyError,
    SystemCallError,
    TimeoutError,
    TruncatedError,
    UnreachableError,
    UsageError,
    WaitTimeout,
)

__version__ = "0.1.0"

__all__ = [
    "TAG_ANY",
    "BusyError",
    "CollectiveError",
    "Communicator",
    "CompletionQueue",
    "Connection",
    "ConnectionClosedError",
    "Endpoint",
    "KeyRejectedError",
    "MemoryRegion",
    "MrcError",
    "NoBuffersError",
    "Operation",
    "PathDownError",
    "ProtocolError",
    "ReceiverNotReadyError",
    "RemoteRegion",
    "SystemCallError",
    "TimeoutError",
    "TruncatedError",
    "UnreachableError",
    "UsageError",
    "WaitTimeout",
    "get_unique_id",
]
