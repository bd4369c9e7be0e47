"""GPU buffers (mrc.gpu): memory kinds, the staging pipeline's segmenting and slot
reuse (run here with host-to-host copies), and, where a CUDA device is present,
collectives on device memory against the host path bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from coll_helpers import mesh, ok, run_ranks

from mrc import gpu
from mrc.collectives import simulate as M
from mrc.errors import UsageError


class _CudaArray:
    """Something that says it is CUDA memory (as CuPy/numba arrays do)."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


class _DLPackOnly:
    def __init__(self, kind: int, dev: int) -> None:
        self.kind, self.dev = kind, dev

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.kind, self.dev)


def test_memory_kinds() -> None:
    assert gpu.memory_of(np.zeros(4)) == gpu.Memory(gpu.HOST)
    assert gpu.memory_of(bytearray(4)) == gpu.Memory(gpu.HOST)
    assert gpu.memory_of(_CudaArray()).kind == gpu.CUDA
    assert gpu.memory_of(_DLPackOnly(2, 3)) == gpu.Memory(gpu.CUDA, 3)
    assert gpu.memory_of(_DLPackOnly(3, 0)) == gpu.Memory(gpu.CUDA_HOST, 0)
    assert gpu.is_device(None, _CudaArray())
    assert not gpu.is_device(np.zeros(1), None)
    with pytest.raises(UsageError, match="DLPack device type 4"):
        gpu.memory_of(_DLPackOnly(4, 0))


def test_torch_cpu_tensors_are_host_memory() -> None:
    torch = pytest.importorskip("torch")
    assert gpu.memory_of(torch.zeros(3)) == gpu.Memory(gpu.HOST)
    assert gpu.dtype_name(torch.zeros(3, dtype=torch.bfloat16)) == "bfloat16"
    assert gpu.nbytes_of(torch.zeros(3, dtype=torch.float64)) == 24


def test_cuda_array_without_cupy_says_what_to_install() -> None:
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    with pytest.raises(UsageError, match=r"pip install mrc\[cuda\]"):
        gpu.copier_for(_CudaArray())


@pytest.mark.parametrize("nbytes,esize,seg", [(0, 4, 16), (10, 2, 4), (4096, 8, 1000), (7, 1, 7)])
def test_segments_cover_element_aligned(nbytes: int, esize: int, seg: int) -> None:
    segs = list(gpu.segments(nbytes, esize, seg))
    pos = 0
    for off, n in segs:
        assert off == pos and n > 0 and off % esize == 0
        pos += n
    assert pos == nbytes


def test_pipeline_reuses_slots_in_order_across_calls() -> None:
    """Each segment is fetched, handed to the collective, written back, in
    order, through `depth` slots; a second call reuses the same slots."""
    st = gpu.Stager(seg_bytes=64, depth=3)
    seen: list[bytes] = []

    def run(h_in: np.ndarray, h_out: np.ndarray) -> None:
        assert h_in is h_out or np.shares_memory(h_in, h_out)
        seen.append(h_in.tobytes())
        h_in[:] = 255 - h_in

    for call in range(2):
        src = np.random.default_rng(call).integers(0, 255, 1000, dtype=np.uint8)
        dst = np.zeros_like(src)
        assert st.elementwise(src, dst, src.nbytes, 1, run) is None
        assert np.array_equal(dst, 255 - src)
    assert len(seen) == 2 * 16
    assert len(st._engines) == 1  # the slots were kept


def test_pipeline_without_write_back_leaves_recv() -> None:
    st = gpu.Stager(seg_bytes=32, depth=2)
    src = np.arange(100, dtype=np.uint8)
    dst = np.full(100, 7, np.uint8)
    st.elementwise(src, dst, 100, 1, lambda a, b: None, write_back=False)
    assert (dst == 7).all()


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("async_op", [False, True])
def test_staged_collectives_equal_the_host_path(async_op: bool) -> None:
    """The staging pipeline (here with host-to-host copies) run through real
    communicators: per-segment all_reduce/reduce/broadcast and whole-buffer
    all_gather give the bits of the direct host calls, sync and async (the
    segments' host collectives then run on the worker thread)."""
    n, count = 3, 50_001  # not a multiple of the segment or of n
    ins = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(n)]
    want = _bits(M.reference(ins, "float32", "sum"))

    def go(rk: Any) -> list[np.ndarray]:
        rk._gpu_stager = gpu.Stager(seg_bytes=16 << 10, depth=3)  # 13 segments
        mine = ins[rk.rank]

        def call(kind: str, **kw: Any) -> Any:
            got = gpu.collective(rk, kind, async_op=async_op, **kw)
            return got.wait(timeout=30) if async_op else got

        red = np.empty_like(mine)
        call("all_reduce", send=mine.copy(), recv=red, op="sum")
        inplace = call("all_reduce", send=mine.copy(), op="sum")
        root = np.zeros_like(mine)
        call("reduce", send=mine.copy(), recv=root, op="sum", root=1)
        b = mine.copy() if rk.rank == 2 else np.zeros_like(mine)
        call("broadcast", buf=b, root=2)
        gathered = np.empty(n * count, np.float32)
        call("all_gather", send=mine, recv=gathered)
        return [red, inplace, root, b, gathered]

    with mesh(n) as ranks:
        for r, (red, inplace, root, b, gathered) in enumerate(ok(run_ranks(ranks, go))):
            assert _bits(red) == want and _bits(inplace) == want
            if r == 1:
                assert _bits(root) == want
            else:
                assert not root.any()  # only root's recv is written
            assert _bits(b) == _bits(ins[2])
            assert _bits(gathered) == _bits(np.concatenate(ins))


