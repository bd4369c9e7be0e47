"""GPU buffers: which memory a buffer lives in, and the pinned-host staging
pipeline that carries device buffers through mrc's host-memory datapath.

The UDP datapath places packets with the CPU, so it cannot write into device
memory. A collective on a device buffer is run in segments through pinned host
memory: the device-to-host copy of segment k+1 runs on a copy stream while the
host collective of segment k runs in the C executor, and the host-to-device
copy of segment k runs on another stream while later segments arrive. The
reduction itself is the host path's (src_c/reduce.c, fixed rank order), so a
device buffer gives the same bits as the same data in host memory.

Two CUDA bindings, both optional (mrc imports and works without either):
- torch tensors use torch's own streams and events, so the caller's current
  stream semantics are torch's (the collective waits for the work queued on
  the tensor's current stream before reading it, and the current stream waits
  for the result, as with the NCCL backend);
- every other device array (CuPy, anything with ``__cuda_array_interface__``
  or a CUDA DLPack device) uses CuPy (``pip install mrc[cuda]``).

GPUDirect RDMA (the NIC reading and writing device memory) needs a verbs
provider; with one, a device buffer would be registered once as a dmabuf
region (ibv_reg_dmabuf_mr) and no staging would happen. `memory_of()` is the
registration-side knowledge that path needs: memory kind and device id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mrc.errors import UsageError

HOST = "host"
CUDA = "cuda"
CUDA_HOST = "cuda_host"  # pinned (page-locked) host memory

# DLPack device types (dlpack.h): kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged
_DLPACK_KINDS = {1: HOST, 2: CUDA, 3: CUDA_HOST, 13: CUDA}

SEGMENT_BYTES = 4 << 20  # one pipeline stage
DEPTH = 3  # pinned segments in flight per direction


@dataclass(frozen=True)
class Memory:
    """Where a buffer lives: kind (host, cuda, cuda_host) and CUDA device id."""

    kind: str
    device: int = -1


_HOST_MEMORY = Memory(HOST)
_HOST_TYPES = frozenset({np.ndarray, bytearray, bytes, memoryview})


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch")


def memory_of(obj: Any) -> Memory:
    """The memory kind of a buffer: torch tensors, ``__cuda_array_interface__``,
    ``__dlpack_device__``, else host memory (the buffer protocol)."""
    if type(obj) in _HOST_TYPES:
        return _HOST_MEMORY  # the common case, asked on every collective call
    if _is_torch(obj) and hasattr(obj, "device"):
        dev = obj.device
        if dev.type == "cuda":
            return Memory(CUDA, dev.index if dev.index is not None else 0)
        if dev.type != "cpu":
            raise UsageError(f"tensors on {dev} are not supported (cpu and cuda are)")
        return Memory(CUDA_HOST if obj.is_pinned() else HOST)
    if hasattr(obj, "__cuda_array_interface__"):
        return Memory(CUDA, _cai_device(obj))
    dl = getattr(obj, "__dlpack_device__", None)
    if dl is not None and not isinstance(obj, np.ndarray):
        kind, dev = dl()
        mem = _DLPACK_KINDS.get(int(kind))
        if mem is None:
            raise UsageError(f"DLPack device type {int(kind)} is not supported")
        return Memory(mem, int(dev) if mem != HOST else -1)
    return Memory(HOST)


def _cai_device(obj: Any) -> int:
    """The device of a __cuda_array_interface__ pointer (0 if CuPy cannot say)."""
    try:
        import cupy
    except ImportError:
        return 0
    ptr = obj.__cuda_array_interface__["data"][0]
    if not ptr:
        return 0
    return int(cupy.cuda.runtime.pointerGetAttributes(ptr).device)


_HOST_TYPES = (np.ndarray, bytes, bytearray, memoryview)


def is_device(*objs: Any) -> bool:
    """True if any of the buffers is in device memory (numpy arrays and Python
    buffers never are: answered without asking, on every collective's path)."""
    for o in objs:
        if o is not None and type(o) not in _HOST_TYPES and memory_of(o).kind == CUDA:
            return True
    return False


def segments(nbytes: int, esize: int, seg_bytes: int = SEGMENT_BYTES) -> Iterator[tuple[int, int]]:
    """(offset, length) in bytes of each pipeline segment, element-aligned."""
    step = max(esize, seg_bytes - seg_bytes % esize)
    for off in range(0, nbytes, step):
        yield off, min(step, nbytes - off)


# ---- copy engines ---------------------------------------------------------------


class Copier:
    """What the pipeline needs from a CUDA binding: pinned host buffers, two copy
    streams, events. Byte views: `dev` objects are flat uint8 device views."""

    def pinned(self, nbytes: int) -> np.ndarray:
        raise NotImplementedError

    def flat(self, obj: Any) -> Any:
        """A flat uint8 view of a device buffer."""
        raise NotImplementedError

    def d2h(self, host: np.ndarray, dev: Any, off: int, n: int) -> Any:
        """Queue dev[off:off+n] -> host[:n] on the device-to-host stream; an event."""
        raise NotImplementedError

    def h2d(self, dev: Any, off: int, host: np.ndarray, n: int) -> Any:
        """Queue host[:n] -> dev[off:off+n] on the host-to-device stream; an event."""
        raise NotImplementedError

    def sync(self, event: Any) -> None:
        raise NotImplementedError

    def mark(self) -> Any:
        """In the caller's thread: an event after the work queued so far on the
        caller's current stream (what wrote the buffer)."""
        return None

    def after(self, mark: Any) -> None:
        """The copy streams wait for mark before their next copy."""

    def finish(self, event: Any) -> None:
        """In the caller's thread: its current stream waits for event (the last copy)."""
        self.sync(event)


class TorchCopier(Copier):
    """torch tensors: torch's streams and events, the caller's current stream."""

    def __init__(self, device: int) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self.h2d_stream = torch.cuda.Stream(self.device)

    def pinned(self, nbytes: int) -> np.ndarray:
        # The array's base is the tensor: the pinned memory lives as long as it.
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True).numpy()

    def flat(self, obj: Any) -> Any:
        return obj.detach().reshape(-1).view(self.torch.uint8)

    def _host(self, host: np.ndarray, n: int) -> Any:
        return self.torch.from_numpy(host[:n])

    def d2h(self, host: np.ndarray, dev: Any, off: int, n: int) -> Any:
        with self.torch.cuda.stream(self.d2h_stream):
            self._host(host, n).copy_(dev[off : off + n], non_blocking=True)
            ev = self.torch.cuda.Event()
            ev.record(self.d2h_stream)
        return ev

    def h2d(self, dev: Any, off: int, host: np.ndarray, n: int) -> Any:
        with self.torch.cuda.stream(self.h2d_stream):
            dev[off : off + n].copy_(self._host(host, n), non_blocking=True)
            ev = self.torch.cuda.Event()
            ev.record(self.h2d_stream)
        return ev

    def sync(self, event: Any) -> None:
        event.synchronize()

    def mark(self) -> Any:
        ev = self.torch.cuda.Event()
        ev.record(self.torch.cuda.current_stream(self.device))
        return ev

    def after(self, mark: Any) -> None:
        self.d2h_stream.wait_event(mark)
        self.h2d_stream.wait_event(mark)

    def finish(self, event: Any) -> None:
        # The caller's stream waits on the device; the host need not.
        self.torch.cuda.current_stream(self.device).wait_event(event)


