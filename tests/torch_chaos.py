"""The torch backend under a fault at a random moment: 3 process groups in threads.

    python torch_chaos.py SEED [FAULT]

Three mrc Communicators in one process, each under a ProcessGroupMRC (the backend's
group object, as torch.distributed would make it). Each rank issues the same random
calls (all_reduce, broadcast, all_gather, reduce_scatter, all_to_all, barrier), a few at
a time with async works waited in a random order, some never waited for, some through
their futures, while another thread, at a random moment, does one thing to one rank
(FAULT, or one drawn from SEED): abort() its group, shut it down, close its endpoint,
pull one of its two planes, or wait on one of its works with a tiny timeout.

What must hold: no completed work holds a wrong value; with a pulled plane or a tiny
wait every rank finishes; otherwise every rank finishes or gets an exception (never a
crash or a hang), sooner than the group's timeout after the fault; shutting every group
down afterwards works. Prints one line; exit status 1 when something did not hold."""

from __future__ import annotations

import faulthandler
import random
import sys
import threading
from datetime import timedelta
from typing import Any

import torch
from chaos_harness import Chaos

import mrc
from mrc.torch.process_group import ProcessGroupMRC

N, ROUNDS = 3, 40
TIMEOUT = 5.0
FAULTS = ("abort", "shutdown", "endpoint", "plane", "short_wait")
SURVIVABLE = ("plane", "short_wait")


def calls(seed: int, i: int) -> list[tuple[str, int]]:
    """Round i: the same (kind, size) calls on every rank."""
    rng = random.Random(seed * 1000 + i)
    kinds = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier"]
    return [(rng.choice(kinds), rng.choice([1, 7, 1000, 50_000])) for _ in range(rng.randint(1, 4))]


def issue(pg: ProcessGroupMRC, rank: int, kind: str, n: int, tag: float) -> tuple[Any, Any]:
    """Issues one call; returns (work, check) where check() says whether the result is right."""
    base = torch.arange(n, dtype=torch.float32) + tag
    if kind == "all_reduce":
        t = base * (rank + 1)
        return pg.allreduce([t]), lambda: torch.equal(t, base * 6)
    if kind == "broadcast":
        t = base.clone() if rank == 0 else torch.zeros(n)
        return pg.broadcast([t]), lambda: torch.equal(t, base)
    if kind == "all_gather":
        outs = [torch.zeros(n) for _ in range(N)]
        w = pg.allgather([outs], [base + rank])
        return w, lambda: all(torch.equal(o, base + r) for r, o in enumerate(outs))
    if kind == "reduce_scatter":
        out = torch.zeros(n)
        w = pg.reduce_scatter([out], [[base + r * (rank + 1) for r in range(N)]])
        return w, lambda: torch.equal(out, 3 * base + rank * 6)
    if kind == "all_to_all":
        inp = torch.cat([base + 10 * rank + r for r in range(N)])
        out = torch.zeros(N * n)
        w = pg.alltoall_base(out, inp, [], [])
        return w, lambda: all(
            torch.equal(out[r * n : (r + 1) * n], base + 10 * r + rank) for r in range(N)
        )
    return pg.barrier(), lambda: True


def main() -> int:
    seed = int(sys.argv[1])
    rng = random.Random(seed)
    fault = sys.argv[2] if len(sys.argv) > 2 else rng.choice(FAULTS)
    victim, delay = rng.randrange(N), rng.uniform(0.0, 0.3)
    faulthandler.dump_traceback_later(120, exit=True)  # a hang: every thread's stack
    uid = mrc.get_unique_id()
    pgs: list[Any] = [None] * N

    def make(r: int) -> None:
        try:
            comm = mrc.Communicator(r, N, uid, timeout=TIMEOUT, planes=2,
                                    endpoint={"timeout": 2.0})  # fmt: skip
            pgs[r] = ProcessGroupMRC(comm, r, N, timedelta(seconds=TIMEOUT))
        except BaseException as e:  # reported below
            pgs[r] = e

    ts = [threading.Thread(target=make, args=(r,)) for r in range(N)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if any(not isinstance(p, ProcessGroupMRC) for p in pgs):
        print(f"seed {seed}: set-up failed: {pgs}")
        return 1

    ch = Chaos(N, TIMEOUT, (Exception,))
    issued: list[list[Any]] = [[] for _ in range(N)]

    def rank_main(r: int) -> None:
        pg, rr = pgs[r], random.Random(seed * 7 + r)
        done = 0
        try:
            for i in range(ROUNDS):
                batch = [issue(pg, r, k, n, float(i)) for k, n in calls(seed, i)]
                issued[r].extend(w for w, _ in batch)
                order = list(range(len(batch)))
                rr.shuffle(order)
                for j in order:
                    w, check = batch[j]
                    x = rr.random()
                    if x < 0.15 and j != order[-1]:
                        continue  # never waited for (torch allows it)
                    if x < 0.3:
                        w.get_future().wait()
                    else:
                        w.wait()
                    if not check():
                        ch.bad.append(f"rank {r}: round {i} call {j} gave a wrong value")
                done += 1
            ch.ended(r, done)
        except BaseException as e:  # judged by the harness: an expected error or a failure
            ch.ended(r, done, e)

    def do_fault() -> None:
        pg = pgs[victim]
        if fault == "abort":
            pg.abort()
        elif fault == "shutdown":
            pg.shutdown()
        elif fault == "endpoint":
            pg.communicator.endpoint.close()
        elif fault == "plane":
            pg.communicator.endpoint.inject(rng.randrange(2), down=True)
        else:
            for w in list(issued[victim][-3:]):
                w.wait(timedelta(milliseconds=1))  # may time out: the fault's own error

    took = ch.run(rank_main, do_fault, delay)
    ch.judge(fault, fault in SURVIVABLE, ROUNDS)
    ch.close([pg.shutdown for pg in pgs], "shutdown()")
    return ch.report(f"seed {seed}: {fault} on rank {victim} after {delay:.2f} s", took)


if __name__ == "__main__":
    sys.exit(main())
