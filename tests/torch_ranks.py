"""One rank of a tests/test_torch.py scenario: `python tests/torch_ranks.py SCENARIO OUTDIR`.

RANK, WORLD_SIZE and the rendezvous (MRC_TEST_INIT, an init_method URL; default env://,
as under mrc-run) come from the environment. Each rank checks its own results and writes
OUTDIR/rank<R>.json; a failed check exits non-zero with the reason on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import mrc.torch  # noqa: F401 - registers the backend

RANK = int(os.environ["RANK"])
SIZE = int(os.environ["WORLD_SIZE"])

DTYPES = [
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def data(rank: int, n: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    """Rank r's input of a case: small values so sums and products stay in range."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype in FLOATS:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    lo, hi = (0, 4) if dtype == torch.uint8 else (-3, 4)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def rank_order(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction mrc promises: element-wise, in rank order 0, 1, ... n-1, in the dtype."""
    acc = xs[0].clone()
    for x in xs[1:]:
        if acc.dtype in (torch.float16, torch.bfloat16):
            # one rounding per step, as the C reductions do (compute wide, round to the dtype)
            a, b = acc.float(), x.float()
        else:
            a, b = acc, x
        if op in ("sum", "avg"):
            r = a + b
        elif op == "prod":
            r = a * b
        elif op == "min":
            r = torch.minimum(a, b)
        else:
            r = torch.maximum(a, b)
        acc = r.to(acc.dtype)
    if op == "avg":
        acc = (
            acc / len(xs) if acc.dtype in FLOATS else torch.div(acc, len(xs), rounding_mode="trunc")
        )
    return acc


class Check:
    def __init__(self) -> None:
        self.n = 0

    def exact(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.n += 1
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            bad = (got != want).nonzero()[:5].flatten().tolist() if got.shape == want.shape else []
            raise AssertionError(
                f"rank {RANK}: {what}: got {got.flatten()[:8].tolist()} want "
                f"{want.flatten()[:8].tolist()} (dtype {got.dtype}/{want.dtype}, first bad {bad})"
            )

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.n += 1
        if got.dtype in FLOATS:
            tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-6)
            ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
        else:
            ok = torch.equal(got, want)
        if not ok:
            raise AssertionError(f"rank {RANK}: {what} differs from gloo: {got[:8]} vs {want[:8]}")


OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX}  # fmt: skip


def both(fn, gloo: dist.ProcessGroup, *tensors: torch.Tensor) -> tuple:  # type: ignore[no-untyped-def]
    """Run fn(group, *tensors) on mrc (WORLD) and on a Gloo group, on copies of the inputs."""
    mine = [t.clone() for t in tensors]
    theirs = [t.clone() for t in tensors]
    fn(None, *mine)
    fn(gloo, *theirs)
    return mine, theirs


