# Typed contract of the Cython binding (mrc/_datapath.pyx).
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Protocol, overload

import numpy as np
import numpy.typing as npt

from mrc import errors
from mrc.telemetry import StatsServer

TAG_ANY: int

class PathLike(Protocol):
    id: int
    plane: int
    dst_addr: str
    segments: Sequence[str]

def strerror(rc: int) -> str: ...
def error_for(rc: int, what: str) -> errors.MrcError: ...
def hostport(addr: str, port: int) -> str: ...

class RemoteRegion:
    key: int
    size: int
    def __init__(self, key: int, size: int) -> None: ...
    def pack(self) -> bytes: ...
    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> RemoteRegion: ...

class Endpoint:
    planes: tuple[tuple[str, int], ...]
    mss: int
    timeout: float
    def __init__(
        self,
        planes: str | Iterable[str] = ...,
        *,
        port: int = ...,
        mss: int = ...,
        timeout: float = ...,
        window: int = ...,
        sockbuf: int = ...,
        max_unexpected: int = ...,
        rnr_timeout: float | None = ...,
    ) -> None: ...
    def listen(self, port: int = ..., addr: str | None = ...) -> int: ...
    def connect(
        self,
        addr: str | Sequence[str],
        port: int,
        *,
        timeout: float | None = ...,
        paths: Sequence[PathLike] | None = ...,
        name: str = ...,
    ) -> Connection: ...
    def accept(
        self,
        *,
        timeout: float | None = ...,
        paths: Sequence[PathLike] | Callable[[str], Sequence[PathLike]] | None = ...,
        name: str = ...,
    ) -> Connection: ...
    def register(self, obj: Any, *, remote_write: bool = ...) -> MemoryRegion: ...
    def register_address(
        self,
        address: int,
        length: int,
        owner: object,
        *,
        remote_write: bool = ...,
        readonly: bool = ...,
    ) -> MemoryRegion: ...
    def create_cq(self) -> CompletionQueue: ...
    def inject(self, plane: int, loss: float = ..., down: bool = ...) -> None: ...
    def progress_cpu_ns(self) -> int: ...
    def srh_offload(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def serve_stats(self, path: str) -> StatsServer: ...
    def _rx_inject(self, plane: int, pkt: bytes, src_addr: str, src_port: int) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> Endpoint: ...
    def __exit__(self, *exc: object) -> None: ...

class MemoryRegion:
    endpoint: Endpoint
    obj: Any
    size: int
    readonly: bool
    @property
    def key(self) -> int: ...
    def descriptor(self) -> RemoteRegion: ...
    def close(self) -> None: ...
    def __enter__(self) -> MemoryRegion: ...
    def __exit__(self, *exc: object) -> None: ...
    def __len__(self) -> int: ...

class Connection:
    endpoint: Endpoint
    @overload
    def write(
        self,
        local: MemoryRegion,
        remote: RemoteRegion,
        *,
        offset: int = ...,
        length: int | None = ...,
        remote_offset: int = ...,
        imm: int | None = ...,
        cq: None = ...,
        ctx: int = ...,
    ) -> Operation: ...
    @overload
    def write(
        self,
        local: MemoryRegion,
        remote: RemoteRegion,
        *,
        offset: int = ...,
        length: int | None = ...,
        remote_offset: int = ...,
        imm: int | None = ...,
        cq: CompletionQueue,
        ctx: int = ...,
    ) -> None: ...
    @overload
    def send(
        self,
        local: MemoryRegion,
        *,
        offset: int = ...,
        length: int | None = ...,
        tag: int = ...,
        cq: None = ...,
        ctx: int = ...,
    ) -> Operation: ...
    @overload
    def send(
        self,
        local: MemoryRegion,
        *,
        offset: int = ...,
        length: int | None = ...,
        tag: int = ...,
        cq: CompletionQueue,
        ctx: int = ...,
    ) -> None: ...
    @overload
    def recv(
        self,
        local: MemoryRegion,
        *,
        offset: int = ...,
        length: int | None = ...,
        tag: int | None = ...,
        cq: None = ...,
        ctx: int = ...,
    ) -> Operation: ...
    @overload
    def recv(
        self,
        local: MemoryRegion,
        *,
        offset: int = ...,
        length: int | None = ...,
        tag: int | None = ...,
        cq: CompletionQueue,
        ctx: int = ...,
    ) -> None: ...
    def set_cq(self, cq: CompletionQueue | None, ctx: int = ...) -> None: ...
    @property
    def handle(self) -> int: ...
    def wait_imm(self, timeout: float | None = ...) -> tuple[int, int]: ...
    @property
    def ids(self) -> tuple[int, int]: ...
    @property
    def peer_name(self) -> str: ...
    @property
    def npaths(self) -> int: ...
    @property
    def peer_planes(self) -> list[str]: ...
    @property
    def error(self) -> errors.MrcError | None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> Connection: ...
    def __exit__(self, *exc: object) -> None: ...

class Operation:
    connection: Connection
    region: MemoryRegion
    length: int
    def wait(self, timeout: float | None = ...) -> Operation: ...
    @property
    def done(self) -> bool: ...
    @property
    def kind(self) -> str: ...
    @property
    def status(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def tag(self) -> int: ...

class CompletionQueue:
    """Rows of poll()/wait(): fields ctx (u8), status (i4), kind (i4: WRITE, SEND,
    RECV, IMM), bytes (u8), tag (u8), imm (u4), conn (u8: Connection.handle)."""

    WRITE: ClassVar[int]
    SEND: ClassVar[int]
    RECV: ClassVar[int]
    IMM: ClassVar[int]
    endpoint: Endpoint
    def __init__(self, endpoint: Endpoint) -> None: ...
    @property
    def dtype(self) -> np.dtype[np.void]: ...
    def poll(self, max: int = ...) -> npt.NDArray[np.void]: ...
    def wait(self, timeout: float | None = ..., max: int = ...) -> npt.NDArray[np.void]: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> CompletionQueue: ...
    def __exit__(self, *exc: object) -> None: ...

# ---- collectives: the schedule executor (src_c/coll.c) ----
COLL_STEP_SIZE: int
COLL_REF_SIZE: int
ABORTED: int
MISMATCH: int
GONE: int
STALLED: int
ETIMEOUT: int
EPATHDOWN: int
ERNR: int

def reduce_into(acc: Any, src: Any, dtype: int, op: int) -> None: ...
def reduce_finish(acc: Any, dtype: int, op: int, n: int) -> None: ...

class CollExecutor:
    endpoint: Endpoint
    nranks: int
    def __init__(
        self,
        endpoint: Endpoint,
        rank: int,
        nranks: int,
        peers: Sequence[Connection | None],
        *,
        chunk_bytes: int = ...,
        slots: int = ...,
        window: int = ...,
        busy_poll_us: int = ...,
    ) -> None: ...
    def run(
        self,
        packed: Any,
        send: Any,
        recv: Any,
        dtype: int,
        op: int,
        sig: int,
        timeout: float | None,
    ) -> tuple[int, int]: ...
    def abort(self) -> None: ...
    def peer_gone(self, peer: int, runs: int) -> None: ...
    @property
    def final_runs(self) -> list[int]: ...
    @property
    def scratch_bytes(self) -> int: ...
    def close(self) -> None: ...
