"""One rank of the communicator tests, run as its own process by tests/test_communicator.py.

    python tests/comm_worker.py MODE RANK SIZE UID [TIMEOUT]   ("env": from the environment)

Prints one JSON line: {"rank", "ok", ...} or {"rank", "error", "type", "err_rank", "secs"}.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

import mrc

NBYTES = 100_003  # not a multiple of any MSS or chunk


def pattern(src: int, dst: int) -> np.ndarray:
    return np.random.default_rng(1000 * src + dst).integers(0, 256, NBYTES, dtype=np.uint8)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def exchange(comm: mrc.Communicator) -> dict[str, str]:
    """Every connection carries one checked SEND each way: rank r sends pattern(r, p) to
    every peer p, and checks what it got from p against pattern(p, r)."""
    ep = comm.endpoint
    recvs, sends, keep = {}, [], []
    for p, conn in enumerate(comm.peers):
        if conn is None:
            continue
        buf = np.zeros(NBYTES, dtype=np.uint8)
        mr = ep.register(buf)
        keep += [buf, mr]
        recvs[p] = (buf, conn.recv(mr, tag=7))
    for p, conn in enumerate(comm.peers):
        if conn is None:
            continue
        data = pattern(comm.rank, p)
        mr = ep.register(data)
        keep += [data, mr]
        sends.append(conn.send(mr, tag=7))
    for op in sends:
        op.wait(comm.timeout)
    got = {}
    for p, (buf, op) in recvs.items():
        op.wait(comm.timeout)
        if sha(buf) != sha(pattern(p, comm.rank)):
            raise AssertionError(f"rank {comm.rank}: data from rank {p} differs")
        got[str(p)] = sha(buf)
    return got


def wait_for_failure(comm: mrc.Communicator, peer: int) -> None:
    """A RECV from `peer` that never comes: it ends when the communicator learns of a
    failure (the rendezvous) or the transport gives up on the connection."""
    buf = np.zeros(16, dtype=np.uint8)
    mr = comm.endpoint.register(buf)
    conn = comm.peers[peer]
    assert conn is not None
    op = conn.recv(mr, tag=99)
    deadline = time.monotonic() + comm.timeout * 2
    while time.monotonic() < deadline:
        comm.check_failure()
        try:
            op.wait(0.05)
        except mrc.TimeoutError:
            continue
        except mrc.MrcError as e:
            raise comm.peer_error(peer, e) from e
    raise AssertionError("no failure seen")


def collectives(comm: mrc.Communicator) -> dict[str, int]:
    """Real collectives across the processes, each output checked bit for bit against
    the rank-order numpy reference of mrc-perf (every rank computes it itself)."""
    from mrc.perf.coll import make_case, wrong

    n, res = comm.size, {}
    cases = [
        ("all_reduce", "float32", "sum"),
        ("all_reduce", "int32", "prod"),
        ("all_reduce", "bfloat16", "avg"),
        ("all_reduce", "float16", "max"),
        ("reduce", "float64", "min"),
        ("broadcast", "int8", "sum"),
        ("all_gather", "uint8", "sum"),
        ("reduce_scatter", "float32", "sum"),
        ("alltoall", "int64", "sum"),
        ("sendrecv", "float32", "sum"),
    ]
    for coll, dtype, op in cases:
        for nbytes in (0, 8, 4 * 1001 * n):
            for inplace in (False, True):
                case = make_case(comm, coll, nbytes, dtype, op, n - 1, inplace)
                if case is None:
                    continue
                case.reset()
                case.run()
                key = f"{coll}/{dtype}/{op}/{nbytes}/{'in' if inplace else 'out'}"
                res[key] = 0 if case.want is None else wrong(case.out, case.want)
    comm.barrier()
    return res


def die_mid_collective(comm: mrc.Communicator, dead: int) -> None:
    """Every rank runs 64 MiB all_reduces; rank `dead` starts one and exits in the middle."""
    buf = np.ones(16 << 20, dtype=np.float32)
    comm.all_reduce(buf)
    if comm.rank == dead:
        comm.all_reduce(buf, async_op=True)
        os._exit(3)
    for _ in range(1000):
        comm.all_reduce(buf)


def main() -> None:
    mode, uid = sys.argv[1], sys.argv[4]
    # Under mrc-run: "env" for rank, size and id.
    rank = int(os.environ["RANK"]) if sys.argv[2] == "env" else int(sys.argv[2])
    size = int(os.environ["WORLD_SIZE"]) if sys.argv[3] == "env" else int(sys.argv[3])
    timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 10.0
    if os.environ.get("COMM_WAIT_GO"):
        # Imports done: the test starts every rank's clock at once (a loaded machine takes
        # seconds to start Python, more than the short timeouts the error tests use).
        print(json.dumps({"rank": rank, "ready": True}), flush=True)
        sys.stdin.readline()
    t0 = time.monotonic()
    out: dict[str, object] = {"rank": rank}
    try:
        if uid == "env":
            comm = (
                mrc.Communicator.from_env()
                if timeout == 0
                else mrc.Communicator.from_env(timeout=timeout)
            )
        else:
            comm = mrc.Communicator(rank, size, bytes.fromhex(uid), timeout=timeout)
        out["setup_s"] = time.monotonic() - t0
        with comm:
            if mode == "mesh":
                out["got"] = exchange(comm)
                out["npaths"] = [c.npaths if c else 0 for c in comm.peers]
                out["fabric_info"] = comm.fabric_info
                out["routes"] = comm.stats()["routes"]
            elif mode == "die":
                exchange(comm)
                print(json.dumps({"rank": rank, "dying": True}), flush=True)
                os._exit(3)
            elif mode == "coll":
                out["wrong"] = collectives(comm)
            elif mode == "coll_die":
                t1 = time.monotonic()
                try:
                    die_mid_collective(comm, int(os.environ["DEAD_RANK"]))
                finally:
                    out["secs"] = time.monotonic() - t1
            elif mode == "mesh_hold":  # until the test kills or stops it, or the group fails
                exchange(comm)
                print(json.dumps({"rank": rank, "holding": True}), flush=True)
                comm._failed_ev.wait(120)
                if comm.failure is not None:
                    raise comm.failure
            elif mode == "p2p_chain":  # rank 1 sends to the held rank, the other waits on 1
                hung = int(os.environ.get("HUNG_RANK", "2"))
                exchange(comm)
                print(json.dumps({"rank": rank, "meshed": True}), flush=True)
                sys.stdin.readline()  # the test has stopped the held rank
                t1 = time.monotonic()
                try:
                    if rank == 1:
                        comm.send(np.zeros(1 << 20, np.uint8), hung)
                    else:
                        comm.recv(np.zeros(1 << 20, np.uint8), 1)
                finally:
                    out["secs"] = time.monotonic() - t1
            elif mode == "survive":
                exchange(comm)
                t1 = time.monotonic()
                try:
                    wait_for_failure(comm, int(os.environ["DEAD_RANK"]))
                finally:
                    out["secs"] = time.monotonic() - t1
            out["ok"] = True
    except Exception as e:
        out.update(error=str(e), type=type(e).__name__, err_rank=getattr(e, "rank", None))
        out.setdefault("secs", time.monotonic() - t0)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
