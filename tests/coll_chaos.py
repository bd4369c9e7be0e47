"""A fault at a random moment under random collectives: 3 communicators in threads.

    python coll_chaos.py SEED [FAULT]

The ranks make the same random calls (mrc.collectives.soak: every collective, op and
dtype, up to 64 KiB, each checked bit for bit against numpy in rank order) while
another thread, at a random moment, does one thing to one rank (FAULT, or one drawn
from SEED): abort() its communicator, close() it, close its endpoint or one of its
connections, pull one of its two planes, or drop 5% of a plane's packets.

What must hold: no result is ever wrong; with a plane pulled or lossy every rank
finishes every call; otherwise every rank finishes or raises an mrc error, sooner
than the communicator's timeout after the fault (a rank that gave up tells the others
at once: none waits out its timeout for it); closing everything afterwards works. A crash is the
process dying by a signal. Prints one line; exit status 1 when something did not hold."""

from __future__ import annotations

import faulthandler
import os
import random
import sys
import threading
from typing import Any

from chaos_harness import Chaos

import mrc
from mrc.collectives import soak

N, CALLS, MAX_BYTES = int(os.environ.get("CHAOS_RANKS", 3)), 100, 64 << 10
TIMEOUT = 5.0  # the communicator's; the endpoint's is 2 s
FAULTS = ("abort", "close", "endpoint", "connection", "plane", "loss")
SURVIVABLE = ("plane", "loss")


def main() -> int:
    seed = int(sys.argv[1])
    rng = random.Random(seed)
    args = [a for a in sys.argv[2:] if a != "-v"]
    fault = args[0] if args else rng.choice(FAULTS)
    victim, delay = rng.randrange(N), rng.uniform(0.0, 0.3)
    faulthandler.dump_traceback_later(120, exit=True)  # a hang: every thread's stack
    uid = mrc.get_unique_id()
    comms: list[Any] = [None] * N

    def make(r: int) -> None:
        try:
            comms[r] = mrc.Communicator(r, N, uid, timeout=TIMEOUT, planes=2,
                                        endpoint={"timeout": 2.0})  # fmt: skip
        except BaseException as e:  # reported below
            comms[r] = e

    ts = [threading.Thread(target=make, args=(r,)) for r in range(N)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if any(not isinstance(c, mrc.Communicator) for c in comms):
        print(f"seed {seed}: set-up failed: {comms}")
        return 1

    ch = Chaos(N, TIMEOUT, (mrc.MrcError,))

    def rank_main(r: int) -> None:
        done = 0
        try:
            for i in range(CALLS):
                if not soak.run(comms[r], seed, soak.call(seed, i, N, MAX_BYTES)):
                    ch.bad.append(f"rank {r}: call {i} gave wrong bits")
                done += 1
            ch.ended(r, done)
        except BaseException as e:  # judged by the harness: an expected error or a failure
            ch.ended(r, done, e)

    def do_fault() -> None:
        c = comms[victim]
        if fault == "abort":
            c.abort("chaos")
        elif fault == "close":
            c.close()
        elif fault == "endpoint":
            c.endpoint.close()
        elif fault == "connection":
            c.peers[(victim + 1) % N].close()
        elif fault == "plane":
            c.endpoint.inject(rng.randrange(2), down=True)
        else:
            c.endpoint.inject(rng.randrange(2), loss=0.05)

    took = ch.run(rank_main, do_fault, delay)
    ch.judge(fault, fault in SURVIVABLE, CALLS)
    ch.close([c.close for c in comms], "close()")
    return ch.report(f"seed {seed}: {fault} on rank {victim} after {delay:.2f} s", took)


if __name__ == "__main__":
    sys.exit(main())
