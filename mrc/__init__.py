"""mrc: a multipath, RDMA-style reliable transport with SRv6 source routing.

ep = mrc.Endpoint(["127.0.0.1", "127.0.0.2"])
conn = ep.connect("127.0.0.3", port)
mr = ep.register(numpy_array)
conn.write(mr, remote_descriptor).wait()
"""

from __future__ import annotations

from mrc._datapath import (
    TAG_ANY,
    Connection,
    Endpoint,
    MemoryRegion,
    Operation,
    RemoteRegion,
)
from mrc.errors import (
    BusyError,
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
]