class CupyCopier(Copier):
    """__cuda_array_interface__ / DLPack device arrays: CuPy's runtime API."""

    def __init__(self, device: int) -> None:
        try:
            import cupy
        except ImportError:
            raise UsageError(
                "a CUDA array was given but CuPy is not installed (pip install mrc[cuda])"
            ) from None
        self.cp = cupy
        self.device = device
        with cupy.cuda.Device(device):
            self.d2h_stream = cupy.cuda.Stream(non_blocking=True)
            self.h2d_stream = cupy.cuda.Stream(non_blocking=True)

    def pinned(self, nbytes: int) -> np.ndarray:
        # frombuffer keeps the pinned allocation alive as the array's base.
        return np.frombuffer(self.cp.cuda.alloc_pinned_memory(max(nbytes, 1)), np.uint8, nbytes)

    def flat(self, obj: Any) -> Any:
        return self.cp.asarray(obj).reshape(-1).view(self.cp.uint8)

    def _copy(self, dst: int, src: int, n: int, kind: int, stream: Any) -> Any:
        self.cp.cuda.runtime.memcpyAsync(dst, src, n, kind, stream.ptr)
        ev = self.cp.cuda.Event()
        ev.record(stream)
        return ev

    def d2h(self, host: np.ndarray, dev: Any, off: int, n: int) -> Any:
        rt = self.cp.cuda.runtime
        return self._copy(host.ctypes.data, dev.data.ptr + off, n, rt.memcpyDeviceToHost,
                          self.d2h_stream)  # fmt: skip

    def h2d(self, dev: Any, off: int, host: np.ndarray, n: int) -> Any:
        rt = self.cp.cuda.runtime
        return self._copy(dev.data.ptr + off, host.ctypes.data, n, rt.memcpyHostToDevice,
                          self.h2d_stream)  # fmt: skip

    def sync(self, event: Any) -> None:
        event.synchronize()

    def mark(self) -> Any:
        # A CUDA array carries no stream of its own: CuPy's current stream (the
        # legacy default stream unless the caller chose one) is the one that wrote it.
        ev = self.cp.cuda.Event()
        ev.record(self.cp.cuda.get_current_stream())
        return ev

    def after(self, mark: Any) -> None:
        self.d2h_stream.wait_event(mark)
        self.h2d_stream.wait_event(mark)

    def finish(self, event: Any) -> None:
        self.cp.cuda.get_current_stream().wait_event(event)


