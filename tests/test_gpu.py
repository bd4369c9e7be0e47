"""GPU buffers (mrc.gpu): memory kinds, the staging pipeline's segmenting and slot
reuse (run here with host-to-host copies), and, where a CUDA device is present,
collectives on device memory against the host path bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mrc import gpu
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