def scenario_collectives(out: Path) -> dict:
    ck = Check()
    gloo = dist.new_group(backend="gloo")
    n = 37  # not divisible by the group size: chunking edge cases
    for case, dtype in enumerate(DTYPES):
        xs = [data(r, n * SIZE, dtype, case) for r in range(SIZE)]
        x = xs[RANK]
        name = str(dtype).removeprefix("torch.")
        for op in ("sum", "prod", "min", "max"):
            ref = rank_order(xs, op)
            m, g = both(lambda grp, t, op=op: dist.all_reduce(t, OPS[op], group=grp), gloo, x)
            ck.exact(f"all_reduce {op} {name}", m[0], ref)
            ck.close(f"all_reduce {op} {name}", m[0], g[0])
        if dtype in FLOATS:
            m, _ = both(lambda grp, t: dist.all_reduce(t, dist.ReduceOp.AVG, group=grp), None, x)
            ck.exact(f"all_reduce avg {name}", m[0], rank_order(xs, "avg"))
        # non-contiguous: every other element of a wider tensor, the rest untouched
        wide = torch.stack([x, torch.zeros_like(x)], dim=1)
        dist.all_reduce(wide[:, 0])
        ck.exact(f"all_reduce strided {name}", wide[:, 0], rank_order(xs, "sum"))
        ck.exact(f"all_reduce strided {name} untouched", wide[:, 1], torch.zeros_like(x))
        # coalesced (what DDP's bucket-free paths and clip_grad use)
        parts = [x[:5].clone(), x[5:].clone()]
        dist.all_reduce_coalesced(parts)
        ck.exact(f"all_reduce_coalesced {name}", torch.cat(parts), rank_order(xs, "sum"))
        # broadcast from every root
        for root in range(SIZE):
            m, g = both(lambda grp, t, root=root: dist.broadcast(t, root, group=grp), gloo, x)
            ck.exact(f"broadcast root {root} {name}", m[0], xs[root])
        # reduce to root 1 (or 0)
        root = 1 % SIZE
        m, g = both(lambda grp, t, root=root: dist.reduce(t, root, group=grp), gloo, x)
        if RANK == root:
            ck.exact(f"reduce {name}", m[0], rank_order(xs, "sum"))
            ck.close(f"reduce {name}", m[0], g[0])
        # all_gather (list) and all_gather_into_tensor
        small = [t[:n] for t in xs]
        outs = [torch.empty(n, dtype=dtype) for _ in range(SIZE)]
        dist.all_gather(outs, small[RANK])
        ck.exact(f"all_gather {name}", torch.cat(outs), torch.cat(small))
        big = torch.empty(n * SIZE, dtype=dtype)
        gbig = big.clone()
        dist.all_gather_into_tensor(big, small[RANK])
        dist.all_gather_into_tensor(gbig, small[RANK], group=gloo)
        ck.exact(f"all_gather_into_tensor {name}", big, torch.cat(small))
        ck.exact(f"all_gather_into_tensor {name} vs gloo", big, gbig)
        # reduce_scatter (list) and reduce_scatter_tensor
        full = rank_order(xs, "sum")
        mine = full[RANK * n : (RANK + 1) * n]
        o = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(o, list(x.chunk(SIZE)))
        ck.exact(f"reduce_scatter {name}", o, mine)
        o2, og = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(o2, x)
        dist.reduce_scatter_tensor(og, x, group=gloo)
        ck.exact(f"reduce_scatter_tensor {name}", o2, mine)
        ck.close(f"reduce_scatter_tensor {name}", o2, og)
        # all_to_all_single, equal splits and variable splits (rank r sends r+d+1 rows to d)
        a = torch.empty(n * SIZE, dtype=dtype)
        dist.all_to_all_single(a, x)
        want = torch.cat([t.chunk(SIZE)[RANK] for t in xs])
        ck.exact(f"all_to_all_single {name}", a, want)
        ssz = [RANK + d + 1 for d in range(SIZE)]
        rsz = [s + RANK + 1 for s in range(SIZE)]
        send = x[: sum(ssz)].clone()
        recv, grecv = torch.empty(sum(rsz), dtype=dtype), torch.empty(sum(rsz), dtype=dtype)
        dist.all_to_all_single(recv, send, rsz, ssz)
        dist.all_to_all_single(grecv, send, rsz, ssz, group=gloo)
        pieces = []
        for s in range(SIZE):
            sizes = [s + d + 1 for d in range(SIZE)]
            start = sum(sizes[:RANK])
            pieces.append(xs[s][start : start + sizes[RANK]])
        ck.exact(f"all_to_all_single splits {name}", recv, torch.cat(pieces))
        ck.exact(f"all_to_all_single splits {name} vs gloo", recv, grecv)
        # all_to_all with lists of tensors
        lo = [torch.empty(2, dtype=dtype) for _ in range(SIZE)]
        dist.all_to_all(lo, [x[2 * d : 2 * d + 2].clone() for d in range(SIZE)])
        ck.exact(
            f"all_to_all {name}", torch.cat(lo), torch.cat([t[2 * RANK : 2 * RANK + 2] for t in xs])
        )
    # gather and scatter (all_to_all with one side's counts zero)
    g = [torch.empty(3) for _ in range(SIZE)] if RANK == SIZE - 1 else None
    dist.gather(torch.full((3,), float(RANK)), g, dst=SIZE - 1)
    if g is not None:
        ck.exact("gather", torch.stack(g), torch.arange(SIZE).float()[:, None].expand(SIZE, 3))
    s = torch.empty(2, dtype=torch.int64)
    parts = [torch.full((2,), 10 * d, dtype=torch.int64) for d in range(SIZE)]
    dist.scatter(s, parts if RANK == 0 else None, src=0)
    ck.exact("scatter", s, torch.full((2,), 10 * RANK, dtype=torch.int64))
    # bool: max / min are logical or / and; broadcast moves bytes
    bx = [data(r, 50, torch.int64, 99) > 0 for r in range(SIZE)]
    for opname, fn in (("max", torch.logical_or), ("min", torch.logical_and)):
        t = bx[RANK].clone()
        dist.all_reduce(t, OPS[opname])
        want = bx[0]
        for b in bx[1:]:
            want = fn(want, b)
        ck.exact(f"all_reduce {opname} bool", t, want)
    # bool SUM / PRODUCT are logical or / and (NCCL's mapping), as Gloo computes them
    for opname, fn in (("sum", torch.logical_or), ("prod", torch.logical_and)):
        t = bx[RANK].clone()
        m, g = both(lambda grp, t, op=opname: dist.all_reduce(t, OPS[op], group=grp), gloo, t)
        want = bx[0]
        for b in bx[1:]:
            want = fn(want, b)
        ck.exact(f"all_reduce {opname} bool", m[0], want)
        ck.exact(f"all_reduce {opname} bool vs gloo", m[0], g[0])
    # complex SUM: the real and imaginary parts apart, in rank order (small integers: exact)
    cx = [
        torch.complex(data(r, 24, torch.float32, 5), data(r, 24, torch.float32, 6))
        for r in range(SIZE)
    ]
    want = cx[0].clone()
    for c in cx[1:]:
        want = want + c
    t = cx[RANK].clone()
    dist.all_reduce(t)
    ck.exact("all_reduce sum complex64", t, want)
    t = cx[RANK].clone()
    dist.reduce(t, 0)
    if RANK == 0:
        ck.exact("reduce sum complex64", t, want)
    o = torch.empty(24 // SIZE if 24 % SIZE == 0 else 0, dtype=torch.complex64)
    if o.numel():
        dist.reduce_scatter_tensor(o, cx[RANK].clone())
        ck.exact("reduce_scatter_tensor complex64", o, want.view(SIZE, -1)[RANK])
    # into a non-contiguous leaf that requires grad (a Parameter): the copy back is the
    # collective's, not autograd's; the group goes on
    w = torch.nn.Parameter(torch.zeros(3, 2).t())
    if RANK == 0:
        with torch.no_grad():
            w.copy_(torch.arange(6.0).reshape(2, 3))
    dist.broadcast(w, 0)
    ck.exact("broadcast into a strided Parameter", w.detach(), torch.arange(6.0).reshape(2, 3))
    # isend + irecv with one peer on both ranks, also as a batch: two streams, not one
    if SIZE % 2 == 0:
        peer = RANK ^ 1
        mine, theirs = data(RANK, 300, torch.float32, 8), torch.empty(300)
        for batch in (False, True):
            if batch:
                ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
                works = dist.batch_isend_irecv(ops)
            else:
                works = [dist.isend(mine, peer), dist.irecv(theirs, peer)]
            for wk in works:
                wk.wait()
            ck.exact(
                f"isend+irecv exchange batch={batch}", theirs, data(peer, 300, torch.float32, 8)
            )
    # a batch around the ring that posts its irecv first on every rank: the held recv lets
    # the isend go first (it waited for the timeout)
    if SIZE > 1:
        nxt_, prv_ = (RANK + 1) % SIZE, (RANK - 1) % SIZE
        got_ = torch.empty(64)
        ops = [
            dist.P2POp(dist.irecv, got_, prv_),
            dist.P2POp(dist.isend, data(RANK, 64, torch.float32, 9), nxt_),
        ]
        for wk in dist.batch_isend_irecv(ops):
            wk.wait()
        ck.exact("batch irecv-first ring", got_, data(prv_, 64, torch.float32, 9))
    # send / recv around a ring, hashed at both ends; then a barrier
    payload = data(RANK, 100_000, torch.float32, 7)
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = torch.empty_like(payload)
    if SIZE > 1:
        if RANK % 2 == 0:
            dist.send(payload, nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(payload, nxt)
        ck.exact("send/recv ring", got, data(prv, 100_000, torch.float32, 7))
    dist.barrier()
    # async: several in flight, waited out of order
    ts = [data(RANK, 1000, torch.float64, 50 + i) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for i in reversed(range(4)):
        works[i].wait()
        ck.exact(
            f"async all_reduce {i}",
            ts[i],
            rank_order([data(r, 1000, torch.float64, 50 + i) for r in range(SIZE)], "sum"),
        )
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    ck.exact("future value", fut.wait()[0], torch.full((3,), float(SIZE)))
    # a new_group of the even ranks, its collectives its own
    evens = list(range(0, SIZE, 2))
    sub = dist.new_group(evens, backend="mrc")
    if RANK in evens:
        t = torch.full((4,), float(RANK))
        dist.all_reduce(t, group=sub)
        ck.exact("new_group all_reduce", t, torch.full((4,), float(sum(evens))))
    dist.barrier()
    return {"checks": ck.n, "sha": hashlib.sha256(got.numpy().tobytes()).hexdigest()}


def _fsdp_train(group: dist.ProcessGroup) -> tuple[list[float], torch.Tensor]:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(RANK)
    losses = []
    for _ in range(5):
        loss = m(torch.randn(8, 16, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = torch.cat([v.full_tensor().reshape(-1) for v in m.state_dict().values()])
    return losses, full


def scenario_fsdp(out: Path) -> dict:
    """FSDP2 (fully_shard: all_gather_into_tensor, reduce_scatter_tensor with AVG) over mrc
    and over Gloo from the same start: the same parameters to rounding on every rank."""
    gloo = dist.new_group(backend="gloo")
    losses, full = _fsdp_train(dist.group.WORLD)
    glosses, gfull = _fsdp_train(gloo)
    if not torch.allclose(full, gfull, rtol=1e-5, atol=1e-6):
        raise AssertionError(f"rank {RANK}: FSDP over mrc and Gloo differ: {full[:4]} {gfull[:4]}")
    return {"sha": hashlib.sha256(full.numpy().tobytes()).hexdigest(), "losses": losses}


def expect_error(what: str, fn, *needles: str) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        msg = str(e)
        missing = [s for s in needles if s not in msg]
        if missing:
            raise AssertionError(f"rank {RANK}: {what}: error {msg!r} lacks {missing}") from e
        return msg
    raise AssertionError(f"rank {RANK}: {what}: no error raised")


def scenario_errors(out: Path) -> dict:
    """Bad calls raise on the calling rank before anything is sent; the group stays usable."""
    msgs = {}
    r = f"rank {RANK}"
    # torch itself turns a complex all_reduce / broadcast / all_gather into real pairs
    # (view_as_real) before the backend; reduce and reduce_scatter reach it complex
    c = torch.ones(4, dtype=torch.complex64)
    msgs["complex"] = expect_error(
        "complex reduce",
        lambda: dist.reduce(c, 0, op=dist.ReduceOp.PRODUCT),
        "complex64",
        r,
        "reduce tensor",
        "SUM or AVG",
    )
    msgs["complex_rs"] = expect_error(
        "complex reduce_scatter_tensor",
        lambda: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.complex128),
            torch.ones(2 * SIZE, dtype=torch.complex128),
            op=dist.ReduceOp.MAX,
        ),
        "complex128",
        r,
        "reduce_scatter_tensor output",
    )
    z = torch.full((4,), 1 + 2j, dtype=torch.complex64)
    dist.all_reduce(z)
    if not torch.equal(z, torch.full((4,), SIZE * (1 + 2j), dtype=torch.complex64)):
        raise AssertionError(f"rank {RANK}: complex all_reduce (as real pairs) gave {z}")
    msgs["bool_sum"] = expect_error(
        "bool avg",
        lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool), op=dist.ReduceOp.AVG),
        "bool",
        "avg",
        r,
    )
    msgs["int16"] = expect_error(
        "int16 reduce_scatter",
        lambda: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.int16), torch.ones(2 * SIZE, dtype=torch.int16)
        ),
        "int16",
        r,
    )
    msgs["bor"] = expect_error(
        "BOR",
        lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), dist.ReduceOp.BOR),
        "BOR",
        r,
    )
    msgs["gather_size"] = expect_error(
        "all_gather_into_tensor sizes",
        lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(3)),
        "output",
        "5",
        r,
    )
    msgs["a2a_splits"] = expect_error(
        "all_to_all_single splits",
        lambda: dist.all_to_all_single(
            torch.empty(4 * SIZE), torch.ones(4 * SIZE), None, [1] * SIZE
        ),
        "split sizes",
        r,
    )
    # torch's dist.send already refuses these; the group itself does too (direct callers)
    pg = dist.group.WORLD
    msgs["send_self"] = expect_error(
        "send to self", lambda: pg.send([torch.ones(2)], RANK, 0), "this rank", r
    )
    msgs["recv_outside"] = expect_error(
        "recv from outside", lambda: pg.recv([torch.ones(2)], SIZE + 2, 0), str(SIZE + 2), r
    )
    msgs["dtype_mix"] = expect_error(
        "reduce_scatter dtypes",
        lambda: dist.reduce_scatter_tensor(
            torch.empty(2), torch.ones(2 * SIZE, dtype=torch.float64)
        ),
        "float64",
        r,
    )
    # nothing was sent: the next collective is the first each rank issued
    t = torch.full((8,), float(RANK + 1))
    dist.all_reduce(t)
    want = float(sum(range(1, SIZE + 1)))
    if not torch.equal(t, torch.full((8,), want)):
        raise AssertionError(f"rank {RANK}: all_reduce after errors gave {t.tolist()}")
    # torch itself handles a rank outside a group: the call returns None with a warning
    # before any backend is reached (there is no mrc group object on that rank)
    sub = dist.new_group([0], backend="mrc")
    if RANK != 0:
        u = torch.ones(3)
        import warnings

        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            res = dist.all_reduce(u, group=sub)
        msgs["outside"] = str(w[0].message) if w else ""
        if res is not None or not torch.equal(u, torch.ones(3)):
            raise AssertionError(f"rank {RANK}: a call outside the group touched the tensor")
    dist.barrier()
    return {"messages": msgs}


