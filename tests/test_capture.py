"""The scapy layer and tools/mrc_capture.py on a real capture: a transfer with
receive-side loss, recorded on loopback with tcpdump, summarised per connection."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import connected_pair, pattern, sha

pytest.importorskip("scapy.all")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import mrc_capture  # noqa: E402

from mrc import scapy as ms  # noqa: E402


def test_layer_round_trip_and_binding() -> None:
    from scapy.all import IP, UDP, raw

    pkt = ms.MRC(type=1, flags="FIRST", conn=7, psn=9) / ms.MRCData(key=5, msg_len=3) / b"abc"
    data = raw(pkt)
    assert len(data) == 24 + 32 + 3 and data[6:8] == b"\x03\x00"
    back = ms.MRC(data)
    assert back[ms.MRCData].key == 5 and bytes(back[ms.MRCData].payload) == b"abc"
    ms.bind_port(ms.DEFAULT_PORT)
    ms.bind_port(ms.DEFAULT_PORT)  # idempotent
    on_port = IP(raw(IP() / UDP(sport=1, dport=ms.DEFAULT_PORT) / pkt))
    assert on_port.haslayer(ms.MRC)
    anywhere = IP(raw(IP() / UDP(sport=1, dport=2) / pkt))
    assert ms.decode(anywhere) is not None and ms.decode(anywhere).psn == 9
    ack = ms.MRC(raw(ms.MRC(type=3) / ms.MRCAck(sack_base=100, sack=[0b1011] + [0] * 7)))
    assert ms.sack_psns(ack[ms.MRCAck]) == [100, 101, 103]
    assert ack.len == 0 and ack[ms.MRCAck].echoes == []
    echoes = [ms.MRCAckEcho(path=p, psn=200 + p, ts=7 * p, rx_ts=9 * p) for p in (2, 5)]
    ack = ms.MRC(raw(ms.MRC(type=3, path=1) / ms.MRCAck(echo_rx_ts=3, echoes=echoes)))
    assert ack.len == 2 * ms.ECHO_LEN == 48  # the further echoes' bytes
    assert ack[ms.MRCAck].echo_rx_ts == 3
    assert [(e.path, e.psn, e.ts, e.rx_ts) for e in ack[ms.MRCAck].echoes] == [
        (2, 202, 14, 18),
        (5, 205, 35, 45),
    ]
    assert mrc_capture.sack_ranges([100, 101, 103]) == [(100, 101), (103, 103)]


def test_gso_datagram_splits_into_its_packets() -> None:
    """A UDP GSO datagram caught before the stack cut it holds several mrc packets back
    to back; decode_all finds each by its header's len (a trailing fragment is left)."""
    from scapy.all import IP, UDP, raw

    body = [bytes([i]) * (10 + i) for i in range(3)]
    data = [raw(ms.MRC(type=1, psn=i) / ms.MRCData(msn=i) / body[i]) for i in range(3)]
    ack = raw(ms.MRC(type=3, psn=7) / ms.MRCAck(echoes=[ms.MRCAckEcho(path=1)]))
    probe = raw(ms.MRC(type=5, psn=8))
    blob = b"".join(data) + ack + probe + data[0][:30]
    pkts = ms.decode_all(IP(raw(IP() / UDP(sport=1, dport=2) / blob)))
    assert [m.type for m in pkts] == [1, 1, 1, 3, 5]
    assert [m.psn for m in pkts] == [0, 1, 2, 7, 8]
    assert [bytes(m[ms.MRCData].payload) for m in pkts[:3]] == body


def test_data_carrying_an_ack_decodes_and_splits() -> None:
    """Wire v4: DATA with flag ACKS holds a whole ACK packet between its extension and
    its payload; the layer builds and reads it, and a GSO run of such packets splits."""
    from scapy.all import IP, UDP, raw

    ack = ms.MRC(type=3, conn=7, psn=40) / ms.MRCAck(echoes=[ms.MRCAckEcho(path=2, psn=39)])
    pkt = ms.MRC(type=2, flags="FIRST+LAST+ACKS", conn=7, psn=9) / ms.MRCData(msg_len=5) / ack
    data = raw(pkt / b"hello")
    assert len(data) == 24 + 32 + 24 + 80 + 24 + 5
    assert data[6:8] == b"\x05\x00" and data[56 + 6 : 56 + 8] == b"\x18\x00"
    back = ms.MRC(data)
    inner = back[ms.MRCData].payload
    assert inner.type == 3 and inner.psn == 40 and inner[ms.MRCAck].echoes[0].path == 2
    assert bytes(inner[ms.MRCAck].payload) == b"hello"
    pkts = ms.decode_all(IP(raw(IP() / UDP(sport=1, dport=2) / (data + data + data[:30]))))
    assert [(m.type, m.psn) for m in pkts] == [(2, 9), (2, 9)]


