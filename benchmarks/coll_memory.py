"""Peak memory of a large all_reduce, per rank: N processes on loopback planes
(one endpoint each, every pair connected), each all-reduces SIZE bytes of
float32 in place and reports its peak RSS above the buffer itself, the
executor's scratch rings and the transport's staged bytes. Results are checked
against the rank-order reference (sha256 of every rank's result).

    .venv/bin/python benchmarks/coll_memory.py [--ranks 4] [--mib 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import resource
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import mrc
from mrc.collectives.ops import Collectives


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


class Rank(Collectives):
    def __init__(self, rank: int, size: int, ep: mrc.Endpoint, peers: list[Any]) -> None:
        self.rank, self.size, self.endpoint, self.peers = rank, size, ep, peers
        self.timeout = 120.0
        self._collectives_init()


def rank_main(rank: int, n: int, mib: int, ports: Any, barrier: Any, out: Any) -> None:
    ep = mrc.Endpoint([f"127.0.{70 + rank}.{i + 1}" for i in range(2)], timeout=30)
    ports[rank] = ep.listen()
    barrier.wait()
    peers: list[Any] = [None] * n

    def accept() -> None:
        for _ in range(rank):
            c = ep.accept(timeout=30)
            peers[int(c.peer_name)] = c

    t = threading.Thread(target=accept)
    t.start()
    for j in range(rank + 1, n):
        peers[j] = ep.connect(f"127.0.{70 + j}.1", ports[j], timeout=30, name=str(rank))
    t.join()
    barrier.wait()
    count = mib * 2**20 // 4
    x = np.random.default_rng(rank).standard_normal(count, dtype=np.float32)
    base = current_rss_mib()
    comm = Rank(rank, n, ep, peers)
    comm.barrier()
    staged = {"peak": 0, "run": True}

    def sample() -> None:  # the transport's bytes held for RECVs not yet posted
        while staged["run"]:
            staged["peak"] = max(staged["peak"], ep.stats()["staged_bytes"])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    msgs0 = ep.stats()["staged_msgs"]
    sampler.start()
    t0 = time.perf_counter()
    comm.all_reduce(x)
    dt = time.perf_counter() - t0
    staged["run"] = False
    sampler.join()
    comm.barrier()
    out.put(
        {
            "rank": rank,
            "seconds": dt,
            "peak_rss_mib": rss_mib(),
            "rss_before_mib": base,
            "extra_peak_mib": rss_mib() - base,
            "scratch_mib": comm._coll_exec.scratch_bytes / 2**20,
            "staged_peak_mib": staged["peak"] / 2**20,
            "staged_msgs": ep.stats()["staged_msgs"] - msgs0,
            "sha256": hashlib.sha256(x.tobytes()).hexdigest(),
        }
    )
    comm._collectives_close()
    barrier.wait()  # nobody closes a connection a peer still sends on
    ep.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results/coll_memory.json")
    a = ap.parse_args()
    ctx = mp.get_context("fork")
    mgr = ctx.Manager()
    ports = mgr.dict()
    barrier = ctx.Barrier(a.ranks)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, a.ranks, a.mib, ports, barrier, out))
        for r in range(a.ranks)
    ]
    for p in procs:
        p.start()
    res = sorted((out.get(timeout=600) for _ in procs), key=lambda d: d["rank"])
    for p in procs:
        p.join(timeout=60)
    # the reference: the same inputs reduced in rank order in numpy
    count = a.mib * 2**20 // 4
    acc = np.random.default_rng(0).standard_normal(count, dtype=np.float32)
    for r in range(1, a.ranks):
        acc += np.random.default_rng(r).standard_normal(count, dtype=np.float32)
    ref = hashlib.sha256(acc.tobytes()).hexdigest()
    doc = {
        "ranks": a.ranks,
        "bytes": a.mib * 2**20,
        "bit_exact": all(d["sha256"] == ref for d in res),
        "per_rank": res,
        "note": "loopback planes, one process per rank, on a shared 2-core machine",
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    for d in res:
        print(
            f"rank {d['rank']}: {d['seconds']:.2f} s, peak RSS {d['peak_rss_mib']:.0f} MiB "
            f"({d['extra_peak_mib']:.0f} MiB above the {a.mib} MiB buffer and the runtime), "
            f"scratch {d['scratch_mib']:.1f} MiB, transport staging peak "
            f"{d['staged_peak_mib']:.1f} MiB ({d['staged_msgs']} messages staged)"
        )
    print("bit-exact vs numpy rank order:", doc["bit_exact"])


if __name__ == "__main__":
    main()