def scenario_mismatch(out: Path) -> dict:
    """Tensors of different sizes on different ranks: a clear error, not a hang."""
    n = 10 + RANK  # every rank a different size
    t = torch.ones(n)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return {"error": f"{type(e).__name__}: {e}", "secs": time.monotonic() - start}
    raise AssertionError(f"rank {RANK}: all_reduce of {n} elements against other sizes succeeded")


def scenario_subgroups(out: Path) -> dict:
    """Groups whose rank 0 is not global rank 0 (on a fabric: another host, where
    MASTER_ADDR is not an address of its own), then the world group again."""
    ck = Check()
    n = 1001
    for case, members in enumerate(([1, 2], [1, 2, 3], [2, 3])):
        g = dist.new_group(members)  # every rank takes part in new_group
        if RANK not in members:
            continue
        for dtype in (torch.int64, torch.float32):
            xs = [data(r, n, dtype, case) for r in members]
            t = xs[members.index(RANK)].clone()
            dist.all_reduce(t, group=g)
            ck.exact(f"all_reduce over {members} {dtype}", t, rank_order(xs, "sum"))
    xs = [data(r, n, torch.float32, 9) for r in range(SIZE)]
    t = xs[RANK].clone()
    dist.all_reduce(t)
    ck.exact("all_reduce over the world", t, rank_order(xs, "sum"))
    return {"checks": ck.n}


