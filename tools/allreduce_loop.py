"""One rank of `make demo`'s collective part, started by mrc-run (tools/demo.py).

    allreduce_loop.py MAX FAIL_AT HOLD [--inject]

Every rank all-reduces the same 4 MiB float32 input every time (a function of its rank),
hashes each result and goes on until the schedule went resilient and came back to the
healthy one (then TAIL more operations), at most MAX operations. The schedule is agreed,
so every rank stops after the same operation. Rank 0 prints one JSON line per operation
(schedule, shares, time, hash; the agreed bandwidths when they changed) for the demo to
show as it goes; every rank prints its hashes and schedules at the end.

The plane failure: on a fabric the demo pulls h1's plane-1 cable itself when rank 0 has
finished operation FAIL_AT - 1 (counted from 1) and plugs it back once rank 0 reports HOLD resilient
operations. With --inject (loopback planes, no namespaces) rank 1 does the same to its own
endpoint with Endpoint.inject(1, down=True): it starts operation FAIL_AT asynchronously and
cuts the plane while the operation runs, and heals it (down=False) between operations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time

import numpy as np

import mrc
from mrc.collectives.simulate import reference

# 4 MiB + one element: every 4th operation is an exchange point (one per
# DEFAULT_EXCHANGE_BYTES, 16 MiB, of all_reduce data: the switch comes up to 3 operations
# after the cut), and not a multiple of 4 ranks, so the shares' element bounds are uneven.
COUNT = (4 << 20) // 4 + 1
TAIL = 2  # healthy operations after the switch back, to show it stays
FAILED_RANK, FAILED_PLANE = 1, 1  # h1's plane 1


def data(rank: int) -> np.ndarray:
    return np.random.default_rng(2000 + rank).standard_normal(COUNT, dtype=np.float32)


def reference_sha(size: int) -> str:
    """What a healthy run gives: the fixed rank order ((x0 + x1) + x2) + ... in float32
    (the collectives' own numpy reference)."""
    acc = reference([data(r) for r in range(size)], "float32", "sum")
    return hashlib.sha256(acc.tobytes()).hexdigest()


def emit(doc: dict[str, object]) -> None:
    print(json.dumps(doc), flush=True)  # one write per line: mrc-run prefixes each


def main() -> None:
    limit, fail_at, hold = (int(a) for a in sys.argv[1:4])
    inject = "--inject" in sys.argv[4:]
    # The planner's INFO lines (agreements, schedule switches) to stderr, for the demo.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("mrc.collectives.resilient").setLevel(logging.INFO)
    comm = mrc.Communicator.from_env()
    ep = comm.endpoint
    x = data(comm.rank)
    out = np.empty_like(x)
    hashes: list[str] = []
    schedules: list[str] = []
    epoch = -1
    resilient_ops = 0
    healed = False
    ok = False
    for i in range(limit):
        op = i + 1  # counted from 1, as the planner's log counts all_reduces
        cut_here = inject and comm.rank == FAILED_RANK and op == fail_at
        t0 = time.monotonic()
        if cut_here:
            # The cut lands while the operation runs: it completes on the other planes.
            work = comm.all_reduce(x, out, async_op=True)
            ep.inject(FAILED_PLANE, down=True)
            emit({"event": "inject", "op": op, "plane": FAILED_PLANE, "down": True})
            work.wait(60)
        else:
            comm.all_reduce(x, out)
        ms = (time.monotonic() - t0) * 1e3
        hashes.append(hashlib.sha256(out.tobytes()).hexdigest())
        st = comm.stats()["resilient"]
        name = st["schedule"]["schedule"]
        schedules.append(name)
        resilient_ops += name == "resilient"
        if comm.rank == 0:
            doc: dict[str, object] = {
                "op": op,
                "schedule": name,
                "shares": st["schedule"]["shares"],
                "ms": round(ms, 2),
                "sha": hashes[-1],
            }
            if st["epoch"] != epoch:
                doc["agreed"] = st["agreed"]
            emit(doc)
        epoch = st["epoch"]
        if inject and comm.rank == FAILED_RANK and resilient_ops == hold and not healed:
            ep.inject(FAILED_PLANE, down=False)
            healed = True
            emit({"event": "inject", "op": op, "plane": FAILED_PLANE, "down": False})
        # Resilient at least once, and the latest TAIL + 1 healthy: switched back, stays.
        if resilient_ops and schedules[-TAIL - 1 :] == ["equal"] * (TAIL + 1):
            ok = True
            break
    emit({"rank": comm.rank, "ok": ok, "hashes": hashes, "schedules": schedules})
    comm.close()
    sys.exit(0 if ok else 3)


if __name__ == "__main__":
    main()
