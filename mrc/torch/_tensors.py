"""Tensors as mrc buffers: dtype mapping, argument checks, zero-copy views and staging.

A contiguous CPU tensor is handed to the communicator as a numpy view of its own storage
(`Tensor.numpy()` shares memory), so nothing is copied in or out. A non-contiguous tensor is
copied into a contiguous staging tensor first and, for outputs, copied back when the work
completes. Every check here runs before the collective is issued, so a bad call raises on
the calling rank without sending anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

# torch dtype -> the dtype name mrc's reductions know. bfloat16 has no numpy dtype: its
# storage travels as uint16 and the communicator is told the real dtype by name.
REDUCE_DTYPES: dict[torch.dtype, str] = {
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}

_RED_OPS: dict[object, str] = {
    dist.ReduceOp.RedOpType.SUM: "sum",
    dist.ReduceOp.RedOpType.PRODUCT: "prod",
    dist.ReduceOp.RedOpType.MIN: "min",
    dist.ReduceOp.RedOpType.MAX: "max",
    dist.ReduceOp.RedOpType.AVG: "avg",
}


class TensorError(ValueError):
    """A tensor handed to the mrc backend can never work (dtype, device, size, layout)."""


def reduce_op(op: object, rank: int, what: str) -> str:
    """The mrc op name of a torch ReduceOp (or RedOpType); a clear error for the others."""
    kind = getattr(op, "op", op)
    name = _RED_OPS.get(kind)
    if name is None:
        raise TensorError(
            f"mrc backend rank {rank}: {what}: reduce op {kind} is not supported "
            f"(supported: SUM, PRODUCT, MIN, MAX, AVG)"
        )
    return name


def check_tensor(t: object, rank: int, what: str) -> torch.Tensor:
    """A dense CPU tensor, or a TensorError naming the argument and the rank."""
    if not isinstance(t, torch.Tensor):
        raise TensorError(f"mrc backend rank {rank}: {what} is a {type(t).__name__}, not a Tensor")
    if t.layout != torch.strided:
        raise TensorError(
            f"mrc backend rank {rank}: {what} has layout {t.layout}; only dense tensors"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise TensorError(
            f"mrc backend rank {rank}: {what} is on {t.device}; the mrc backend takes CPU "
            f"and CUDA tensors"
        )
    return t


# bool: SUM is logical or and PRODUCT logical and, as NCCL maps them: MAX and MIN over 0, 1
_BOOL_OPS = {"sum": "max", "max": "max", "prod": "min", "min": "min"}
# complex: SUM and AVG act on the real and imaginary parts apart (flat_view's real pairs)
_COMPLEX_DTYPES = {torch.complex64: "float32", torch.complex128: "float64"}


def reduce_kind(t: torch.Tensor, op: str, rank: int, what: str) -> tuple[str, str]:
    """The mrc dtype name and op a reduction of t uses; a clear error for what mrc cannot
    reduce."""
    if t.dtype == torch.bool and op in _BOOL_OPS:
        return "uint8", _BOOL_OPS[op]
    if t.dtype in _COMPLEX_DTYPES and op in ("sum", "avg"):
        return _COMPLEX_DTYPES[t.dtype], op
    name = REDUCE_DTYPES.get(t.dtype)
    if name is None:
        supported = ", ".join(str(d).removeprefix("torch.") for d in REDUCE_DTYPES)
        extra = {torch.bool: " (bool with SUM, PRODUCT, MAX or MIN)"}.get(t.dtype, "")
        if t.dtype in _COMPLEX_DTYPES:
            extra = " (complex with SUM or AVG)"
        raise TensorError(
            f"mrc backend rank {rank}: {what} has dtype {str(t.dtype).removeprefix('torch.')}, "
            f"which mrc cannot reduce with {op}{extra}; supported: {supported}"
        )
    return name, op


def flat_view(t: torch.Tensor) -> np.ndarray:
    """A 1-d numpy view of a contiguous tensor's memory, elements of t's own width.

    bfloat16 (and any dtype numpy lacks) is viewed as unsigned integers of the same size;
    the communicator is passed the real dtype name where it reduces.
    """
    flat = t.detach().reshape(-1)
    if flat.is_cuda:
        # device memory goes through mrc.gpu's pinned staging, which takes the tensor
        # itself (its stream semantics are torch's); bool moves as bytes
        return flat.view(torch.uint8) if t.dtype == torch.bool else flat  # type: ignore[return-value]
    if t.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.bool:
        return flat.view(torch.uint8).numpy()
    if t.dtype in _COMPLEX_DTYPES:  # real pairs: reduced as such (SUM, AVG)
        return torch.view_as_real(flat).reshape(-1).numpy()
    try:
        return flat.numpy()
    except TypeError:
        # complex32, uint16/32/64 views numpy lacks: move the bytes
        return flat.view(torch.uint8).numpy()


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous tensor's memory (data movement only); a CUDA
    tensor stays a (uint8) tensor, for mrc.gpu's staging."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()  # type: ignore[return-value]


@dataclass
class Staged:
    """The contiguous tensors handed to mrc, and the copies back to do when the work ends."""

    keep: list[torch.Tensor] = field(default_factory=list)  # alive until the work completes
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def input(self, t: torch.Tensor) -> torch.Tensor:
        """t itself when contiguous (zero-copy), else a contiguous copy of it."""
        c = t if t.is_contiguous() else t.contiguous()
        self.keep.append(c)
        return c

    def output(self, t: torch.Tensor) -> torch.Tensor:
        """t itself when contiguous, else a contiguous copy that goes back into t at the end."""
        if t.is_contiguous():
            self.keep.append(t)
            return t
        c = t.contiguous()
        self.keep.append(c)
        self.copy_back.append((c, t))
        return c

    def finish(self) -> None:
        # Outside autograd, as the caller's own tensor ops of a collective are: the copy
        # into a leaf that requires grad is the collective's result, not a graph op
        # (the completer thread has grad mode on whatever the caller's is).
        with torch.no_grad():
            for src, dst in self.copy_back:
                dst.copy_(src)
        self.copy_back.clear()


def one_tensor(tensors: Sequence[torch.Tensor], rank: int, what: str) -> torch.Tensor:
    """The single tensor of a per-device list (the mrc backend has one device per process)."""
    if len(tensors) != 1:
        raise TensorError(
            f"mrc backend rank {rank}: {what} takes one tensor per process, got {len(tensors)}"
        )
    return check_tensor(tensors[0], rank, f"{what} tensor")


def same_shape(a: torch.Tensor, b: torch.Tensor, rank: int, what: str) -> None:
    if a.dtype != b.dtype:
        raise TensorError(
            f"mrc backend rank {rank}: {what}: dtypes differ ({a.dtype} and {b.dtype})"
        )
    if a.numel() != b.numel():
        raise TensorError(
            f"mrc backend rank {rank}: {what}: sizes differ "
            f"({tuple(a.shape)} = {a.numel()} and {tuple(b.shape)} = {b.numel()} elements)"
        )