def _acks_echo_both(pcap: Path, conn: int) -> bool:
    """Whether the capture so far holds an ACK to `conn` that echoes more than one path."""
    from scapy.utils import rdpcap

    time.sleep(0.05)  # let tcpdump write the last ACKs (the loop only reads more often)
    c = mrc_capture.summarise(rdpcap(str(pcap))).get(conn)
    return c is not None and c.total().echoes > c.total().acks


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tcpdump") is None,
    reason="needs root and tcpdump (Debian package tcpdump)",
)
def test_capture_summary_sees_transfer_and_retransmits(tmp_path: Path) -> None:
    pcap = tmp_path / "run.pcap"
    size = 4 << 20
    with connected_pair(2) as p:
        ports = [port for _, port in p.a.planes + p.b.planes]
        flt = " or ".join(f"udp port {x}" for x in ports)
        dump = subprocess.Popen(
            ["tcpdump", "-i", "lo", "-U", "-B", "65536", "-w", str(pcap), flt],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(1.0)
            src, dst = pattern(size, 8), np.zeros(size, np.uint8)
            ms_, md = p.a.register(src), p.b.register(dst)

            # Receive-side loss: packets reach the wire (and the capture), then
            # b's plane 1 drops them, so the sender sends the same PSNs again.
            def flap() -> None:
                time.sleep(0.002)
                p.b.inject(1, down=True)
                time.sleep(0.05)
                p.b.inject(1, down=False)

            t = threading.Thread(target=flap)
            t.start()
            for _ in range(4):
                p.ca.write(ms_, md.descriptor()).wait(timeout=30)
            t.join()
            # More writes with both planes carrying, until the capture holds an ACK that
            # echoes both: the four above can all end while plane 1 is still down (16 MiB
            # on loopback take a few ms), and one write after the heal can still go mostly
            # on plane 0 (CI once saw 2381 packets on plane 0 and 285 on plane 1, and no
            # receive pass took packets from both). tcpdump -U writes each packet as it
            # comes, so the file read between writes is the capture so far.
            deadline = time.monotonic() + 10
            while any(q["state"] != "good" for q in p.a.stats()["paths"]):
                assert time.monotonic() < deadline, p.a.stats()["paths"]
                time.sleep(0.005)  # polling the paths' state, bounded
            for _ in range(10):
                p.ca.write(ms_, md.descriptor()).wait(timeout=30)
                if _acks_echo_both(pcap, p.ca.ids[0]):
                    break
            assert sha(dst) == sha(src)
            time.sleep(0.5)
            st = p.a.stats()
        finally:
            dump.send_signal(signal.SIGINT)
            dump.wait(timeout=10)
        conn_b, conn_a = p.cb.ids[0], p.ca.ids[0]
    from scapy.utils import rdpcap

    conns = mrc_capture.summarise(rdpcap(str(pcap)))
    assert conn_b in conns, "no packet of the connection decoded"
    total = conns[conn_b].total()
    on_wire = st["tx_pkts"] - st["drops"]["injected"]
    assert total.data_pkts >= 0.9 * on_wire
    assert total.data_bytes >= 4 * size
    assert total.retx > 0 and total.retx <= st["retx"]
    acks = conns[conn_a].total()  # ACKs travel to a: its own conn id
    assert acks.acks > 0 and acks.sack_ranges > 0
    # One ACK answers every plane that delivered in a receive pass: with two
    # planes busy, some ACKs echo both, and both planes' paths are echoed.
    seen = {i: (ps.acks, ps.echoes) for i, ps in conns[conn_a].paths.items()}
    sent = [(q["plane"], q["tx_pkts"], q["state"]) for q in st["paths"]]
    assert acks.echoes > acks.acks, f"ACKs, echoes per path {seen}; sender's paths {sent}"
    assert all(conns[conn_a].paths[i].echoes > 0 for i in range(2)), (seen, sent)
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "mrc_capture.py"), "--json", str(pcap)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"{conn_b:08x}" in out and '"retx"' in out
