"""One rank of tests/test_resilient.py, started by mrc-run in its fabric host's namespace.

    resilient_worker.py loop N        N all_reduces
    resilient_worker.py heal MAX      all_reduces until the schedule went resilient and came
                                      back to equal (at most MAX); rank 0 prints each
                                      operation's schedule as it goes, for the test to pull
                                      and heal the cable at the right moments
    resilient_worker.py until MAX     all_reduces until the file MRC_TEST_STOP_FILE exists
                                      (at most MAX; the ranks agree on it after each
                                      operation with a 1-element max all_reduce); rank 0
                                      prints each operation's schedule as it goes

Every rank all-reduces the same input every time (a function of its rank, of
MRC_TEST_COUNT elements, default COUNT; every other operation with async_op=True, so on
the collectives' worker thread), hashes each result and prints one JSON line at the
end: the hashes, the resilient planner's schedule of each operation, the executor's
schedule that ran it and the agreed planes when the schedule changed. The schedule is
agreed, so every rank stops after the same operation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

import numpy as np

import mrc

COUNT = 300_001  # not a multiple of 4 ranks, so the shares' element bounds are uneven


def data(rank: int, count: int = COUNT) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(count, dtype=np.float32)


def main() -> None:
    mode, limit = sys.argv[1], int(sys.argv[2])
    # The planner's INFO lines (new agreements, schedule switches) go to stderr: the test
    # reads them from mrc-run's output.
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    # As a launcher that sets only MASTER_ADDR (torchrun, Slurm) would: the fabric file
    # must then give rank 0's other planes.
    if os.environ.get("MRC_TEST_NO_MASTER_ADDRS"):
        os.environ.pop("MRC_MASTER_ADDRS", None)
    comm = mrc.Communicator.from_env()
    x = data(comm.rank, int(os.environ.get("MRC_TEST_COUNT", COUNT)))
    out = np.empty_like(x)
    hashes: list[str] = []
    schedules: list[str] = []
    ran: list[str] = []  # the executor's schedule of each operation (tree, chain, ...)
    planes: dict[int, list[list[int]]] = {}
    went_resilient = False
    ok = True
    stop_file = os.environ.get("MRC_TEST_STOP_FILE", "")
    flag = np.zeros(1, np.int32)
    for i in range(limit):
        if i % 2:
            # Async: the shares are chosen (and the exchange run) on the worker thread.
            comm.all_reduce(x, out, async_op=True).wait(60)
        else:
            comm.all_reduce(x, out)
        hashes.append(hashlib.sha256(out.tobytes()).hexdigest())
        ran.append(comm.collective_stats()["last"]["schedule"])
        st = comm.stats()["resilient"]
        name = st["schedule"]["schedule"] if st["schedule"] else "none"  # small: not planned
        if (not schedules or schedules[-1] != name) and st["agreed"] is not None:
            planes[i] = st["agreed"]["planes_up"]
        schedules.append(name)
        if comm.rank == 0 and mode in ("heal", "until"):
            print(json.dumps({"op": i, "schedule": name}), flush=True)
        went_resilient = went_resilient or name == "resilient"
        if mode == "heal" and went_resilient and name == "equal":
            break
        if mode == "until":
            flag[0] = os.path.exists(stop_file)
            comm.all_reduce(flag, op="max")
            if flag[0]:
                break
    else:
        ok = mode == "loop"
    result = {
        "rank": comm.rank,
        "ok": ok,
        "hashes": hashes,
        "schedules": schedules,
        "ran": ran,
        "planes": {str(k): v for k, v in planes.items()},
        "stats": comm.stats()["resilient"],
        "auto_layout": comm.collective_stats()["auto_layout"],
    }
    comm.close()
    print(json.dumps(result), flush=True)
    sys.exit(0 if ok else 3)


if __name__ == "__main__":
    main()
