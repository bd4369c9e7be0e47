"""Random collective calls, each checked bit for bit against numpy in rank order: the
body of the collective soak (benchmarks/coll_soak.py) and of its short test.

Every rank derives call i from (seed, i) alone, so all ranks make the same call with
no exchange, and each rank builds every rank's input itself, so it can compute the
reference it must get. Calls mix every collective, op and dtype, in place and not,
sizes from 0 elements to `max_bytes`, roots, uneven all_to_all counts, barriers and
batches of asynchronous all_reduces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mrc.collectives import simulate as M

DTYPES = ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
OPS = ("sum", "prod", "min", "max", "avg")
KINDS = (
    *("all_reduce",) * 4,
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_allv",
    "barrier",
    "async_all_reduce",
    "chain_all_reduce",
    "hier_all_reduce",
    "tree_all_reduce",
)
ESIZE = {"int8": 1, "uint8": 1, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
         "float32": 4, "float64": 8}  # fmt: skip
ASYNC_BATCH = 3


@dataclass
class Call:
    """One soak call, the same on every rank."""

    i: int
    kind: str
    dtype: str
    op: str
    in_place: bool
    root: int
    count: int  # elements per rank's block (all_to_allv: the counts matrix instead)
    counts: list[list[int]] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        if not self.counts:
            d.pop("counts")
        return d


def data(dtype: str, count: int, seed: Any, op: str = "sum") -> np.ndarray:
    """Values that keep every op finite: small integers for prod, floats with many
    mantissa bits so that the order of additions shows in the bits."""
    rng = np.random.default_rng(seed)
    if dtype in ("int8", "uint8", "int32", "int64"):
        info = np.iinfo(dtype)
        lo, hi = (-3, 4) if op == "prod" else (max(info.min, -1000), min(info.max, 1000))
        return rng.integers(0 if dtype == "uint8" else lo, hi, count).astype(dtype)
    x = rng.standard_normal(count) * (1.0 if op == "prod" else 100.0)
    if op == "prod":
        x = 1.0 + x / 10.0
    if dtype == "bfloat16":
        return M.f32_to_bf16(x.astype(np.float32))
    return x.astype(dtype)


def _count(rng: np.random.Generator, dtype: str, max_bytes: int, div: int) -> int:
    """0-2 elements one time in ten, small (under 4096) four in ten, else log-uniform
    up to max_bytes in all."""
    r = rng.random()
    if r < 0.1:
        return int(rng.integers(0, 3))
    if r < 0.5:
        return int(rng.integers(1, 4096))
    top = max(4097, max_bytes // ESIZE[dtype] // div)
    return int(np.exp(rng.uniform(np.log(4096), np.log(top))))


def call(seed: int, i: int, n: int, max_bytes: int) -> Call:
    """Call i of the soak `seed` for n ranks."""
    rng = np.random.default_rng([seed, i])
    kind = KINDS[int(rng.integers(len(KINDS)))]
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    op = OPS[int(rng.integers(len(OPS)))]
    c = Call(i, kind, dtype, op, bool(rng.integers(2)), int(rng.integers(n)), 0)
    per_rank = kind in ("all_gather", "reduce_scatter", "all_to_all", "all_to_allv")
    c.count = _count(rng, dtype, max_bytes, n if per_rank else 1)
    if kind == "all_to_allv":
        m = rng.integers(0, c.count + 1, (n, n))
        m[rng.random((n, n)) < 0.2] = 0  # some pairs send nothing
        c.counts = m.tolist()
    return c


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def run(comm: Any, seed: int, c: Call) -> bool:
    """Makes call c on this rank (comm: a Communicator, or anything with its
    collectives, rank and size); True when what it got is the reference's bits."""
    n, rank = comm.size, comm.rank
    dt = "bfloat16" if c.dtype == "bfloat16" else None

    def inp(r: int, count: int, j: int = 0) -> np.ndarray:
        return data(c.dtype, count, [seed, c.i, j, r], c.op)

    if c.kind == "barrier":
        comm.barrier()
        return True
    if c.kind in ("all_reduce", "chain_all_reduce", "hier_all_reduce", "tree_all_reduce"):
        ins = [inp(r, c.count) for r in range(n)]
        mine = ins[rank].copy()
        out = None if c.in_place else np.empty_like(mine)
        algo = c.kind.split("_")[0] if c.kind != "all_reduce" else "auto"
        got = comm.all_reduce(mine, out, op=c.op, dtype=dt, algo=algo)
        return bits(got) == bits(M.reference(ins, c.dtype, c.op))
    if c.kind == "async_all_reduce":
        batch = [[inp(r, c.count, j) for r in range(n)] for j in range(ASYNC_BATCH)]
        outs = [np.empty_like(b[rank]) for b in batch]
        works = [
            comm.all_reduce(b[rank].copy(), o, op=c.op, dtype=dt, async_op=True)
            for b, o in zip(batch, outs, strict=True)
        ]
        for w in works:
            w.wait()
        return all(
            bits(o) == bits(M.reference(b, c.dtype, c.op)) for b, o in zip(batch, outs, strict=True)
        )
    if c.kind == "reduce":
        ins = [inp(r, c.count) for r in range(n)]
        mine = ins[rank].copy()
        out = None if c.in_place else np.empty_like(mine)
        got = comm.reduce(mine, out, op=c.op, root=c.root, dtype=dt)
        return rank != c.root or bits(got) == bits(M.reference(ins, c.dtype, c.op))
    if c.kind == "broadcast":
        src = inp(c.root, c.count)
        buf = src.copy() if rank == c.root else np.zeros_like(src)
        comm.broadcast(buf, root=c.root, dtype=dt)
        return bits(buf) == bits(src)
    if c.kind == "all_gather":
        ins = [inp(r, c.count) for r in range(n)]
        out = np.empty(c.count * n, ins[0].dtype)
        comm.all_gather(ins[rank], out, dtype=dt)
        return bits(out) == bits(np.concatenate(ins))
    if c.kind == "reduce_scatter":
        ins = [inp(r, c.count * n) for r in range(n)]
        out = np.empty(c.count, ins[0].dtype)
        comm.reduce_scatter(ins[rank], out, op=c.op, dtype=dt)
        want = M.reference(ins, c.dtype, c.op)[rank * c.count : (rank + 1) * c.count]
        return bits(out) == bits(want)
    if c.kind == "all_to_all":
        ins = [inp(r, c.count * n) for r in range(n)]
        out = np.empty(c.count * n, ins[0].dtype)
        comm.all_to_all(ins[rank], out, dtype=dt)
        want = [ins[k][rank * c.count : (rank + 1) * c.count] for k in range(n)]
        return bits(out) == bits(np.concatenate(want))
    assert c.kind == "all_to_allv", c.kind
    m = np.array(c.counts)
    ins = [inp(r, int(m[r].sum())) for r in range(n)]
    out = np.empty(int(m[:, rank].sum()), ins[0].dtype)
    comm.all_to_all(
        ins[rank], out, [int(x) for x in m[rank]], [int(x) for x in m[:, rank]], dtype=dt
    )
    want = []
    for k in range(n):
        off = int(m[k][:rank].sum())
        want.append(ins[k][off : off + int(m[k][rank])])
    return bits(out) == bits(np.concatenate(want))