class HostCopier(Copier):
    """Host-to-host copies with the same interface: runs the pipeline's
    segmenting and slot reuse where no GPU is (tests, and a pinned-host path)."""

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def flat(self, obj: Any) -> Any:
        return np.asarray(memoryview(obj)).reshape(-1).view(np.uint8)

    def d2h(self, host: np.ndarray, dev: Any, off: int, n: int) -> Any:
        host[:n] = dev[off : off + n]
        return None

    def h2d(self, dev: Any, off: int, host: np.ndarray, n: int) -> Any:
        dev[off : off + n] = host[:n]
        return None

    def sync(self, event: Any) -> None:
        return None


def copier_for(obj: Any) -> Copier:
    mem = memory_of(obj)
    if mem.kind != CUDA:
        return HostCopier()
    return TorchCopier(mem.device) if _is_torch(obj) else CupyCopier(mem.device)


# ---- the pipeline -----------------------------------------------------------------


@dataclass
class _Engine:
    copier: Copier
    slots: list[np.ndarray]  # pinned segments, reused across calls
    up: list[Any]
    # up[slot]: the last host-to-device copy out of that slot, which must be
    # over before the slot is filled again (in this call or the next)


class Stager:
    """Pinned host segments reused across calls (one per communicator)."""

    def __init__(self, seg_bytes: int = SEGMENT_BYTES, depth: int = DEPTH) -> None:
        self.seg_bytes = seg_bytes
        self.depth = depth
        self._engines: dict[tuple[str, int, str], _Engine] = {}

    def _engine(self, obj: Any) -> _Engine:
        mem = memory_of(obj)
        key = (mem.kind, mem.device, "torch" if _is_torch(obj) else "other")
        eng = self._engines.get(key)
        if eng is None:
            cp = copier_for(obj)
            eng = _Engine(cp, [cp.pinned(self.seg_bytes) for _ in range(self.depth)],
                          [None] * self.depth)  # fmt: skip
            self._engines[key] = eng
        return eng

    def elementwise(
        self, send: Any, recv: Any, nbytes: int, esize: int,
        run: Callable[[np.ndarray, np.ndarray], None], write_back: bool = True,
    ) -> Any:  # fmt: skip
        """Runs `run(host_in, host_out)` (a host collective on one segment, in
        place when the arrays are the same) over every segment of send -> recv,
        pipelined: segment k+1's device-to-host copy overlaps segment k's
        collective, whose host-to-device copy overlaps what follows. Returns the
        event of the last copy into recv (None if nothing was written back)."""
        eng = self._engine(send)
        cp, slots, up = eng.copier, eng.slots, eng.up
        dsend = cp.flat(send)
        drecv = dsend if recv is None or recv is send else cp.flat(recv)
        segs = list(segments(nbytes, esize, self.seg_bytes))
        down: list[Any] = [None] * len(segs)
        last = None

        def fetch(k: int) -> None:
            slot = k % self.depth
            if up[slot] is not None:  # the slot's previous segment has left it
                cp.sync(up[slot])
                up[slot] = None
            off, n = segs[k]
            down[k] = cp.d2h(slots[slot], dsend, off, n)

        for k in range(min(self.depth - 1, len(segs))):
            fetch(k)
        for k, (off, n) in enumerate(segs):
            if k + self.depth - 1 < len(segs):
                fetch(k + self.depth - 1)
            cp.sync(down[k])
            host = slots[k % self.depth][:n]
            run(host, host)
            if write_back:
                last = up[k % self.depth] = cp.h2d(drecv, off, host, n)
        return last

    def whole(
        self, send: Any, recv: Any | None, send_bytes: int, recv_bytes: int,
        run: Callable[[np.ndarray, np.ndarray | None], None],
    ) -> Any:  # fmt: skip
        """Collectives whose output layout is not the input's (all_gather,
        reduce_scatter, all_to_all, send/recv): both sides staged whole.
        Returns the event of the copy into recv, already complete."""
        cp = self._engine(send if send is not None else recv).copier
        hsend = cp.pinned(send_bytes)
        hrecv = cp.pinned(recv_bytes) if recv is not None else None
        if send is not None and send_bytes:
            cp.sync(cp.d2h(hsend, cp.flat(send), 0, send_bytes))
        run(hsend, hrecv)
        if recv is not None and hrecv is not None and recv_bytes:
            ev = cp.h2d(cp.flat(recv), 0, hrecv, recv_bytes)
            cp.sync(ev)  # hrecv is freed on return: its copy must be over
            return ev
        return None


