"""One rank of the collective benchmarks, the same timing loop for mrc, Gloo and Open MPI.

    coll_worker.py BACKEND COLL --sizes 8,1024,... [--iters N] [--warmup W]
    coll_worker.py BACKEND all_reduce --loop N --sizes S [--shares a,b,c,d] [--random]

COLL: all_reduce, all_gather, reduce_scatter, broadcast or barrier (its size: 0).
BACKEND is mrc (mrc.Communicator.from_env(), under mrc-run), gloo (torch.distributed,
GLOO_SOCKET_IFNAME from the launcher, ranks from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT)
or mpi (mpi4py under mpirun). Sizes are bytes of the buffer as nccl-tests counts them (the
gathered output for all_gather, the input for reduce_scatter), float32.

Sweep: per size, warm-up, barrier, `iters` back-to-back operations; the time is the mean
per operation averaged over the ranks (nccl-tests' -a 1), CPU is each rank's process CPU
time over the timed loop (user + system; summed over ranks: cores the ranks used), and
rank 0 reads the machine's busy cores from /proc/stat over the same loop (the kernel's
forwarding in the switch namespaces shows there, and so does any other load). Results are
checked once per size: inputs are small integers, so every reduction order gives the same
exact sum. Rank 0 prints one JSON line per size.

Loop (--loop N): N all_reduces of one size, rank 0 prints one JSON line per operation
(its time, mrc's schedule, the result's hash) as soon as it ends, so that a controller can
pull a cable mid-loop; --random uses random floats (the hash then shows the bits).

MRC_BENCH_BIND=core in the environment (collectives_fabric.py --bind core): every backend's
rank r is bound, before any import can start a thread, to the cores mrc-run --bind-to core
gives rank r (mrc.run.core_blocks), so that all three run under the same binding.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def _bind() -> None:
    if os.environ.get("MRC_BENCH_BIND") != "core":
        return
    env = os.environ
    rank = int(env.get("RANK") or env.get("OMPI_COMM_WORLD_RANK") or 0)
    n = int(env.get("WORLD_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or 1)
    cpus = sorted(os.sched_getaffinity(0))  # mrc.run.core_blocks, without its imports
    k = len(cpus) // n if n < len(cpus) else 0
    os.sched_setaffinity(0, set(cpus[rank * k : (rank + 1) * k]) if k else {cpus[rank % len(cpus)]})


_bind()

import click  # noqa: E402 (after the binding: imports may start threads)
import numpy as np  # noqa: E402

from mrc.perf.coll import busbw_factor  # noqa: E402
from mrc.perf.stats import machine_jiffies  # noqa: E402

COLLS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier")


def machine_busy() -> tuple[float, float]:
    """(busy jiffies, total jiffies) over all CPUs, from /proc/stat (busy: neither
    idle, iowait nor stolen by the hypervisor)."""
    total, busy, _ = machine_jiffies()
    return float(busy), float(total)


class Backend:
    rank: int
    size: int

    def barrier(self) -> None: ...
    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray: ...
    def op(self, coll: str, send: np.ndarray, recv: np.ndarray) -> Callable[[], None]: ...
    def schedule(self) -> str | None:
        return None

    def ran(self) -> str | None:
        """mrc: the executor's schedule of the last call (tree, gather, ...)."""
        return None

    def plan(self) -> dict[str, Any] | None:
        """mrc's planner: the last all_reduce's shares, its predicted time and the hosts'
        rate it planned with (None elsewhere)."""
        return None

    def close(self) -> None: ...


