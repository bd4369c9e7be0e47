"""Usage (root): coll_counters.py [SIZES] [ITERS] [FABRIC_FILE]

Where does a collective's time go on the shaped fabric? all_reduce f32 sum with 4 ranks
under mrc-run on routing/4host-4plane-1g.toml (or FABRIC_FILE), each SIZES (bytes, comma-separated;
default 8,1048576,67108864) ITERS times (x30 up to 1 MiB). Prints per rank the median
time, busbw (nccl-tests' 2(n-1)/n), data_pkts_per_send (data packets per datagram
handed to the kernel: the GSO batches the fabric forwards) and the endpoint counters
that moved (lost_rto, lost_rack, probe_timeouts, rnr_naks, staged_msgs, and the
receivers' duplicates: a packet declared lost that had arrived), rank 0's per-path
(conn, plane, srtt us, base RTT us, cwnd KiB, lost, state changes); then, per host,
the UDP6 counters (RcvbufErrors: socket overflow) and the qdisc drops of every
namespace of the fabric. Drops zero with duplicates about lost_rto means the timeouts
were spurious: slow, not lost.
MRC_ROUTES=planes in the environment: one plain-IPv6 path per plane instead of the route
table's SRv6 paths (mrc.Communicator's routes); MRC_ALGO=chain (or direct, gather, hier): that
all_reduce algorithm; FAIL=h1-p1l0[,LINK...]: those links failed before the ranks start
(h1's plane 1: the resilient schedule's case). HOSTS=h0,h0,h1,h1,...: one rank per
entry on that host (mrc-run --hosts; default 4 ranks, one per host).

Run inside a rank (by itself): coll_counters.py --rank SIZES ITERS."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FABRIC = ROOT / "routing" / "4host-4plane-1g.toml"
KEYS = (
    "lost_rto",
    "spurious_rto",
    "lost_rack",
    "probe_timeouts",
    "rnr_naks",
    "staged_msgs",
    "tx_pkts",
    "tx_sends",
    "acks_tx",
    "rx_pkts",
    "rx_reads",
)


def counters(stats: dict) -> dict:
    e = stats["endpoint"]
    return {**{k: e[k] for k in KEYS}, "dup": e["drops"]["duplicate"]}


def rank_main(sizes: list[int], iters: int) -> None:
    import numpy as np

    import mrc

    comm = mrc.Communicator.from_env()
    for nbytes in sizes:
        x = np.full(max(1, nbytes // 4), comm.rank + 1, np.float32)
        y = np.empty_like(x)
        comm.all_reduce(x, y)
        comm.barrier()
        before = counters(comm.stats())
        times = []
        for _ in range(iters if nbytes > 1 << 20 else 30 * iters):
            t = time.perf_counter()
            comm.all_reduce(x, y)
            times.append(time.perf_counter() - t)
        if not (y == sum(range(1, comm.size + 1))).all():
            raise SystemExit(f"rank {comm.rank}: wrong sum at {nbytes} bytes")
        after = counters(comm.stats())
        med = float(np.median(times))
        row = {
            "rank": comm.rank,
            "bytes": nbytes,
            "median_us": round(med * 1e6, 1),
            "max_us": round(max(times) * 1e6, 1),
            "slowest_op": int(np.argmax(times)),
            "busbw_gbps": round(nbytes * 2 * (comm.size - 1) / comm.size / med * 8e-9, 3),
            **{k: after[k] - before[k] for k in after},
        }
        # Data packets per datagram the sender handed the kernel (tx_pkts counts data
        # packets only; ACKs leave one per datagram): what the fabric's per-datagram
        # work scales with.
        data_sends = row["tx_sends"] - row["acks_tx"]
        row["data_pkts_per_send"] = (
            round(row["tx_pkts"] / data_sends, 2) if data_sends > 0 else None
        )
        print(json.dumps(row), flush=True)
        if comm.rank == 0:
            paths = [
                (p["conn"], p["plane"], round(p["srtt_us"]), round(p["base_rtt_us"]))
                + (p["cwnd"] >> 10, p["lost"], p["state_changes"])
                for p in comm.stats()["endpoint"]["paths"]
            ]
            print("paths (conn, plane, srtt, base, cwnd KiB, lost, changes):", paths, flush=True)
    comm.close()


def host_counters(fab) -> dict:
    out = {}
    for h in fab.fabric.hosts[:4]:
        text = subprocess.run(
            ["ip", "netns", "exec", fab.ns(h.name), "cat", "/proc/net/snmp6"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        d = {ln.split()[0]: int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("Udp6")}
        out[h.name] = {k: d["Udp6" + k] for k in ("InDatagrams", "RcvbufErrors", "InErrors")}
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns in (ln.split()[0] for ln in names.splitlines() if ln.startswith(fab.prefix)):
        text = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "-s", "qdisc"], capture_output=True, text=True
        ).stdout
        out.setdefault("qdisc_drops", {})[ns] = sum(map(int, re.findall(r"dropped (\d+)", text)))
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from mrc.fabric.testing import fabric_up

    args = sys.argv[1:]
    sizes = [int(s) for s in (args[0] if args else "8,1048576,67108864").split(",")]
    iters = int(args[1]) if len(args) > 1 else 3
    with fabric_up(args[2] if len(args) > 2 else FABRIC) as fab:
        for link in filter(None, os.environ.get("FAIL", "").split(",")):
            fab.fail(link)
        before = host_counters(fab)
        hosts = [h for h in os.environ.get("HOSTS", "").split(",") if h]
        cmd = [sys.executable, "-m", "mrc.run", "-n", str(len(hosts) or 4), "--fabric", fab.file]
        cmd += ["--hosts", ",".join(hosts)] if hosts else []
        cmd += ["--name", fab.prefix, "--timeout", "120", "--"]
        cmd += [sys.executable, __file__, "--rank", ",".join(map(str, sizes)), str(iters)]
        run = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
        print(run.stdout, run.stderr[-2000:], sep="")
        after = host_counters(fab)
        for host, c in after.items():
            old = before[host]
            print(host, {k: v - old.get(k, 0) for k, v in c.items() if v != old.get(k, 0)})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main([int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]))
    else:
        main()
