"""Usage: rendezvous_load.py RANKS [LINKS] [SECONDS] [--fixed]

How much of a core rank 0's rendezvous thread takes once a group of RANKS is up and idle:
a real RendezvousServer (listening on 127.0.0.1 and LINKS - 1 more loopback addresses)
and RANKS simulated ranks in a child process (raw sockets: join, the table, a link to
each extra address, a heartbeat on every connection every interval, whatever the server
sends read and dropped). Prints the set-up's time (every rank joined, the table to each, the
links attached), the interval and the server thread's CPU over SECONDS (default 10) of
steady state. --fixed: the interval as it was before it grew with the
group (1 s at any size), for comparison."""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mrc.collectives import rendezvous as R  # noqa: E402

TIMEOUT = 60.0


def ranks_main(port: int, token: str, n: int, links: list[list], interval: float) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = []
    for r in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.recv(4096)  # hello
        info = {
            "rank": r,
            "host": f"h{r}",
            "pid": 100000 + r,
            "port": 40000 + r,
            "planes": [f"fd00:{p}::{r + 1:x}" for p in range(4)],
            "rates_bps": [1e9] * 4,
            "srh_offload": None,
        }  # a rank's, as Communicator's
        msg = {"op": "join", "version": R.VERSION, "token": token, "rank": r, "size": n,
               "timeout": TIMEOUT, "info": info}  # fmt: skip
        s.sendall((json.dumps(msg) + "\n").encode())
        socks.append(s)
    for s in socks:  # the table (large): read until its line ends
        parts = [s.recv(1 << 20)]
        while not parts[-1].endswith(b"\n"):
            parts.append(s.recv(1 << 20))
    for r in range(n):
        for addr, lport in links:
            s = socket.create_connection((addr, lport))
            s.recv(4096)
            s.sendall((json.dumps({"op": "attach", "token": token, "rank": r}) + "\n").encode())
            socks.append(s)
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    print("up", flush=True)
    hb = b'{"op": "hb"}\n'
    nxt = 0.0
    while True:
        now = time.monotonic()
        if now >= nxt:
            for s in socks:
                try:
                    s.send(hb)
                except OSError:
                    pass
            nxt = now + interval
        for key, _ in sel.select(max(0.0, nxt - time.monotonic())):
            try:
                if not key.fileobj.recv(65536):
                    return
            except OSError:
                pass


def thread_cpu(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0])
    nlinks = int(args[1]) if len(args) > 1 else 4
    secs = float(args[2]) if len(args) > 2 else 10.0
    if "--fixed" in sys.argv:
        R.BEAT_RANKS = 1 << 30
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    token = "l" * 32
    server = R.RendezvousServer(R.UniqueId("127.0.0.1", 0, token))
    server.add_links([f"127.0.0.{i + 2}" for i in range(nlinks - 1)])
    links = [list(x) for x in server._links]
    try:
        interval = R.heartbeat_interval(TIMEOUT, n)
    except TypeError:  # a build from before the interval grew with the group
        interval = R.heartbeat_interval(TIMEOUT)  # type: ignore[call-arg]
    started = time.monotonic()
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--ranks",
            str(server.uid.port),
            token,
            str(n),
            json.dumps(links),
            str(interval),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        setup = time.monotonic() - started
        setup_cpu = thread_cpu(server._thread.native_id or 0)
        time.sleep(2 * interval)  # into the steady state (not a synchronisation)
        tid = server._thread.native_id
        assert tid is not None
        c0, t0 = thread_cpu(tid), time.monotonic()
        time.sleep(secs)
        c1, t1 = thread_cpu(tid), time.monotonic()
        row = {"ranks": n, "links": nlinks, "interval_s": interval, "fixed": "--fixed" in sys.argv}
        row["setup_s"], row["setup_server_cpu_s"] = round(setup, 2), round(setup_cpu, 2)
        row["server_core_pct"] = round(100 * (c1 - c0) / (t1 - t0), 2)
        print(json.dumps(row))
    finally:
        child.kill()
        child.wait()
        server.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ranks"]:
        a = sys.argv[2:]
        ranks_main(int(a[0]), a[1], int(a[2]), json.loads(a[3]), float(a[4]))
    else:
        main()
