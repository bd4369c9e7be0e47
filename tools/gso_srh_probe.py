"""Does a UDP GSO batch stay whole across the SRv6 fabric? A kernel fact, measured.

As root: brings up routing/4host-4plane-1g.toml, and on h0 sends 2,000 GSO datagrams of
7 x 8248 bytes (mrc's packet size at MSS 8192) to a UDP_GRO socket on h2, three ways:

  srh    a sticky SRH on the socket (how mrc's route sockets send today)
  plain  no SRH (the fabric's plain IPv6 routes)
  encap  no SRH on the socket; a policy route (SO_MARK) encapsulates at the sender,
         `encap seg6 mode encap.red` with one SID, decapsulated by End.DT6 on h2

and prints, for each, the reads the receiver made and the packets h0's NIC sent.
On Linux 6.18: srh 14,000 reads (the batch is cut into datagrams at the sender: packets
with an IPv6 extension header lose UDP GSO offload), plain and encap 2,000 (whole to the
receiving socket). See docs/architecture.md, "Batching".

    sudo .venv/bin/python tools/gso_srh_probe.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mrc.fabric.testing import RunningFabric, fabric_up
from mrc.routing.srh import build_srh

FABRIC = Path(__file__).resolve().parent.parent / "routing" / "4host-4plane-1g.toml"
PORT, MARK, TABLE = 47001, 7, 100

RECEIVER = r"""
import select, socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
s.bind((sys.argv[1], int(sys.argv[2])))
s.setsockopt(17, 104, 1)  # SOL_UDP, UDP_GRO
print("ready", flush=True)
reads = nbytes = 0
while select.select([s], [], [], 2.0)[0]:
    reads += 1
    nbytes += len(s.recv(65536))
print(reads, nbytes, flush=True)
"""

SENDER = r"""
import socket, struct, sys
src, dst, port, srh, mark = sys.argv[1:6]
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, int(mark))
s.bind((src, 0))
if srh:
    s.setsockopt(41, 57, bytes.fromhex(srh))  # IPV6_RTHDR, sticky
batch = b"x" * (8248 * 7)
for _ in range(2000):
    s.sendmsg([batch], [(17, 103, struct.pack("H", 8248))], 0, (dst, int(port)))  # UDP_SEGMENT
"""


def sh(fab: RunningFabric, element: str, cmd: str) -> None:
    fab.run(element, cmd.split())


def tx_packets(fab: RunningFabric, host: str, dev: str) -> int:
    out = fab.run(host, ["ip", "-j", "-s", "link", "show", dev]).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["packets"])


def main() -> None:
    with fabric_up(FABRIC, prefix="gsop") as fab:
        p = fab.paths("h0", "h2")[0]  # plane 0, the first spine
        # The decapsulating SID: inside h2's plane-0 prefix, routed (not on-link) to h2.
        sid = p.dst_addr.rsplit("::", 1)[0] + "::d6"
        sh(
            fab,
            "h2",
            f"ip -6 route add {sid}/128 encap seg6local action End.DT6 table local dev nic0",
        )
        leaf = p.crosses[-3]  # (..., leaf, link, "h2"): the leaf h2 hangs off
        sh(fab, leaf, f"ip -6 route add {sid}/128 via {p.dst_addr} dev h2")
        sh(fab, "h0", f"ip -6 rule add fwmark {MARK} table {TABLE}")
        sh(
            fab,
            "h0",
            f"ip -6 route add {p.dst_addr}/128 encap seg6 mode encap.red segs {sid} "
            f"dev nic0 table {TABLE}",
        )
        cases = {"srh": (build_srh(p.segments).hex(), 0), "plain": ("", 0), "encap": ("", MARK)}
        for name, (srh, mark) in cases.items():
            rx = fab.popen(
                "h2",
                [sys.executable, "-c", RECEIVER, p.dst_addr, str(PORT)],
                stdout=subprocess.PIPE,
            )
            assert rx.stdout is not None
            rx.stdout.readline()
            before = tx_packets(fab, "h0", "nic0")
            args = [p.src_addr, p.dst_addr, str(PORT), srh, str(mark)]
            fab.run("h0", [sys.executable, "-c", SENDER, *args])
            reads, nbytes = rx.communicate()[0].split()
            sent = tx_packets(fab, "h0", "nic0") - before
            print(f"{name:6s} {int(reads):6d} reads, {int(nbytes):10d} bytes; h0 nic0 sent {sent}")


if __name__ == "__main__":
    main()
