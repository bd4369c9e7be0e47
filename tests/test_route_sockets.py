"""Route sockets are shared by every peer behind the same spine: an endpoint opens one
UDP socket per (plane, SRv6 segments before the destination), since the kernel writes
each sendto() destination into the SRH's last segment. One hub on h0 connects to many
endpoints on the other hosts of the 4-plane fabric, sends each its own data over every
(plane, spine) path, and every peer gets exactly its bytes (a shared socket that sent to
the wrong host or port would break a hash); the hub holds one socket per plane plus one
per (plane, spine), not one per path of every peer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.root

ROOT = Path(__file__).resolve().parent.parent
FABRIC = ROOT / "tests" / "fabrics" / "4host-4plane-fast.toml"
PEER_HOSTS = ["h1", "h2", "h3"]
PER_HOST = 4  # 12 peers x 8 paths: 96 route sockets if each path had its own
SIZE = 256 << 10

# Shared by both scripts: the bytes the hub sends to peer (host, index).
_DATA = r"""
import hashlib, json, sys, threading
import numpy as np
from mrc.paths import fabric_endpoint
def data(host, k, size):
    return np.random.default_rng([int(host[1:]), k]).integers(0, 256, size, np.uint8)
"""

# In a peer host: PER_HOST endpoints listen, print their ports, then each accepts the
# hub and receives one SEND; prints {index: sha256 of what arrived}, and keeps the
# endpoints until stdin closes (closing earlier could fail the hub's SEND before its
# last ACK arrived).
_PEERS = (
    _DATA
    + r"""
fabric, host, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
eps = [fabric_endpoint(fabric, host) for _ in range(n)]
print(json.dumps([fe.listen() for fe in eps]), flush=True)
out = {}
conns = []  # kept open with the endpoints: a connection closed as soon as its RECV
            # completed could fail the hub's SEND before its last ACK arrived there
def serve(k):
    fe = eps[k]
    conn = fe.accept(timeout=30)
    conns.append(conn)
    buf = np.zeros(size, np.uint8)
    conn.recv(fe.endpoint.register(buf)).wait(timeout=30)
    out[k] = hashlib.sha256(buf).hexdigest()
ts = [threading.Thread(target=serve, args=(k,)) for k in range(n)]
for t in ts: t.start()
for t in ts: t.join()
out["gro_reads"] = sum(fe.endpoint.stats()["rx_gro_reads"] for fe in eps)
print(json.dumps(out), flush=True)
sys.stdin.read()
for fe in eps: fe.close()
"""
)

# On h0: connect to every (host, port), SEND each its data, print the stats.
_HUB = (
    _DATA
    + r"""
fabric, size, peers = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
fe = fabric_endpoint(fabric, "h0")
ops = []
for host, k, port in peers:
    conn = fe.connect(host, port, timeout=30)
    src = data(host, k, size)
    ops.append((conn, src, conn.send(fe.endpoint.register(src, remote_write=False))))
for _, _, op in ops:
    op.wait(timeout=30)
st = fe.endpoint.stats()
keys = ("sockets", "sockets_seg6route", "conns", "tx_pkts", "tx_sends")
print(json.dumps({k: st[k] for k in keys}), flush=True)
fe.close()
"""
)


def _python(
    fab: Any, host: str, script: str, *args: object, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", script, *map(str, args)]
    return fab.popen(host, cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE, cwd=ROOT, env=env)


@pytest.mark.parametrize("srh", ["route", "socket"])
def test_one_socket_per_plane_and_spine_serves_every_peer(srh: str) -> None:
    """srh=route (the default as root): each route socket's SRH comes from a kernel seg6
    route picked by its mark, and the peers read the hub's GSO batches whole (on a kernel
    without seg6 lwtunnels: the sticky header, and nothing left behind); srh=socket
    (MRC_SRH=socket): the sticky routing header, same bytes, batches cut at the sender."""
    import os

    from conftest import require_root

    require_root()
    import hashlib

    import numpy as np

    from mrc.fabric.netns import kernel_has_seg6local
    from mrc.fabric.testing import fabric_up

    with fabric_up(FABRIC) as fab:
        procs = {h: _python(fab, h, _PEERS, FABRIC, h, PER_HOST, SIZE) for h in PEER_HOSTS}
        try:
            peers = []
            for h, p in procs.items():
                assert p.stdout is not None
                ports = json.loads(p.stdout.readline())
                peers += [[h, k, port] for k, port in enumerate(ports)]
            env = {**os.environ, "MRC_SRH": srh}
            hub = _python(fab, "h0", _HUB, FABRIC, SIZE, json.dumps(peers), env=env)
            out, _ = hub.communicate("", timeout=120)
            assert hub.returncode == 0, out
            st = json.loads(out.strip().splitlines()[-1])
            got = {}
            gro_reads = 0
            for h, p in procs.items():
                out, _ = p.communicate("", timeout=60)
                assert p.returncode == 0, out
                res = json.loads(out.splitlines()[-1])
                gro_reads += res.pop("gro_reads")
                got.update({(h, int(k)): v for k, v in res.items()})
            kernel = [sys.executable, "-m", "mrc.routing.cli", "kernel", "--json"]
            tables = json.loads(fab.run("h0", kernel).stdout)["tables"]
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()

        for h, k, _ in peers:
            rng = np.random.default_rng([int(h[1:]), k])
            want = hashlib.sha256(rng.integers(0, 256, SIZE, np.uint8)).hexdigest()
            assert got[(h, k)] == want, f"peer {h}#{k} got other bytes than were sent to it"
        routes = {(p.plane, tuple(p.segments[:-1])) for h in PEER_HOSTS for p in fab.paths("h0", h)}
        assert st["conns"] == len(peers) == len(PEER_HOSTS) * PER_HOST
        assert len(routes) == 8  # 4 planes x 2 spines
        assert st["sockets"] == fab.fabric.planes + len(routes), st
        if srh == "route" and not kernel_has_seg6local():
            # A kernel without seg6 lwtunnels: every route socket falls back to the
            # sticky header (the bytes above arrived) and leaves no rule or table behind.
            assert st["sockets_seg6route"] == 0 and tables == [], (st, tables)
        elif srh == "route":
            assert st["sockets_seg6route"] == len(routes), st
            # One table per (plane, spine route), holding exactly its segments.
            assert sorted(tuple(t["segs"][:-1]) for t in tables) == sorted(
                tuple(segs) for _, segs in routes
            ), tables
            assert gro_reads > 0  # GSO batches arrived whole, SRH and all
            fab.run("h0", [*kernel, "--flush"])
            assert json.loads(fab.run("h0", kernel).stdout)["tables"] == []
        else:
            assert st["sockets_seg6route"] == 0 and tables == [], (st, tables)