# ---- collectives on device buffers ------------------------------------------------


def dtype_name(obj: Any) -> str:
    """The element type of a device (or host) array, as mrc's collectives name it."""
    if _is_torch(obj):
        return str(obj.dtype).removeprefix("torch.")
    return np.dtype(obj.dtype).name


def nbytes_of(obj: Any) -> int:
    if _is_torch(obj):
        return int(obj.numel() * obj.element_size())
    return int(obj.nbytes)


def _host_view(raw: np.ndarray, dtype: str) -> np.ndarray:
    return raw.view(np.uint16 if dtype == "bfloat16" else np.dtype(dtype))


class DeviceWork:
    """An async collective on device buffers: wait() makes the caller's current
    stream wait for the result (as the NCCL backend's Work does)."""

    def __init__(self, work: Any, copier: Copier, out: Any) -> None:
        self._work, self._copier, self._out = work, copier, out

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until done. The result's last copy is complete on return (a host
        wait on its event), so a waiter on any thread (the torch backend's
        completer) hands on finished memory; the caller's stream waits on it too."""
        event = self._work.wait(timeout)
        if event is not None:
            self._copier.sync(event)
            self._copier.finish(event)
        return self._out

    def done(self) -> bool:
        return bool(self._work.done())

    def exception(self) -> BaseException | None:
        return self._work.exception()


def collective(comm: Any, kind: str, **kw: Any) -> Any:
    """Runs comm.<kind> on device buffers through pinned host memory (see the
    module's docstring), given the host method's arguments by keyword. Same
    result as the host call: all_reduce, reduce and broadcast run per segment
    (pipelined), the others on whole staged buffers. Every rank must pass the
    same kind of memory: segmenting is part of the call, so a rank passing host
    memory runs another sequence of calls (CollectiveError: mismatch)."""
    async_op = bool(kw.pop("async_op", False))
    stager: Stager | None = getattr(comm, "_gpu_stager", None)
    if stager is None:
        stager = comm._gpu_stager = Stager()
    host_call = getattr(comm, kind)
    first = kw.pop("buf") if kind in ("broadcast", "send", "recv") else kw.pop("send")
    name = kw.pop("dtype", None) or dtype_name(first)
    esize = 2 if name == "bfloat16" else np.dtype(name).itemsize
    cp = stager._engine(first).copier
    mark = cp.mark()  # in the caller's thread: what its stream queued so far
    job: Callable[[], Any]

    if kind in ("all_reduce", "reduce", "broadcast"):
        recv = kw.pop("recv", None)
        root = kw.get("root", 0)
        # Who receives: everyone (all_reduce), root (reduce), all but root (broadcast).
        write_back = {"all_reduce": True, "reduce": comm.rank == root}.get(kind, comm.rank != root)
        out = first if recv is None else recv
        if kind == "reduce" and comm.rank != root:
            out = None

        def run(h_in: np.ndarray, h_out: np.ndarray) -> None:
            view = _host_view(h_in, name)
            if kind == "broadcast":
                host_call(view, dtype=name, **kw)
            else:
                host_call(view, None, dtype=name, **kw)

        def job() -> Any:
            cp.after(mark)
            return stager.elementwise(first, recv, nbytes_of(first), esize, run, write_back)

    else:
        send = None if kind == "recv" else first
        recv = first if kind == "recv" else kw.pop("recv", None)
        out = recv

        def run_whole(h_send: np.ndarray, h_recv: np.ndarray | None) -> None:
            if kind == "send":
                host_call(h_send, **kw)
            elif kind == "recv":
                host_call(h_recv, **kw)
            else:
                assert h_recv is not None
                host_call(_host_view(h_send, name), _host_view(h_recv, name), dtype=name, **kw)

        def job() -> Any:
            cp.after(mark)
            sb = 0 if send is None else nbytes_of(send)
            rb = 0 if recv is None else nbytes_of(recv)
            return stager.whole(send, recv, sb, rb, run_whole)

    what = f"{kind} of {nbytes_of(first)} bytes of device memory"
    if async_op:
        return DeviceWork(comm._submit(what, job, True), cp, out)
    event = comm._submit(what, job, False)
    if event is not None:
        cp.finish(event)
    return out