class MrcBackend(Backend):
    def __init__(self, shares: list[float] | None) -> None:
        import mrc

        self.comm = mrc.Communicator.from_env()
        self.rank, self.size = self.comm.rank, self.comm.size
        self.shares = shares

    def barrier(self) -> None:
        self.comm.barrier()

    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        self.comm.all_reduce(values, out, shares=None)
        return out

    def op(self, coll: str, send: np.ndarray, recv: np.ndarray) -> Callable[[], None]:
        c = self.comm
        if coll == "all_reduce":
            return lambda: c.all_reduce(send, recv, shares=self.shares)
        if coll == "all_gather":
            return lambda: c.all_gather(send, recv)
        if coll == "reduce_scatter":
            return lambda: c.reduce_scatter(send, recv)
        if coll == "barrier":
            return c.barrier
        return lambda: c.broadcast(send, 0)

    def ran(self) -> str | None:
        last = self.comm.collective_stats()["last"]
        return None if last is None else last["schedule"]

    def schedule(self) -> str | None:
        if self.shares is not None:
            return "given"
        st = self.comm.stats()["resilient"]
        return None if st is None or st["schedule"] is None else st["schedule"]["schedule"]

    def plan(self) -> dict[str, Any] | None:
        st = self.comm.stats()["resilient"]
        if self.shares is not None or st is None or st["schedule"] is None:
            return None
        host = None if st["agreed"] is None else st["agreed"]["host_rate"]
        return {
            "shares": st["schedule"]["shares"],
            "predicted_s": st["schedule"]["predicted_s"],
            "host_rate_gbps": None if host is None else host * 8e-9,
            "host_busy": st.get("host_busy"),
        }

    def close(self) -> None:
        self.comm.close()


class GlooBackend(Backend):
    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        host = f"[{addr}]" if ":" in addr else addr
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        self.dist.barrier()

    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        t = self.torch.from_numpy(values.copy())
        self.dist.all_reduce(t)
        return t.numpy()

    def op(self, coll: str, send: np.ndarray, recv: np.ndarray) -> Callable[[], None]:
        d, s, r = self.dist, self.torch.from_numpy(send), self.torch.from_numpy(recv)
        if coll == "all_reduce":

            def run() -> None:
                r.copy_(s)  # out of place, as mrc's and MPI's
                d.all_reduce(r)

            return run
        if coll == "all_gather":
            return lambda: d.all_gather_into_tensor(r, s)
        if coll == "reduce_scatter":
            return lambda: d.reduce_scatter_tensor(r, s)
        if coll == "barrier":
            return d.barrier
        return lambda: d.broadcast(s, 0)

    def close(self) -> None:
        self.dist.destroy_process_group()


class MpiBackend(Backend):
    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        self.comm.Allreduce(values, out, op=self.MPI.SUM)
        return out

    def op(self, coll: str, send: np.ndarray, recv: np.ndarray) -> Callable[[], None]:
        c, SUM = self.comm, self.MPI.SUM
        if coll == "all_reduce":
            return lambda: c.Allreduce(send, recv, op=SUM)
        if coll == "all_gather":
            return lambda: c.Allgather(send, recv)
        if coll == "reduce_scatter":
            return lambda: c.Reduce_scatter_block(send, recv, op=SUM)
        if coll == "barrier":
            return c.Barrier
        return lambda: c.Bcast(send, root=0)