def scenario_die(out: Path) -> dict:
    """The last rank exits mid-training; the others must fail within the group's timeout."""
    t = torch.ones(1000)
    dist.all_reduce(t)
    if RANK == SIZE - 1:
        (out / f"rank{RANK}.json").write_text(json.dumps({"died": True}))
        os._exit(0)
    start = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return {"error": f"{type(e).__name__}: {e}", "secs": time.monotonic() - start}
    raise AssertionError(f"rank {RANK}: all_reduce kept succeeding with a dead peer")


def scenario_lifecycle(out: Path) -> dict:
    """tcp:// (main()), then destroy and init again with an explicit store; a call no
    peer joins fails at the group's timeout; abort() fails pending work at once."""
    res: dict = {}
    t = torch.full((4,), float(RANK + 1))
    dist.all_reduce(t)
    res["tcp"] = t.tolist()
    dist.destroy_process_group()
    store = dist.FileStore(str(out / "store"), SIZE)
    dist.init_process_group("mrc", store=store, rank=RANK, world_size=SIZE)
    t = torch.full((4,), float(RANK + 1))
    dist.all_reduce(t)
    res["store"] = t.tolist()
    # a group with a 3 s timeout; rank 0 calls all_reduce on it, rank 1 does not
    g = dist.new_group(backend="mrc", timeout=timedelta(seconds=3))
    if RANK == 0:
        start = time.monotonic()
        w = dist.all_reduce(torch.ones(3), group=g, async_op=True)
        try:
            w.wait()
            res["timeout"] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            res["timeout"] = f"{type(e).__name__}: {e}"
        res["timeout_secs"] = time.monotonic() - start
        # abort from another thread fails a pending call at once
        import threading

        w = dist.all_reduce(torch.ones(3), async_op=True)
        start = time.monotonic()
        threading.Thread(target=dist.group.WORLD.abort).start()
        try:
            w.wait()
            res["abort"] = "no error"
        except Exception as e:  # noqa: BLE001
            res["abort"] = f"{type(e).__name__}: {e}"
        res["abort_secs"] = time.monotonic() - start
        store.set("rank0_done", "1")
    else:
        store.wait(["rank0_done"], timedelta(seconds=60))  # the peer that never joins
    return res


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    timeout = float(os.environ.get("MRC_TEST_TIMEOUT", "30"))
    dist.init_process_group(
        "mrc",
        init_method=os.environ.get("MRC_TEST_INIT", "env://"),  # env://: mrc-run's
        rank=RANK,
        world_size=SIZE,
        timeout=timedelta(seconds=timeout),
    )
    result = globals()[f"scenario_{scenario}"](out)
    (out / f"rank{RANK}.json").write_text(json.dumps(result))
    if scenario in ("die", "mismatch", "lifecycle"):
        os._exit(0)  # the group is broken; do not wait on its shutdown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
