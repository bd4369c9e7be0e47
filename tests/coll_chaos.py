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
import time
import traceback
from typing import Any

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

    outcome: list[Any] = [None] * N
    errors_at: list[float | None] = [None] * N
    fault_at: list[float] = []
    bad: list[str] = []

    def rank_main(r: int) -> None:
        done = 0
        try:
            for i in range(CALLS):
                if not soak.run(comms[r], seed, soak.call(seed, i, N, MAX_BYTES)):
                    bad.append(f"rank {r}: call {i} gave wrong bits")
                done += 1
            outcome[r] = ("done", done)
        except mrc.MrcError as e:
            errors_at[r] = time.monotonic()
            outcome[r] = (type(e).__name__, done, str(e)[:200])
        except BaseException:
            outcome[r] = ("UNEXPECTED", done)
            bad.append(f"rank {r}:\n{traceback.format_exc()}")

    def do_fault() -> None:
        time.sleep(delay)  # the fault's moment, drawn from the seed (not a synchronisation)
        c = comms[victim]
        fault_at.append(time.monotonic())
        try:
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
        except mrc.MrcError:
            pass  # e.g. close() raising the failure it waited for
        except BaseException:
            bad.append(f"fault {fault}:\n{traceback.format_exc()}")

    t0 = time.monotonic()
    ranks = [threading.Thread(target=rank_main, args=(r,)) for r in range(N)]
    chaos = threading.Thread(target=do_fault)
    for t in [*ranks, chaos]:
        t.start()
    for t in [*ranks, chaos]:
        t.join(TIMEOUT * 4 + 30)
        if t.is_alive():
            bad.append("a thread still runs after 4x the timeout")
    took = time.monotonic() - t0
    if fault in SURVIVABLE:
        for r, o in enumerate(outcome):
            if o != ("done", CALLS):
                bad.append(f"rank {r} after a {fault} fault: {o}")
    for r, o in enumerate(outcome):
        if o is None:
            bad.append(f"rank {r}: no outcome")
        at = errors_at[r]
        if at is not None and fault_at and at - fault_at[0] >= TIMEOUT:
            bad.append(f"rank {r} raised {at - fault_at[0]:.1f} s after the fault: {o}")
    # Close what is left, every rank at once (close() is collective).
    closers = [threading.Thread(target=c.close) for c in comms]
    for t in closers:
        t.start()
    for t in closers:
        t.join(TIMEOUT * 2 + 30)
        if t.is_alive():
            bad.append("close() still runs after 2x the timeout")
    for b in bad:
        print(b, file=sys.stderr)
    summary = [o[:2] if o else o for o in outcome]
    if "-v" in sys.argv:
        print(outcome)
    print(f"seed {seed}: {fault} on rank {victim} after {delay:.2f} s; {took:.1f} s; "
          f"{summary}; {len(bad)} failed")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