def buffers(coll: str, nbytes: int, n: int, rank: int, rnd: bool) -> tuple[Any, Any, Any]:
    """(send, recv, expected recv) for `nbytes` as nccl-tests counts them."""
    if coll == "barrier":
        empty = np.zeros(0, np.float32)
        return empty, empty, empty
    count = max(1, nbytes // 4)
    if coll in ("all_gather", "reduce_scatter"):
        count = max(1, count // n)  # per-rank block
    big = count * n

    def inp(r: int, c: int) -> np.ndarray:
        if rnd:
            return np.random.default_rng(100 + r).standard_normal(c, dtype=np.float32)
        return ((np.arange(c) % 7) + r).astype(np.float32)

    if coll == "all_reduce":
        send, recv = inp(rank, count), np.zeros(count, np.float32)
        want = inp(0, count).copy()
        for r in range(1, n):
            want += inp(r, count)  # rank order: what mrc promises bit for bit
        return send, recv, want
    if coll == "all_gather":
        return (
            inp(rank, count),
            np.zeros(big, np.float32),
            np.concatenate([inp(r, count) for r in range(n)]),
        )
    if coll == "reduce_scatter":
        want = inp(0, big).copy()
        for r in range(1, n):
            want += inp(r, big)
        return inp(rank, big), np.zeros(count, np.float32), want[rank * count : (rank + 1) * count]
    buf = inp(0, count) if rank == 0 else np.zeros(count, np.float32)
    return buf, buf, inp(0, count)


def out_bytes(coll: str, send: np.ndarray, recv: np.ndarray) -> int:
    """nccl-tests' size: the gathered output for all_gather, else the input."""
    return recv.nbytes if coll == "all_gather" else send.nbytes


def sweep(be: Backend, coll: str, sizes: list[int], iters: int, warmup: int) -> None:
    for nbytes in sizes:
        send, recv, want = buffers(coll, nbytes, be.size, be.rank, False)
        run = be.op(coll, send, recv)
        run()
        got = send if coll == "broadcast" else recv
        wrong = int(np.count_nonzero(got != want))
        for _ in range(warmup):
            run()
        be.barrier()
        b0 = machine_busy()
        c0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        secs = (time.perf_counter() - t0) / iters
        cpu = (time.process_time() - c0) / iters
        b1 = machine_busy()
        sched = be.schedule()  # before sum_over_ranks: that is an all_reduce of its own
        ran = be.ran()
        plan = be.plan()
        tot = be.sum_over_ranks(np.array([secs, cpu, float(wrong)], dtype=np.float64))
        if be.rank == 0:
            t = float(tot[0]) / be.size
            size = out_bytes(coll, send, recv)
            algbw = size / t
            busy = (b1[0] - b0[0]) / max(1.0, b1[1] - b0[1]) * (os.cpu_count() or 1)
            print(
                json.dumps(
                    {
                        "coll": coll,
                        "size": size,
                        "time_us": t * 1e6,
                        "algbw_gbps": algbw * 8e-9,
                        "busbw_gbps": algbw * busbw_factor(coll, be.size) * 8e-9,
                        "rank_cpu_cores": float(tot[1]) / t,  # summed over the ranks
                        "machine_busy_cores": busy,
                        "wrong": int(tot[2]),
                        "schedule": sched,
                        "ran": ran,
                        "plan": plan,
                    }
                ),
                flush=True,
            )


def loop(be: Backend, nbytes: int, n_ops: int, rnd: bool) -> None:
    send, recv, want = buffers("all_reduce", nbytes, be.size, be.rank, rnd)
    run = be.op("all_reduce", send, recv)
    run()
    be.barrier()
    for i in range(n_ops):
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        if be.rank == 0:
            print(
                json.dumps(
                    {
                        "op": i,
                        "time_s": dt,
                        "schedule": be.schedule(),
                        "sha": hashlib.sha256(recv.tobytes()).hexdigest()[:16],
                        "exact": bool(np.array_equal(recv, want)),
                    }
                ),
                flush=True,
            )


@click.command()
@click.argument("backend", type=click.Choice(["mrc", "gloo", "mpi"]))
@click.argument("coll", type=click.Choice(COLLS))
@click.option("--sizes", required=True, help="Comma-separated bytes.")
@click.option("--iters", default=5, show_default=True)
@click.option("--warmup", default=1, show_default=True)
@click.option("--loop", "n_loop", type=int, default=0, help="Per-op loop of this many ops.")
@click.option("--shares", default=None, help="mrc: all_reduce shares, comma-separated.")
@click.option("--random", "rnd", is_flag=True, help="Loop: random floats, not integers.")
def main(
    backend: str,
    coll: str,
    sizes: str,
    iters: int,
    warmup: int,
    n_loop: int,
    shares: str | None,
    rnd: bool,
) -> None:
    sh = None if shares is None else [float(x) for x in shares.split(",")]
    be: Backend
    if backend == "mrc":
        be = MrcBackend(sh)
    elif backend == "gloo":
        be = GlooBackend()
    else:
        be = MpiBackend()
    size_list = [int(s) for s in sizes.split(",")]
    if n_loop:
        loop(be, size_list[0], n_loop, rnd)
    else:
        sweep(be, coll, size_list, iters, warmup)
    be.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