def _cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (GPU tests run with `make gpu-check` on a GPU machine)")
    return torch


@pytest.mark.gpu
def test_torch_cuda_staging_roundtrip_and_stream_order() -> None:
    """A kernel that writes the tensor on the current stream just before the
    staged copy, without synchronize, is seen by it."""
    torch = _cuda()
    st = gpu.Stager(seg_bytes=1 << 20, depth=3)
    t = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda")
    t.add_(3)  # queued, not synchronised
    got: list[np.ndarray] = []

    def run(h_in: np.ndarray, h_out: np.ndarray) -> None:
        got.append(h_in.copy())
        h_in += 1

    cp = st._engine(t).copier
    cp.after(cp.mark())
    ev = st.elementwise(t, None, t.numel(), 1, run)
    cp.finish(ev)
    assert all((g == 3).all() for g in got)
    assert bool((t == 4).all())


_KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def _host_and_device(
    rk: Any, kind: str, x: np.ndarray, to_dev: Callable[[np.ndarray], Any],
    to_host: Callable[[Any], np.ndarray], dtype: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The same collective on host memory and on device memory; both results."""
    n = rk.size

    def run(buf: np.ndarray | Any, out: np.ndarray | Any) -> None:
        if kind in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
            getattr(rk, kind)(buf, out, dtype=dtype)
        elif kind == "reduce":
            rk.reduce(buf, out, root=1, dtype=dtype)
        else:
            rk.broadcast(buf, root=1, dtype=dtype)

    outs = []
    for dev in (False, True):
        size = {"all_gather": n * x.size, "reduce_scatter": x.size // n}.get(kind, x.size)
        out = np.zeros(size, x.dtype)
        buf, o = (to_dev(x.copy()), to_dev(out)) if dev else (x.copy(), out)
        run(buf, o)
        res = buf if kind == "broadcast" else o
        outs.append(to_host(res) if dev else res)
    return outs[0], outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_torch_cuda_collectives_equal_the_host_path(kind: str, dtype: str) -> None:
    torch = _cuda()
    n, count = 3, 3 * 70_001
    tdt = getattr(torch, dtype)

    def go(rk: Any) -> tuple[np.ndarray, np.ndarray]:
        rk._gpu_stager = gpu.Stager(seg_bytes=64 << 10)
        g = torch.Generator().manual_seed(rk.rank)
        x = (torch.randn(count, generator=g) * 100).to(tdt)
        host_x = x.view(torch.int16).numpy() if dtype == "bfloat16" else x.numpy()

        def to_dev(a: np.ndarray) -> Any:
            t = torch.from_numpy(a).cuda()
            return t.view(torch.bfloat16) if dtype == "bfloat16" else t

        def to_host(t: Any) -> np.ndarray:
            torch.cuda.current_stream().synchronize()
            t = t.view(torch.int16) if dtype == "bfloat16" else t
            return t.cpu().numpy()

        # bfloat16 host storage is 2-byte integers: the dtype is named
        named = "bfloat16" if dtype == "bfloat16" else None
        return _host_and_device(rk, kind, host_x, to_dev, to_host, named)

    with mesh(n) as ranks:
        for host, dev in ok(run_ranks(ranks, go)):
            assert host.tobytes() == dev.tobytes()


@pytest.mark.gpu
def test_cupy_arrays_equal_the_host_path() -> None:
    _cuda()
    cupy = pytest.importorskip("cupy")
    n = 2

    def go(rk: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        x = np.random.default_rng(rk.rank).standard_normal(2 * 100_003).astype(np.float32)
        return [_host_and_device(rk, k, x, cupy.asarray, cupy.asnumpy) for k in _KINDS]

    with mesh(n) as ranks:
        for pairs in ok(run_ranks(ranks, go)):
            for host, dev in pairs:
                assert host.tobytes() == dev.tobytes()


@pytest.mark.gpu
def test_torch_stream_semantics_without_synchronize() -> None:
    """A kernel writes the tensor on the current stream just before the
    collective, with no synchronize: the collective sees it; the result is
    ordered before later work on the current stream, sync and async."""
    torch = _cuda()
    n, count = 2, 4 << 20

    def go(rk: Any) -> list[float]:
        out = []
        for async_op in (False, True):
            t = torch.zeros(count, device="cuda")
            torch.cuda._sleep(50_000_000)  # keeps the stream busy: the fill lands late
            t.fill_(rk.rank + 1.0)
            w = rk.all_reduce(t, async_op=async_op)
            if async_op:
                w.wait()
            out.append(float((t * 2).sum().item()))  # queued after the result
        return out

    with mesh(n) as ranks:
        for got in ok(run_ranks(ranks, go)):
            assert got == [2.0 * 3.0 * count] * 2
